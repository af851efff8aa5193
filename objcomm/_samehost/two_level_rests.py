"""The second round through two levels (:mod:`objcomm._samehost.two_level`): an all_gather's, broadcast's or
gather's bytes past the slots, where round 1 of the call went through two levels.

- all_gather: each host's ranks send their rests to the leader in messages of the channel (one channel gather a
  message, as many as the host's largest sender needs); the leaders exchange the hosts' bundles at exact sizes
  (:func:`objcomm._transport.exchange.all_gather_rests`: one collective of the leaders); each leader publishes every
  host's bundle to its host: from ``shm_threshold`` bytes on in one sealed shared file that the host's ranks map
  (one copy per host, :func:`objcomm._samehost.two_level_moves.publish_shared`), below it through the channel.
- broadcast: :func:`objcomm._samehost.two_level_moves.relay`, piece by piece.
- gather: each host's ranks send their rests to the leader (a stream of the channel each), each leader sends its
  host's bundle to the leader of the destination's host (one batch of sends and receives there), which hands
  everything to the destination. A gather's round 1 leaves every rank but the destination without the slots (the
  destination said go): each leader noted its host's rests in round 1 (:attr:`Levels.memo`), and the
  destination's leader every host's total.

Every rank knows the size of everything it receives before it moves (round 1); a message of another length fails
the channel (the ranks are out of step, or one lies), and every rank raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch

from objcomm._errors import CommunicationError
from objcomm._format import limits as _limits
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import DEFAULT_PIECE, SlotInfo, outgoing_second_round_bytes
from objcomm._samehost.channel_rests import chunks, incoming, pieces, streamed
from objcomm._samehost.sealed import ALIGN, SealedSegment, SealedTable, map_rows
from objcomm._samehost.two_level import TwoLevel
from objcomm._samehost.two_level_moves import (
    Here,
    Levels,
    as_leader,
    cut,
    publish,
    publish_shared,
    receive_into,
    receive_within,
    relay,
    send_within,
    take,
    take_shared,
)
from objcomm._transport import routes
from objcomm._transport.base import INTERNAL_TAG, NOT_USED, NotUsed, RestMedia, Route, Wire
from objcomm._transport.bytes import Batch, host_view
from objcomm._transport.exchange import all_gather_rests
from objcomm._transport.patterns import pattern


@dataclass(frozen=True)
class TwoLevelRests:
    """The second round of all_gather, broadcast and gather through two levels where round 1 went so
    (:class:`~objcomm._samehost.two_level.TwoLevel`); everything else by ``inner``."""

    inner: RestMedia
    shared_from: Optional[int] = None  # an all_gather's host publishes this many bytes and more in shared memory

    @staticmethod
    def _here(wire: Wire, op: str) -> Optional[Here]:
        first = wire.slot_medium
        return first.here(wire, op) if isinstance(first, TwoLevel) else None

    def _shared(self, total: int) -> bool:
        return self.shared_from is not None and routes.shared_memory_takes(total, threshold=self.shared_from, cpu=True)

    def worth(self, wire: Wire, moved: int, op: str, peer: Optional[int] = None) -> bool:
        if routes.leaders_relay_first(op=op, moved=moved) and self._here(wire, op) is not None:
            return True  # its receivers vote first (a refusing leader would hold all of it for its host)
        return self.inner.worth(wire, moved, op, peer)

    def relays(self, wire: Wire, dst: int, op: str) -> Sequence[Tuple[int, Sequence[int]]]:
        """A gather's rests on two levels go through each host's leader, then through the destination's host's
        leader, which holds every host's (:meth:`gather`)."""
        here = self._here(wire, op)
        if here is None:
            return self.inner.relays(wire, dst, op)
        hosts = here.levels.hosts
        held: List[Tuple[int, Sequence[int]]] = [(host[0], host) for host in hosts if len(host) > 1 and host[0] != dst]
        home = hosts[here.levels.host_of[dst]][0]
        if home != dst:
            held.append((home, range(wire.size)))
        return held

    def all_gather(
        self, wire: Wire, out: Outgoing, infos: Sequence[SlotInfo], sizes_of: SizesOf, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]:
        here = self._here(wire, op)
        if here is None:
            return self.inner.all_gather(wire, out, infos, sizes_of, op)
        levels, me = here.levels, wire.rank
        moved = [info.second_round_bytes for info in infos]
        totals = [sum(moved[r] for r in host) for host in levels.hosts]
        members = levels.hosts[here.host]
        mine = pieces(out, infos[me].inline is not None)
        bundle = _to_host_leader(here, mine, [moved[r] for r in members], op)
        if bundle is None:  # not the leader: every rest, from the leader
            if self._shared(sum(moved)):
                bundles = take_shared(here, totals, op)
            else:
                everything = take(here, sum(moved), 0, op)
                assert everything is not None
                bundles = cut(memoryview(everything), totals)
        else:
            shared = self._shared(sum(moved))  # (the same on every leader: the exchange's shape rests on it)
            bundles, sealed, width = _leaders_exchange(here, bundle, totals, shared, op)
            if here.channel is None:  # the host's only rank
                pass
            elif shared:
                publish_shared(here, bundles, op, sealed, width)
            else:
                publish(here, bundles, sum(moved), op)
        return _split(levels, bundles, moved, infos, sizes_of, me, out, op)

    def broadcast(
        self, wire: Wire, out: Optional[Outgoing], info: SlotInfo, sizes_of: SizesOf, src: int, op: str
    ) -> Union[Incoming, NotUsed]:
        here = self._here(wire, op)
        if here is None:
            return self.inner.broadcast(wire, out, info, sizes_of, src, op)
        moved = info.second_round_bytes
        data = None
        if wire.rank == src:
            assert out is not None
            data = memoryview(bytearray().join(pieces(out, info.inline is not None)))
        refuse = wire.rank != src and info.total > wire.max_bytes  # (only where no vote came first: then dropped)
        voted = routes.leaders_relay_first(op=op, moved=moved)  # (worth said so: nobody refuses after the vote)
        got = relay(here, wire, data, moved, src, op, keep=not refuse, agreed=voted)
        if wire.rank == src:
            assert out is not None
            return Incoming(out.frame, list(out.tensors))  # the caller decodes its own with own=True
        if refuse:
            raise _limits.refused(op, src, wire, info.total, None, drained=True, into="pieces of the two levels")
        assert got is not None
        return incoming(got, info, sizes_of, src, op)

    def gather(
        self, wire: Wire, out: Outgoing, infos: Optional[Sequence[SlotInfo]], sizes_of: SizesOf, dst: int, op: str
    ) -> Union[Optional[Sequence[Optional[Incoming]]], NotUsed]:
        here = self._here(wire, op)
        if here is None:
            return NOT_USED if infos is None else self.inner.gather(wire, out, infos, sizes_of, dst, op)
        levels, me = here.levels, wire.rank
        home, members = levels.host_of[dst], levels.hosts[here.host]
        if infos is not None:  # every rank read round 1 (it ended in a look at every slot), or this is dst
            moved = [0 if r == dst else info.second_round_bytes for r, info in enumerate(infos)]
            levels.memo["host"] = [moved[r] for r in members]
            levels.memo["totals"] = [sum(moved[r] for r in host) for host in levels.hosts]
        mine = [] if me == dst else pieces(out, out.frame_nbytes <= wire.inline_capacity)
        if here.place:  # to the leader
            if me != dst and outgoing_second_round_bytes(out, wire.inline_capacity):
                send_within(here, 0, mine)
            bundles: List[memoryview] = []
        else:
            _held_within_limit(wire, levels, here.host, home, dst, op)
            try:
                bundles = _to_destination(here, _from_host(here, mine, levels.memo["host"], op), home, op)
            except MemoryError as exc:  # within max_bytes, past what this host has
                raise CommunicationError(f"{op}: this leader could not allocate its host's rests: {exc!r}") from exc
        if here.host == home and levels.place[dst]:  # dst's leader hands everything to dst
            if here.place == 0:
                send_within(here, levels.place[dst], bundles)
            elif me == dst:
                everything = receive_within(here, 0, sum(levels.memo["totals"]), op)
                bundles = cut(memoryview(everything), levels.memo["totals"])
        if me != dst:
            return None
        assert infos is not None
        return _split(
            levels,
            bundles,
            [0 if r == dst else i.second_round_bytes for r, i in enumerate(infos)],
            infos,
            sizes_of,
            me,
            out,
            op,
        )

    def scatter(
        self,
        wire: Wire,
        outs: Optional[Sequence[Outgoing]],
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        longest: int,
        op: str,
    ) -> Union[Incoming, NotUsed]:
        return self.inner.scatter(wire, outs, info, sizes_of, src, longest, op)

    def all_to_all(
        self, wire: Wire, outs: Sequence[Outgoing], infos: Sequence[SlotInfo], sizes_of: SizesOf, longest: int, op: str
    ) -> Union[Sequence[Optional[Incoming]], NotUsed]:
        return self.inner.all_to_all(wire, outs, infos, sizes_of, longest, op)

    def send(
        self, wire: Wire, out: Outgoing, dst: int, op: str, route: Optional[Route] = None, message: int = 0
    ) -> bool:
        return self.inner.send(wire, out, dst, op, route, message)

    def recv(
        self,
        wire: Wire,
        info: SlotInfo,
        sizes_of: SizesOf,
        src: int,
        op: str,
        route: Optional[Route] = None,
        message: int = 0,
    ) -> Union[Incoming, NotUsed]:
        return self.inner.recv(wire, info, sizes_of, src, op, route, message)


def _to_host_leader(here: Here, mine: List[memoryview], moved: List[int], op: str) -> Optional[bytearray]:
    """The rests of an all_gather to the leader of each host (``moved``: each host rank's, in host order; ``mine``:
    this rank's own) in messages of the channel's gathers, as many as the host's largest needs: on the leader, the
    host's rests back to back; None on the others."""
    at = pattern("gather", me=here.place, world=len(moved), root=0)
    if here.place:
        assert here.channel is not None
        streamed(here.channel, at, chunks(mine), moved, max(moved), True, here.spin, op)
        return None
    bundle, view = _with_own(mine, moved)
    if here.channel is not None:
        starts = [sum(moved[:i]) for i in range(len(moved))]
        into = {i: view[starts[i] : starts[i] + moved[i]] for i in range(1, len(moved))}
        members = here.levels.hosts[here.host]
        streamed(here.channel, at, None, moved, max(moved), True, here.spin, op, into=into, names=members)
    return bundle


def _from_host(here: Here, mine: List[memoryview], moved: List[int], op: str) -> bytearray:
    """The leader of a gather: its host's rests (``moved``: each host rank's, in host order, 0 for the destination;
    ``mine``: its own), back to back; the others sent theirs as streams of the channel (:func:`send_within`)."""
    bundle, view = _with_own(mine, moved)
    at, start = moved[0], time.monotonic()  # one timeout for every rank's stream
    for i in range(1, len(moved)):
        if moved[i]:
            receive_into(here, i, view[at : at + moved[i]], op, start)  # in place: no second copy
            at += moved[i]
    return bundle


def _leaders_exchange(
    here: Here, bundle: bytearray, totals: List[int], shared: bool, op: str
) -> Tuple[List[memoryview], Optional[SealedSegment], int]:
    """The leader of an all_gather: every host's bundle (``totals``: each host's bytes), from one exchange among the
    leaders; the sealed file that holds them, or None; its layout (:func:`~objcomm._samehost.sealed.table_layout`).
    Where the hosts' ranks take the result from one shared file (``shared``: the same on every leader, whose
    exchange's rows it sets, a host of one rank's too, which makes no file) and the exchange is one padded
    all_gather or goes by stripes (``routes.in_place_table``), it writes into that file in place
    (:class:`~objcomm._samehost.sealed.SealedTable`: padded, a row per host of the largest bundle rounded up to
    :data:`~objcomm._samehost.sealed.ALIGN`; by stripes, the stream of every bundle back to back, a stripe per
    host), sealed then, and the bundles are views of it (no copy on the host); else the leader keeps the buffers the
    exchange gave."""
    assert here.leader is not None
    own = [torch.frombuffer(bundle, dtype=torch.uint8)] if len(bundle) else []
    # padded: the rows, the same on every leader whatever follows (its shared memory settings too: a host whose
    # leader padded other rows than another's made gloo abort); by stripes: minus a stripe's bytes
    width = 0
    if routes.in_place_table(totals, cpu=True):
        stripes = routes.exchange_shape(totals, cpu=True) == routes.STRIPES
        width = -routes.stripe_width(totals) if stripes else -(-max(totals) // ALIGN) * ALIGN
    table = None
    if shared and width and here.channel is not None:
        try:
            table = SealedTable("objcomm-two-levels", len(totals) * abs(width))
        except OSError:  # no memory files here: the exchange's own buffers, copied into a file after
            table = None
    try:
        into = None if table is None else table.tensor
        got = as_leader(here, op, all_gather_rests, here.leader, own, totals, op, into, max(width, 0))
    except BaseException:
        if table is not None:
            table.release()
        raise
    if table is None:
        bundles = [
            memoryview(bundle) if h == here.host else host_view(t) if t is not None else memoryview(b"")
            for h, t in enumerate(got)
        ]
        return bundles, None, 0
    del got, into  # the table and views of it: it is sealed once none is left
    return as_leader(here, op, _sealed_rows, table, totals, width)  # a failure there fails the host's channel too


def _sealed_rows(
    table: SealedTable, totals: List[int], width: int
) -> Tuple[List[memoryview], Optional[SealedSegment], int]:
    """The leaders' exchange's ``table``, sealed, with the leader's views of its rows; where it cannot be sealed (a
    view of it outlived the settling time), its rows copied, which go through a file of their own (width 0)."""
    try:
        segment = table.seal()
    except OSError:
        rows = table.copy_rows(totals, width)
        table.release()
        return rows, None, 0
    try:
        return map_rows(segment.fd, totals, width), segment, width
    except BaseException:
        segment.release()
        raise


def _held_within_limit(wire: Wire, levels: Levels, host: int, home: int, dst: int, op: str) -> None:
    """A leader, before it holds rests on their way to ``dst``: each of its host's senders within its own
    ``max_bytes``, and (``dst``'s host's leader) each host's total within its senders' count of it, as ``dst``
    checked before it said go (:func:`objcomm._format.limits.check_relays`). A word that said go past them is a lie
    (of ``dst`` or its leader: a helper's find, where honest leaders with 100 KB limits allocated 200 MB): this
    leader raises before it allocates; the ranks that wait for it fail at their timeout."""
    limit = wire.max_bytes
    # (each of its host's senders; on dst's host, each host's senders together, within their count of limits; the
    # names spelt only where one is past it: at 8192 ranks a string a host was ~0.3 ms a gather)
    held = [((r, r), n, 1) for r, n in zip(levels.hosts[host], levels.memo["host"]) if r != dst]
    if host == home:
        held += [((h[0], h[-1]), n, len(h)) for h, n in zip(levels.hosts, levels.memo["totals"])]
    for (first, last), moved, senders in held:
        if moved > senders * limit:
            who = f"rank {first}" if senders == 1 else f"ranks {first}-{last}"
            raise _limits.too_large(
                f"{op}: {who} send{'s' if senders == 1 else ''} {moved:,} bytes past the slot, above the "
                f"max_bytes={limit:,} of this rank{' for each' if senders > 1 else ''}, which relays them to rank "
                f"{dst}; the destination said go all the same: a rank lied",
                outcome="nothing was received",
                where="here",
            )


def _with_own(mine: List[memoryview], moved: List[int]) -> tuple[bytearray, memoryview]:
    """A bundle of ``sum(moved)`` bytes that starts with ``mine``, the leader's own rest, and a view of it."""
    bundle = bytearray(sum(moved))
    view = memoryview(bundle)
    at = 0
    for part in mine:
        view[at : at + part.nbytes] = part
        at += part.nbytes
    return bundle, view


def _to_destination(here: Here, bundle: bytearray, home: int, op: str) -> List[memoryview]:
    """The leaders of a gather: each host's bundle to the leader of the destination's host (``home``), which
    returns every host's (the others: nothing). One batch of sends and receives there, at exact sizes."""
    leader = here.leader
    assert leader is not None
    batch = Batch(leader._replace(tag=INTERNAL_TAG, chunk=DEFAULT_PIECE), "gather", together=True)  # (no slot says)
    if here.host != home:
        if len(bundle):
            batch.send(torch.frombuffer(bundle, dtype=torch.uint8), home)
        as_leader(here, op, batch.wait)
        return []
    totals = here.levels.memo["totals"]
    received = [batch.recv(n, h) if n and h != home else None for h, n in enumerate(totals)]
    as_leader(here, op, batch.wait)
    return [
        memoryview(bundle) if h == home else host_view(t) if t is not None else memoryview(b"")
        for h, t in enumerate(received)
    ]


def _split(
    levels: Levels,
    bundles: Sequence[memoryview],
    moved: Sequence[int],
    infos: Sequence[SlotInfo],
    sizes_of: SizesOf,
    me: int,
    out: Outgoing,
    op: str,
) -> List[Optional[Incoming]]:
    """Every rank's message from the hosts' ``bundles`` (each host's rests back to back, in host order, ``moved[r]``
    bytes of group rank ``r``; this rank's own comes from ``out``), in group-rank order."""
    found: List[Optional[Incoming]] = [None] * len(levels.host_of)
    for host, bundle in zip(levels.hosts, bundles):
        at = 0
        for r in host:
            n = moved[r]
            if r == me:  # its own, as copies: a result never aliases the input
                found[r] = Incoming(out.frame, [t.to("cpu", copy=True) for t in out.tensors])
            elif n:
                found[r] = incoming(bundle[at : at + n], infos[r], sizes_of, r, op)
            else:
                found[r] = Incoming(infos[r].inline)  # type: ignore[arg-type]  # it came inline
            at += n
    return found
