"""The same-host channel's flow control in numbers (:mod:`objcomm._samehost.inbox`, "Flow control"), and the credit a
receiver lends a sender whose messages under other tags wait in its stash.

A sender has :func:`window_for` bytes of credit per class at each receiver; a message costs :func:`credit_cost`. A
receiver gives credit back as its calls take messages. Send/recv messages under a tag the receiver does not take yet
keep their credit while they wait in its stash: a one-way stream whose receiver takes its tags in another order than
they were sent (all of tag 2, then of tag 1: a correct MPI program, each ``isend`` completing once its receive is
posted) stopped once a window of the other tags waited there, the sender waiting for credit and the receiver for a
message behind them, until the timeout (a helper's find). So a receive that waits for a rank whose send/recv messages
under other keys sit in the stash lends that rank their credit (:class:`Lending`), up to :data:`LEND_BYTES` in all
on a channel, which the stash may then hold besides its own limit: the sender sends on, and the receiver's memory
stays bounded (past it the stash fails the channel, as for a flood, saying so). The lent credit is paid back as
those messages are taken (they are not counted again).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

STASH_BYTES = 64 << 20  # the most one channel keeps for calls not yet made (up to 30 peers: see stash_for)
WINDOW_BYTES = 8 << 20  # the most credit one peer gets for one class (up to 4 peers; less with more)
MIN_WINDOW = 1 << 20  # and the least: a quarter of it, when credit is granted back, holds the largest message
RESERVE = 4 << 20  # the stash's room for what takes no credit (answers, keys) besides the windows
ENTRY_OVERHEAD = 256  # bytes a stashed message is counted for besides its payload
KEY_OVERHEAD = 768  # and a key (a tag, a sequence number) that has messages waiting: its queue and dict slot
MESSAGE_COST = ENTRY_OVERHEAD + KEY_OVERHEAD  # a message's credit past its payload (credit_cost)
LEND_BYTES = 64 << 20  # the most credit a receiver lends its senders at once (Lending), beyond STASH_BYTES


def window_for(peers: int) -> int:
    """A sender's credit per class at one receiver of a channel of ``peers`` other ranks (see "Flow control")."""
    return max(MIN_WINDOW, min(WINDOW_BYTES, (STASH_BYTES - RESERVE) // (2 * max(peers, 1))))


def stash_for(peers: int) -> int:
    """The stash a receiver needs so that every peer's two windows fit, with :data:`RESERVE` to spare."""
    return max(STASH_BYTES, 2 * peers * window_for(peers) + RESERVE)


def credit_cost(data_bytes: int) -> int:
    """What a message of ``data_bytes`` costs its sender's credit: what the receiver's stash counts for it at most."""
    return data_bytes + MESSAGE_COST


class Lending:
    """Per peer: the send/recv credit its messages in the stash hold (:meth:`held`, kept by the stash), and what of it
    was lent ahead; all under the stash's lock.

    >>> lending = Lending(most=100)
    >>> lending.held(1, 80); lending.lend(1, minimum=10)
    80
    >>> lending.repaid(1, 30), lending.total  # a taken message lent for counts nothing more
    (0, 50)
    """

    def __init__(self, most: int = LEND_BYTES) -> None:
        self.most = most
        self.total = 0  # lent and not yet paid back, all peers
        self._held: Dict[int, int] = {}
        self._lent: Dict[int, int] = {}

    def held(self, peer: int, change: int) -> None:
        """``peer``'s send/recv messages in the stash now hold ``change`` credit bytes more (or less)."""
        self._held[peer] = self._held.get(peer, 0) + change

    def lend(self, peer: int, minimum: int) -> int:
        """Lend ``peer`` the credit its stashed messages hold and that was not lent yet, where that is at least
        ``minimum`` (else nothing: a wait lends in steps, not a message at a time), within :attr:`most` in all; how
        much (the caller counts it as taken)."""
        amount = min(self._held.get(peer, 0) - self._lent.get(peer, 0), self.most - self.total)
        if amount < minimum or amount <= 0:
            return 0
        self._lent[peer] = self._lent.get(peer, 0) + amount
        self.total += amount
        return amount

    def repaid(self, peer: int, cost: int) -> int:
        """What a message of ``peer``'s that costs ``cost`` still counts as taken, where credit was lent for it."""
        lent = self._lent.get(peer, 0)
        if not lent:
            return cost
        paid = min(lent, cost)
        self._lent[peer] = lent - paid
        self.total -= paid
        return cost - paid


def unreceived(lending: Lending, peers: Sequence[int], tag: int, stash: Mapping[int, Mapping[Any, Any]]) -> str:
    """What a receive under ``tag`` that timed out waiting for ``peers`` says of them: where their send/recv messages
    under other tags wait in the stash (``stash``: per peer, by key ``(collective, tag)``), unreceived, that is why:
    they came under other tags, or past :data:`LEND_BYTES` lent their senders wait."""
    held = sum(lending._held.get(peer, 0) for peer in peers)
    if not held:
        return f" under tag {tag} (no other tag matches it)"
    tags = sorted({key[1] for peer in peers for key in stash.get(peer, {}) if not key[0]})
    waiting = f"{held:,} bytes of their messages under other tags ({', '.join(map(str, tags[:8]))}"
    waiting += ", ...) " if len(tags) > 8 else ") "
    if lending.total < lending.most:  # (their senders were not held back: the messages came under other tags)
        return (
            f" under tag {tag}, while {waiting}wait here unreceived: a recv takes its own tag only (0 unless given; "
            "mpi4py's recv() takes any), so receive under those tags"
        )
    return (
        f" under tag {tag}, while {waiting}wait here unreceived: past the {lending.most:,} bytes of credit lent for "
        "such messages, a sender waits for them to be received before it sends more. Receive those first, post irecv "
        "for them first, or send fewer before they are received"
    )
