"""What a receiver checks before it allocates: the sizes a sender announces must agree with each other.

A sender's slot announces its frame length, its total (frame plus tensors) and, where they fit,
the tensor sizes; its frame's tensor table announces them again. A receiver never trusts one
number alone: every size it will allocate is compared with the total the limits were checked
against, so a sender that under-reports cannot slip a larger transfer past ``max_bytes``.
These functions only compare numbers; the transport decides who raises and when, so that every
rank that must act on a disagreement learns of it in the same round.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple

from objcomm._errors import FrameError, ObjcommError, TooLargeError

SizesOf = Callable[[memoryview], List[int]]

SCRATCH_BYTES = 1 << 20  # the most a refusing receiver holds while it drains a transfer it will drop
MAX_SIZE = 1 << 62  # no announced size (frame, tensor, total) may reach this
# the most pieces one rest may move in (a slot announces its sender's piece size): a sender that announced pieces of a
# byte would otherwise have its receivers post a receive per byte
MOST_PIECES = 1 << 18


def slot_problem(length: int, total: int, error: bool, inline: bool, sizes: Optional[Sequence[int]]) -> Optional[str]:
    """What disagrees inside one slot (frame length, total, listed tensor sizes), or ``None``."""
    if error and not inline:
        return f"an error report of {length:,} bytes does not fit its slot"
    if total >= MAX_SIZE:
        return f"it announces {total:,} bytes in total"
    if length > total:
        return f"its frame alone is {length:,} bytes, more than the {total:,} bytes it announces in total"
    if sizes is not None and length + sum(sizes) != total:
        return (
            f"its frame ({length:,} bytes) and {len(sizes)} tensors ({sum(sizes):,} bytes) make "
            f"{length + sum(sizes):,} bytes, but it announces {total:,} in total"
        )
    return None


def table_problem(length: int, total: int, table: Sequence[int], listed: Optional[Sequence[int]]) -> Optional[str]:
    """What disagrees between a frame's tensor table and the sizes its slot announced, or ``None``."""
    if listed is not None and list(table) != list(listed):
        shown = list(table[:4]) + (["..."] if len(table) > 4 else [])
        return f"its frame's tensor table lists {len(table)} tensors {shown}, its slot {len(listed)} of other sizes"
    if length + sum(table) != total:
        return (
            f"its frame ({length:,} bytes) and the {len(table)} tensors of its table ({sum(table):,} bytes) "
            f"make {length + sum(table):,} bytes, but it announces {total:,} in total"
        )
    return None


def table_sizes(sizes_of: SizesOf, frame: memoryview) -> tuple[List[int], Optional[str]]:
    """``(sizes, problem)``: the frame's announced tensor sizes, or ``([], why)`` when the frame is malformed."""
    try:
        return sizes_of(frame), None
    except ObjcommError as exc:
        return [], f"its frame is malformed ({exc})"


def largest_piece(frame: int, sizes: Sequence[int], chunk: int) -> int:
    """The largest single transfer of a second round: ``frame`` bytes (0: it fit the slot) and ``sizes``, in chunks."""
    return min(chunk, max([frame, *sizes]))


def inconsistent(op: str, sender: int, problem: str) -> FrameError:
    versions = "" if "chunk_bytes" in problem else "Is every rank running the same objcomm version? "  # (pieces)
    return FrameError(
        f"{op}: rank {sender} sent inconsistent sizes: {problem}; nothing of that size was allocated. "
        f"{versions}The group is still usable"
    )


def too_large(
    what: str, *, outcome: str = "nothing was transferred", where: str = "on the receiving ranks"
) -> TooLargeError:
    """The one builder of :class:`TooLargeError` messages: ``what`` is too large (and whose limit it
    passes), then what happened and what to do."""
    return TooLargeError(
        f"{what}; {outcome}. Raise max_bytes {where} (per call, on the Communicator or with objcomm.configure) "
        "or send less"
    )


def check_limits(infos: Sequence[Any], receivers: Sequence[int], op: str, least: int) -> None:
    """The same TooLargeError on every rank when a payload exceeds a receiver's limit (all seen in round 1): for the
    first such receiver, the first sender past its limit. O(W): a receiver's limit matters only against the largest
    total of the *other* senders, the largest of all unless that is its own (then the second largest). ``least``:
    the frame bytes the settings' slot carries (its inline capacity); a frame alone within it comes with the slot
    every receiver takes (or, in a narrower slot, in the second round), and is accepted whatever the limit
    (:func:`accepted`; in a slot wider than the settings', a payload past ``least`` that came whole is dropped: it
    came in round 1)."""
    first = second = -1  # the largest and second-largest totals of senders without an error, and who sent the first
    biggest = -1
    for sender, info in enumerate(infos):
        if not info.error and not accepted(info, least):
            total = info.total
            if total > first:
                first, second, biggest = total, first, sender
            elif total > second:
                second = total
    for receiver in receivers:
        limit = infos[receiver].limit
        if (second if receiver == biggest else first) > limit:
            for sender, info in enumerate(infos):  # once: the message names the first sender past this limit
                if sender != receiver and not info.error and not accepted(info, least) and info.total > limit:
                    came = complete(info)  # (in a wider slot than the settings')
                    raise too_large(
                        f"{op}: rank {sender} sends {info.total:,} bytes, above the "
                        f"max_bytes={limit:,} of receiving rank {receiver}",
                        outcome="it came in round 1's slots, and was dropped" if came else "nothing was transferred",
                    )


def accepted(info: Any, least: int) -> bool:
    """Whether a sender's payload is accepted whatever a receiver's limit: a frame alone (no tensors) within
    ``least`` (the settings' slot's inline capacity: round 1 carries it whole there, or the second round where an
    all_gather narrowed its slot, :data:`objcomm._transport.routes.NARROW_SLOT`: the same payloads either way; a
    scatter's or all_to_all's part slot's, past 1024 ranks narrower than the settings', its own)."""
    return bool(info.total <= least and info.total == info.length)


def check_relays(
    infos: Sequence[Any], relays: Sequence[Tuple[int, Sequence[int]]], dst: int, op: str, least: int
) -> None:
    """:func:`check_limits` for the ranks that hold rests on their way to ``dst`` (``relays``: each such rank, with
    the senders whose rests it holds; a two-level gather's leaders): the same TooLargeError on every rank, naming the
    first sender past a relay's limit (``least``: as for :func:`check_limits`). O(the senders listed)."""
    for relay, senders in relays:
        limit = infos[relay].limit
        for sender in senders:
            info = infos[sender]
            if (
                sender != relay
                and sender != dst
                and not info.error
                and not accepted(info, least)
                and info.total > limit
            ):
                raise too_large(
                    f"{op}: rank {sender} sends {info.total:,} bytes, above the max_bytes={limit:,} of rank "
                    f"{relay}, which relays them to rank {dst} (a gather across hosts goes through each host's "
                    "leader, which holds its host's rests on the way: docs/multinode.md)",
                    where=f"on rank {relay} as on rank {dst}",
                )


def refused(
    op: str,
    sender: int,
    wire: Any,
    total: int,
    problem: Optional[str],
    drained: bool = False,
    into: Optional[str] = None,
) -> Exception:
    """Why this receiver refused ``sender``'s payload: its sizes disagree, or they exceed ``wire.max_bytes``.
    ``drained``: the bytes were received and dropped, ``into`` what (default: the backend's scratch buffer)."""
    if problem:
        return inconsistent(op, sender, problem)
    what = f"{op}: rank {sender} sends {total:,} bytes, above this rank's max_bytes={wire.max_bytes:,}"
    if not drained:
        return too_large(what, where="here")
    into = into or f"a scratch buffer of at most chunk_bytes={wire.chunk:,} and {SCRATCH_BYTES:,} bytes"
    return too_large(what, where="here", outcome=f"they were received into {into}, and dropped")


# -- a transport slot (objcomm._format.slot.SlotInfo: length, error, total, inline, sizes) ---------
def complete(info: Any) -> bool:
    """Round 1 carried everything its sender sends: the whole frame and no tensors."""
    return info.inline is not None and info.total == info.length


def round_one_ends(infos: Sequence[Any]) -> bool:
    """Whether a collective ends after round 1: some sender reported an error, or every slot is :func:`complete`."""
    ends = True
    for info in infos:  # a loop, not any() and all(): no generator on the path of every small call
        if info.error:
            return True
        ends = ends and info.inline is not None and info.total == info.length
    return ends


def slot_problem_of(info: Any) -> Optional[str]:
    problem = slot_problem(info.length, info.total, info.error, info.inline is not None, info.sizes)
    return problem or pieces_problem(info.second_round_bytes, info.piece)


def pieces_problem(moved: int, piece: int, what: str = "its rest") -> Optional[str]:
    """What is wrong with moving ``what``, ``moved`` bytes, in pieces of ``piece``, or ``None``."""
    if moved <= MOST_PIECES * piece:
        return None
    return (
        f"{what} of {moved:,} bytes would move in more than {MOST_PIECES:,} pieces of {piece:,} bytes "
        "(the chunk_bytes of its sender: raise it)"
    )


def common_piece(infos: Sequence[Any], op: str) -> int:
    """The pieces every rank moves the rests of an all_gather in (each read every slot): the smallest announced, the
    same on every rank; a FrameError on every rank alike where it cuts the widest rest into too many (naming the
    rank that announced it). (An all_to_all's ranks each read their own column of slots: its vote carries it.)"""
    piece, sender = min((int(info.piece), r) for r, info in enumerate(infos))
    problem = pieces_problem(max(info.second_round_bytes for info in infos), piece, "the widest rest")
    if problem:
        raise inconsistent(op, sender, f"it announced pieces of {piece:,} bytes: {problem}")
    return piece


def plan(info: Any, sizes_of: SizesOf) -> tuple[Optional[List[int]], Optional[str]]:
    """``(sizes, problem)`` from round 1 alone: the tensor sizes that follow (None: only the frame can tell)
    and what disagrees among slot, frame and table. Every rank holding the slot gets the same answer."""
    if info.inline is not None and info.total == info.length and not info.sizes:
        return info.sizes, None  # complete, nothing listed: slot_problem() finds nothing in such a slot
    problem = slot_problem_of(info)
    if problem or info.error or info.inline is None or (complete(info) and not info.sizes):
        return info.sizes, problem
    table, problem = table_sizes(sizes_of, info.inline)
    problem = problem or table_problem(info.length, info.total, table, info.sizes)
    return (info.sizes if info.sizes is not None else table), problem


def plans(infos: Sequence[Any], sizes_of: SizesOf, op: str) -> List[Optional[List[int]]]:
    """Every sender's :func:`plan`; every rank sees every slot, so a disagreement raises on all alike."""
    found = []
    for sender, info in enumerate(infos):
        sizes, problem = plan(info, sizes_of)
        if problem:
            raise inconsistent(op, sender, problem)
        found.append(sizes)
    return found


def frame_sizes(sizes_of: SizesOf, frame: memoryview, info: Any, sender: int, op: str) -> List[int]:
    """The tensor sizes of a frame that round 1 could not list, checked against its sender's total."""
    table, problem = table_sizes(sizes_of, frame)
    problem = problem or table_problem(info.length, info.total, table, None)
    if problem:
        raise inconsistent(op, sender, problem)
    return table


class CheckedSizes:
    """``sizes_of`` for the rest media (shared memory), which reads frames round 1 did not carry: each frame checked
    against its own sender's slot ``info`` (None: the senders are several, and :func:`for_sender` picks one's). Sizes
    that disagree raise OSError: every rank goes back to the normal transport, which raises FrameError. ``raw``: the
    ``sizes_of`` it checks, for a strategy that checks each frame against its own sender's slot itself (the
    same-host channel, which cannot go back)."""

    def __init__(self, sizes_of: SizesOf, info: Optional[Any] = None) -> None:
        self.raw, self.info = sizes_of, info

    def __call__(self, frame: memoryview) -> List[int]:
        info = self.info  # one sender's: O(1) a frame, where matching every slot was O(W)
        if info is None:
            raise ValueError("a checker of several senders' frames reads none itself: for_sender() gives one's")
        table, problem = table_sizes(self.raw, frame)
        if problem or frame.nbytes != info.length or table_problem(info.length, info.total, table, info.sizes):
            raise OSError(problem or "a shared-memory frame's tensor sizes disagree with its sender's slot")
        return table


def checked_sizes(sizes_of: SizesOf, infos: Sequence[Any]) -> SizesOf:
    """:class:`CheckedSizes` of ``sizes_of`` against ``infos``, the slots of the senders whose frames it reads (of
    several, :func:`for_sender` picks one's)."""
    return CheckedSizes(sizes_of, infos[0] if len(infos) == 1 else None)


def for_sender(sizes_of: SizesOf, info: Any) -> SizesOf:
    """``sizes_of`` (a :class:`CheckedSizes`) checking one sender's frame against that sender's slot ``info``."""
    return CheckedSizes(sizes_of.raw, info) if isinstance(sizes_of, CheckedSizes) else sizes_of
