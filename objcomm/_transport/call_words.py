"""Which collective a rank is in, as one word that every same-host channel message of the call carries.

The channel already fails at once where a peer's message for this collective is of another kind (an all_gather's
where this rank broadcasts). Ranks can also make the *same* collective with another root: ``reduce(dst=1)`` on one
rank, ``dst=0`` on the others. Its messages then look alike, and a rank could return a wrong result without a word
(the one that took itself for the destination returned None). So each call sets its word, its operation and root
(:func:`enter`, by the object API at the start of every collective, and by the express path), every channel
collective puts it in its header (the tag field, unused by collectives), and a receiver whose own word differs fails
the channel, naming both calls: every rank of the call raises :class:`~objcomm.CommunicationError` there. No
message more, no byte more. The word is per thread (a :class:`contextvars.ContextVar`), as the calls are.

Example::

    >>> enter("broadcast", 1); described(current())
    'broadcast(src=1)'
"""

from __future__ import annotations

import zlib
from contextvars import ContextVar
from typing import Dict, Mapping, Optional, Tuple

from objcomm._transport import patterns
from objcomm._transport.patterns import ROWS

OPS = patterns.OPS + patterns.REDUCTIONS  # the built-in collectives, in the order of their words' codes
_ROOT_BITS = 16  # a root past 65,534 ranks wraps: such groups tell fewer roots apart, never a wrong result more
_LAST_CODE = (1 << (31 - _ROOT_BITS)) - 1  # a word is a message header's signed 32-bit tag
WORD: ContextVar[int] = ContextVar("objcomm_call_word", default=0)  # (the channel reads it: WORD.get())
WORDS: Dict[Tuple[str, Optional[int]], int] = {}  # (op, root) -> its word, once made (word_of)


def enter(op: str, root: Optional[int] = None) -> None:
    """This thread's calls are now ``op`` with group rank ``root`` (gather's and reduce's destination, broadcast's and
    scatter's source; None for the others) until the next: the word its channel messages carry."""
    WORD.set(WORDS.get((op, root)) or word_of(op, root))


def word_of(op: str, root: Optional[int] = None) -> int:
    """The word of ``op`` with group rank ``root``, as :func:`enter` sets it (never 0), kept in :data:`WORDS`."""
    if len(WORDS) > 4096:
        WORDS.clear()
    code = _code(op)
    word = WORDS[op, root] = code << _ROOT_BITS | (0 if root is None else (root + 1) % (1 << _ROOT_BITS))
    return word


def leave() -> None:
    """No collective of the object API: what a channel message sent now carries (0)."""
    WORD.set(0)


def current() -> int:
    """The word of this thread's call (0 outside one)."""
    return WORD.get()


def described(word: int) -> str:
    """``word`` as the call it stands for: ``reduce(dst=1)``, ``all_gather()``; the group rank of the root."""
    code, root = word >> _ROOT_BITS, word & ((1 << _ROOT_BITS) - 1)
    op = OPS[code - 1] if 0 < code <= len(OPS) else next((op for op in list(ROWS) if _code(op) == code), None)
    if op is None:
        return "no collective of objcomm's object API" if word == 0 else f"an unknown call (word {word})"
    return f"{op}({_root_name(op)}={root - 1})" if root else f"{op}()"


def _root_name(op: str) -> str:
    """The keyword of ``op``'s root (``root`` for a call that has none: a word no call makes)."""
    if op == "reduce":
        return "dst"
    row = ROWS.get(op)
    return row.root if row is not None and row.root else "root"


def _code(op: str) -> int:
    """``op``'s code in its word: its place in :data:`OPS`, or for a collective added to
    :data:`objcomm._transport.patterns.ROWS` since, one from its name alone (the same on every rank, whatever
    order ranks added rows in; two names that share one are told apart less, never refused wrongly)."""
    if op in OPS:
        return OPS.index(op) + 1
    return len(OPS) + 1 + zlib.crc32(op.encode()) % (_LAST_CODE - len(OPS))


def other_call(peer: int, theirs: int, mine: int, kinds: Mapping[int, str]) -> str:
    """Why a channel message of ``peer`` is not the one this rank's call takes: its kind and word (``kind | word << 8``,
    as the channel's stash keeps them: ``kinds`` names the kinds) against this rank's."""
    if (theirs ^ mine) & 0xFF:
        said = f"rank {peer} called {kinds.get(theirs & 0xFF, theirs & 0xFF)} instead"
        return said if theirs >> 8 == mine >> 8 else f"{said} (its call: {described(theirs >> 8)})"
    return (
        f"rank {peer} called {described(theirs >> 8)} where this rank called {described(mine >> 8)} (roots as group "
        "ranks): every rank of a group must make the same collective with the same root"
    )
