"""The cut-offs of :mod:`objcomm._transport.routes`: each decision that picks a route, a pure function of numbers (the
table of them is the package's docstring)."""

from __future__ import annotations

from typing import Sequence

from objcomm._format.limits import SCRATCH_BYTES
from objcomm._format.message import SLOT_PREFIX_BYTES
from objcomm._settings import DEFAULT_SHM_THRESHOLD

CHANNEL, SHARED_MEMORY, BACKEND = "channel", "shared memory", "backend"  # the media
PADDED, EXACT, STRIPES = "padded", "exact", "stripes"  # the shapes of a backend exchange (exchange_shape)
PADDED_WITHIN = 2  # a padded all_gather moves at most this many times the bytes of an exact one
HOP_BYTES = 64 << 10  # what a rank's link moves in one hop's latency (gloo across hosts: ~50 us at ~1.25 GB/s)
# The largest rest (a gather's: all senders' together) the same-host channel takes, whatever shm_threshold says:
# what a receiver's other threads read meanwhile waits in its stash (objcomm._samehost.inbox.STASH_BYTES, 64 MiB).
CHANNEL_MOST = 16 << 20


# -- the cut-offs --------------------------------------------------------------------------------------------------
def express_possible(*, compression: bool, channel_first: bool) -> bool:
    """Whether a call with default settings may take the express path at all: no compression, and the same-host
    channel is its slot medium (whether the channel is open, and the object small, is asked per call)."""
    return channel_first and not compression


def round_one(*, local: bool, one_host: bool, channel_open: bool) -> str:
    """The medium of round 1: the same-host channel where it is on and open on a group that lies on one host."""
    return CHANNEL if local and one_host and channel_open else BACKEND


def result_down_tree(*, cpu: bool, forced: bool = False, leaders: int = 0) -> bool:
    """Whether all_reduce's result goes from group rank 0 back down its reduce tree (send/recv, ceil(log2 W) hops,
    each edge its slot and rest: :func:`objcomm._transport.broadcast.down_tree`) rather than in a
    broadcast, where a broadcast's round 1 would take the backend: on NCCL, whose broadcast is a ring; on gloo's two
    levels (``leaders``: the hosts whose leaders the reduce tree climbed, 0 on one level) from
    :data:`TREE_DOWN_FROM` leaders, where the broadcast's relays move the slot, then the rest, each in a leaders'
    broadcast of ceil(log2 leaders) hops. Not on one level of gloo, whose broadcast is a binomial tree in C++
    (faster than Python's sends where measured: 4 ranks, 1 MB, 10-12 ms against 7-8). ``forced``: tests (Hooks)."""
    return not cpu or forced or leaders >= TREE_DOWN_FROM


SUMMED_SLOTS_FROM = TREE_GATHER_FROM = TREE_DOWN_FROM = 64  # ranks (leaders): slots_summed, slots_up_tree, down trees
# The radix of a gather's tree (its slots up, its word down: objcomm._transport.patterns.knomial): a rank takes a
# level's radix - 1 children's messages in one batch (their latencies overlap), so 8192 ranks take 7 levels where
# the binomial tree takes 13. Its messages are short (4-byte lengths, slots trimmed to what they carry, an 8-byte
# word) and the bytes into each rank are its subtree's whatever the radix. Not wider: each message also costs its
# receiver some CPU one after another (~35 us a message measured on 2 cores, gloo on loopback), and a wider tree
# gives the destination more of them ((radix - 1) x levels: 21 at radix 4, 29 at 8, 13 binomial). Which radix is
# fastest depends on that cost (`python benchmarks/scale_model.py --radix-table`: 8 below ~6 us a message, 4 to
# ~15 us, 3 above, at a 20 us hop), which nothing here measured on a server; 4 is never more than 1.4x the fastest
# from 0 to 40 us a message (3: 1.6x, 8: 1.72x, binomial 2.6x) and never slower than the binomial tree. Not the
# reductions' tree: its edges carry whole values, and a parent takes in radix - 1 of them a level.
SLOT_TREE_RADIX = 4


def rest_down_tree(*, world: int, moved: int, cpu: bool, forced: bool = False) -> bool:
    """Whether a broadcast's rest of ``moved`` bytes through the backend goes down the binomial tree rooted at the
    source (send/recv, piece by piece: :func:`objcomm._transport.bytes.broadcast_bytes`) rather than in the
    backend's broadcast: on NCCL, whose broadcast is a ring (W - 1 hops, the bytes once), from
    :data:`TREE_DOWN_FROM` ranks, where the tree's ceil(log2 W) = L hops, the source sending the bytes L times,
    cost no more than the ring: (L - 1) x ``moved`` at most (W - 1 - L) x :data:`HOP_BYTES` (at 8192 ranks up to
    44.7 MB, at 64 up to 0.75 MB). Not on gloo, whose broadcast is a binomial tree in C++ already. ``forced``:
    tests (Hooks). On NCCL each pair of ranks that exchange messages gets its own communicator on first use: over
    broadcasts from every source a rank meets up to 2 x L peers (rank +- 2**k), each set up once."""
    hops = (world - 1).bit_length()
    return forced or (not cpu and world >= TREE_DOWN_FROM and (hops - 1) * moved <= (world - 1 - hops) * HOP_BYTES)


def rest_spread(*, world: int, part: int, cpu: bool, agreed: bool, forced: bool = False) -> bool:
    """Whether one part of a broadcast's rest through the backend (its frame, or one tensor: ``part`` bytes) goes as
    a scatter, then an all_gather (:func:`objcomm._transport.patterns.spread`: send/recv, 2 ceil(log2 W) steps,
    each rank moving about twice the bytes) rather than down the binomial tree (:func:`rest_down_tree`: the source
    sends the bytes ceil(log2 W) times) or in the backend's broadcast. Only where the receivers answered first
    (``agreed``: their vote, or on NCCL their limits with the slot, :func:`limits_with_slot`): every rank relays
    blocks of it, so none may drain it. On NCCL, from :data:`TREE_DOWN_FROM` ranks,
    where it costs the least of the three in hops of :data:`HOP_BYTES`: 2L x hop + 2 x part, against the ring's
    (W - 1) x hop + part and the tree's L x (hop + part) (L = ceil(log2 W); at 8192 ranks from 77 KB to 535 MB,
    at 64 ranks from 98 KB to 3.3 MB). Not on gloo, whose broadcast, in C++, runs where its ranks may share a
    host. ``forced``: tests (Hooks), where a vote ran."""
    if not agreed or part <= 0:
        return False
    if forced:
        return True
    if cpu or world < TREE_DOWN_FROM:
        return False
    hops = (world - 1).bit_length()
    spread = 2 * hops * HOP_BYTES + 2 * part
    return spread < min((world - 1) * HOP_BYTES + part, hops * (HOP_BYTES + part))


def leaders_spread(*, leaders: int, moved: int, agreed: bool) -> bool:
    """On two levels (gloo), whether the leaders move a broadcast's rest (``moved`` bytes, one stream) as a scatter,
    then an all_gather (:func:`rest_spread`'s route, among one rank a host) rather than in gloo's broadcast, a binomial
    tree whose source sends the bytes ceil(log2 leaders) = L times: after the vote (``agreed``: a leader holds all of
    it, :func:`leaders_relay_first`), where 2L hops and each leader moving it about twice cost less, in hops of
    :data:`HOP_BYTES`, than L x (hop + moved): from 5 leaders, past L x hop / (L - 2) (at 1024 leaders 82 KB). The
    leaders lie on different hosts, so every hop crosses the network, where a flat gloo group's ranks may share one."""
    hops = (leaders - 1).bit_length()
    return agreed and hops > 2 and 2 * hops * HOP_BYTES + 2 * moved < hops * (HOP_BYTES + moved)


# scatter and all_to_all send one slot a receiver: at most this many bytes of slots a rank (all_to_all moves them
# in and out of every rank, scatter out of its root), each slot at least PART_SLOT_LEAST (an error report in it
# keeps about 400 bytes of its message)
PARTS_TABLE = 4 << 20
PART_SLOT_LEAST = 512


def part_slot(*, world: int, slot: int) -> int:
    """The slot of each part of a scatter or an all_to_all over ``world`` ranks, where the settings' slot is ``slot``
    bytes: that slot up to :data:`PARTS_TABLE` a rank (1024 ranks at the default 4 KiB), a smaller one past it, down
    to :data:`PART_SLOT_LEAST` (8192 ranks: 512 bytes, 4 MiB of slots a rank where they were 32 MiB). A part past its
    slot moves in the second round at its exact size, as any does. The same on every rank: the group's size and a
    setting every rank shares."""
    return max(min(slot, PART_SLOT_LEAST), min(slot, PARTS_TABLE // max(world, 1)))


# An all_gather whose slots go through the backend's all_gather takes a wider slot than the settings' where the two
# all_gathers before it on the group suggested one (:func:`slot_after`): its frames then ride in round 1, one
# collective where there were two. The table of such slots (world x slot) is at most this: the default slot's table
# at 8192 ranks, so that a wrong guess (smaller objects after larger ones) moves at most what that table does.
LEARNED_TABLE_MOST = 32 << 20
# A broadcast's slot through the backend, likewise (the two broadcasts before it), at most this: a receiver over its
# max_bytes then holds no more of a frame it refuses than the scratch buffer it would drain a rest through.
LEARNED_BROADCAST_MOST = SCRATCH_BYTES
# An all_gather whose frames all passed the settings' slot, where no wider slot holds them (past LEARNED_TABLE_MOST: a
# 4 KiB slot's frames from 8191 ranks; sizes not alike; past a sender's piece), takes this slot instead: its frames
# move in round 2 either way, and round 1 moves W x 1 KiB where it moved W x 4 KiB (an error report in it keeps about
# 900 bytes of its message; scatter's narrowest slot, PART_SLOT_LEAST, about 400); where that saves at least
# NARROW_SAVES_LEAST bytes of round 1 (from 342 ranks at 4 KiB): below, a call that grows into a second round after
# it would cost more than the slots save
NARROW_SLOT = 1024
NARROW_SAVES_LEAST = 1 << 20


def narrow_pays(*, world: int, base: int, narrow: int) -> bool:
    """Whether ``world`` slots of ``narrow`` bytes, where the settings' are ``base``, save :data:`NARROW_SAVES_LEAST`
    (0 < narrow < base)."""
    return 0 < narrow < base and world * (base - narrow) >= NARROW_SAVES_LEAST


def slot_after(
    frames: Sequence[int], *, tensors: bool, base: int, piece: int, most: int = LEARNED_TABLE_MOST, narrow: int = 0
) -> int:
    """The slot that one all_gather's round 1 suggests for the next on its group: each rank's frame was ``frames[r]``
    bytes (``tensors``: some rank sent out-of-band tensors; ``base``: the settings' slot; ``piece``: the smallest
    piece any sender announced; ``most``: what the slots of ``frames`` may hold together; a broadcast: its root's
    frame, and :data:`LEARNED_BROADCAST_MOST`). Where a frame was past ``base``, no rank sent tensors (they take a
    second round anyway), and a padded all_gather of the frames moves at most :data:`PADDED_WITHIN` times their
    bytes (sizes alike, as a loop's calls are): a slot that holds the widest frame and an eighth more (room for
    objects that grow a little), at most a quarter of :data:`HOP_BYTES` more (what each of the ring's hops then
    moves in vain is less than the round's latency it saves), rounded up to 64 bytes, if the slots together stay
    within ``most`` and the slot within ``piece``; else ``base``. The same on every rank (every rank read the same
    slots). ``narrow`` (an all_gather's: :data:`NARROW_SLOT`; 0: never narrower): where every frame was past
    ``base``, no rank sent tensors and no wider slot is taken, that slot where it pays (:func:`narrow_pays`): the
    frames take round 2 whatever the slot, and round 1's bytes then carry little more than the prefixes.
    :class:`objcomm._transport.rounds.SlotMemory` takes the smaller of the last two calls' suggestions where both are
    wider than ``base``, the wider where both are narrower, else ``base``, so that calls of two sizes in turn keep
    ``base``.

    >>> slot_after([50_000] * 16, tensors=False, base=4096, piece=1 << 28)
    56320
    >>> slot_after([1_000_000] * 16, tensors=False, base=4096, piece=1 << 28)  # 24 + 1,000,000 + 16 KiB, in 64s
    1016448
    >>> slot_after([50_000] * 15 + [1_000_000], tensors=False, base=4096, piece=1 << 28)  # one outlier: no
    4096
    >>> slot_after([8_000] * 8192, tensors=False, base=4096, piece=1 << 28, narrow=1024)  # wider: a 72 MB table
    1024
    >>> slot_after([8_000] * 16, tensors=False, base=4096, piece=4096, narrow=1024)  # past the piece, 16 ranks: no
    4096
    """
    world, widest = len(frames), max(frames, default=0)
    if tensors or SLOT_PREFIX_BYTES + widest <= base:
        return base
    if world * widest <= PADDED_WITHIN * sum(frames):
        slot = -(-(SLOT_PREFIX_BYTES + widest + min(widest // 8, HOP_BYTES // 4)) // 64) * 64
        if slot <= piece and world * slot <= most:
            return slot
    none_fit = SLOT_PREFIX_BYTES + min(frames) > base
    return narrow if none_fit and narrow_pays(world=world, base=base, narrow=narrow) else base


def slots_summed(*, world: int, cpu: bool, forced: bool = False) -> bool:
    """Whether an all_gather's slots through the backend go in one all_reduce (a sum) of the table, zeros but each
    rank's own slot, rather than an all_gather: on NCCL from :data:`SUMMED_SLOTS_FROM` ranks, where the all_reduce
    is a tree (2 ceil(log2 W) hops, the table twice: 2 x 32 MB at 8192 ranks) and the all_gather a ring (W - 1
    hops). Not on gloo, whose all_reduce is no tree. ``forced``: objcomm's tests (Hooks)."""
    return forced or (not cpu and world >= SUMMED_SLOTS_FROM)


def slots_up_tree(*, world: int, forced: bool = False) -> bool:
    """Whether a gather's round 1 through the backend goes up a tree (:data:`SLOT_TREE_RADIX`) to the destination
    (:func:`objcomm._transport.slot_tree.gather_up_tree`: lengths a level ahead of the trimmed slots) rather than in
    the backend's gather (W - 1 whole slots into it). From :data:`TREE_GATHER_FROM` ranks (or leaders). Under
    benchmarks/scale_model.py's model the tree of radix 4 costs less than the backend's gather for 1 KB objects from
    about 16 ranks on NCCL and 24 on gloo; measured on 8 and 16 gloo ranks sharing 2 cores it cost twice as much
    (benchmarks/RESULTS.md), so the cut-off stays where no run here could show the tree ahead. ``forced``: tests."""
    return forced or world >= TREE_GATHER_FROM


def word_down_tree(*, cpu: bool, forced: bool = False) -> bool:
    """Whether a gather's word from its destination, where its slots came up the tree (:func:`slots_up_tree`), goes
    back down that tree (send/recv, ceil(log4 W) hops: :func:`objcomm._transport.slot_tree.word_down_tree`) rather
    than in the backend's collective: on NCCL, whose all_reduce of a word takes the tree's hops twice (up and down;
    its broadcast is a ring). Not on gloo, whose broadcast is a binomial tree in C++: the same hops, no Python a hop
    (8 ranks on 2 cores, the slots up the forced tree: 9.4 ms a gather with gloo's broadcast, 10.1 with the word
    down the tree, median of three runs each). ``forced``: tests (Hooks)."""
    return forced or not cpu


def two_levels(*, hosts: int, widest: int, cpu: bool, local: bool) -> bool:
    """Whether all_gather and broadcast on a group that spans ``hosts`` hosts (``widest``: the most ranks on one)
    go through two levels (:mod:`objcomm._samehost.two_level`): each host's channel to its leader, one collective
    of the leaders, back through the channel. On CPU wires with ``local`` on, several hosts, and some host with
    two ranks or more; NCCL builds its own hierarchy."""
    return local and cpu and hosts > 1 and widest > 1


def tree_on_two_levels(hosts: Sequence[Sequence[int]]) -> bool:
    """Whether a reduction's tree, on a group that takes :func:`two_levels` (``hosts``: each host's group ranks,
    ascending, hosts in the order of their lowest), runs on them too: each host's ranks combine on its leader over the
    host's channel, then the leaders combine. Where every host holds consecutive group ranks (torchrun numbers ranks
    node by node): the tree combines in group-rank order, and a host's ranks, then the hosts, are that order only then.
    O(hosts)."""
    return all(host[-1] - host[0] + 1 == len(host) for host in hosts)


# Without the same-host channel (``local`` off) every rank on one host takes part in shared memory's announcement
# of a collective's rest (objcomm._samehost.voted_rests) only from this size, whatever its settings, and shared
# memory takes none below it whatever shm_threshold says: an announcement ranks with the default settings would
# not make costs ~0.3 ms at W=2 (a gloo all_gather), a third of a 16 KB all_gather's time; from the default
# shm_threshold on they make it anyway.
ANNOUNCED_FROM = DEFAULT_SHM_THRESHOLD


def all_announce(moved: int, *, cpu: bool) -> bool:
    """Whether a collective's rest whose largest sender moves ``moved`` bytes, without the channel, on one host, is
    announced by every rank in shared memory's words, each rank's settings taking it or declining: from
    :data:`ANNOUNCED_FROM`, on the CPU."""
    return cpu and moved >= ANNOUNCED_FROM


def channel_takes(moved: int, *, limit: int, cpu: bool) -> bool:
    """Whether the same-host channel, which carried round 1, takes a rest whose largest sender moves ``moved``
    bytes (``limit``: ``min(shm_threshold, CHANNEL_MOST)``)."""
    return cpu and moved < limit


def shared_memory_takes(moved: int, *, threshold: int, cpu: bool) -> bool:
    """Whether shared memory may take a rest whose largest sender moves ``moved`` bytes, before asking where the
    ranks run (one host) and whether segments open."""
    return cpu and moved >= threshold


def rest_medium(
    moved: int,
    *,
    cpu: bool,
    round_one_medium: str,
    shm: bool = True,
    shm_threshold: int = DEFAULT_SHM_THRESHOLD,
    one_host: bool = True,
    gathered: int = 0,
) -> str:
    """The medium of round 2 for a rest whose largest sender moves ``moved`` bytes (0: nothing moves). ``gathered``:
    a gather's rests together, which its destination takes while the senders go on (the channel: at most
    :data:`CHANNEL_MOST` of them, as its stash holds what waits)."""
    if moved <= 0:
        return BACKEND
    limit = min(shm_threshold, CHANNEL_MOST)
    if round_one_medium == CHANNEL and channel_takes(moved, limit=limit, cpu=cpu) and gathered <= CHANNEL_MOST:
        return CHANNEL
    if shm and one_host and shared_memory_takes(moved, threshold=shm_threshold, cpu=cpu):
        return SHARED_MEMORY
    return BACKEND


def rest_after_channel(moved: int, *, cpu: bool, shm: bool, shm_threshold: int, gathered: int = 0) -> str:
    """:func:`rest_medium` on one host after round 1 went through the same-host channel, by one rank's settings:
    the medium that rank moves the rest by (:class:`objcomm._samehost.rests.SameHostRests`) and the one it echoes
    to its peers before it does (:func:`objcomm._samehost.channel_checks.medium_of`). Where nothing moves (``moved``
    0) the channel ends the call without a message on every CPU rank, whatever its settings."""
    if moved <= 0:
        return CHANNEL if cpu else BACKEND
    return rest_medium(
        moved, cpu=cpu, round_one_medium=CHANNEL, shm=shm, shm_threshold=shm_threshold, gathered=gathered
    )


TREE_PIECED_UP_TO = 32 << 20  # a tree's message with a rest up to this goes in pieces of SCRATCH_BYTES: 32 at most


def tree_piece(chunk: int, rest: int) -> int:
    """The pieces a reduction tree's message (its way up, the result's way down, a scan's) sends its ``rest`` bytes
    in, where the settings' are ``chunk`` bytes: up to :data:`TREE_PIECED_UP_TO`, pieces of at most ``SCRATCH_BYTES``,
    so that where the slot lists the sizes no answer is due (:func:`agreement_needed`) and an edge costs its slot and
    one batch of pieces, not a round trip more (a receiver over its ``max_bytes`` drains them through its scratch and
    raises; its failure goes on along the tree, as any does). A larger rest keeps ``chunk``'s pieces and its answer:
    a round trip is little against the transfer, where thousands of pieces would each cost a call (on NCCL a kernel
    launch)."""
    return min(chunk, SCRATCH_BYTES) if rest <= TREE_PIECED_UP_TO else chunk


def agreement_needed(*, sizes_listed: bool, largest_piece: int, medium_may_take: bool) -> bool:
    """Whether receivers answer a sender before round 2 (a vote, or a send's answer). Not when round 1 listed
    every transfer that follows and none is past the scratch size: a receiver over its limit then drains them
    through one small buffer and raises alone. Decided from the slot alone, so sender and receivers agree."""
    return not sizes_listed or largest_piece > SCRATCH_BYTES or medium_may_take


def limits_with_slot(*, cpu: bool, slot_medium: str) -> bool:
    """Whether a broadcast's round 1 brings every receiver's ``max_bytes`` with the source's slot, so that every rank
    knows the smallest and none votes (:func:`agreement_needed`'s answer, known alike): on NCCL through the backend,
    whose broadcast is a ring and whose round 1 is therefore an all_reduce (MAX, a tree) of the slot, which carries
    one more word, each receiver's ``-max_bytes``, at no extra hop. Not on gloo (its round 1 is its broadcast, a
    binomial tree that moves nothing up) nor through the same-host channel (its vote is a round of the channel)."""
    return not cpu and slot_medium == BACKEND


# A send's rest up to this size goes in one message with its slot through a CPU group's backend (the receiver posts
# a buffer of the slot and this many bytes for every slot): one gloo rendezvous instead of two. So does a reduction
# tree's message on a GPU group, every one of which is then the slot and this many bytes (NCCL moves exact sizes).
BACKEND_WHOLE_BYTES = 60 << 10


def backend_whole(rest: int, *, cpu: bool, agreed: bool, tree: bool = False, tensors: bool = False) -> bool:
    """Whether a send through the backend (no same-host route) moves its slot and its ``rest`` bytes in one message:
    on a CPU group, where no answer comes first (``agreed``: :func:`agreement_needed`), for a rest of at most
    :data:`BACKEND_WHOLE_BYTES`. gloo's send waits until its receiver posts the receive, so a slot and then its rest
    cost two rendezvous; one message costs one (a 16 KB round trip on loopback: 2 messages a way ~500 us, 1 ~190 us),
    and is posted without waiting for its receiver, as a whole message in its slot is
    (:mod:`objcomm._transport.pending`). The message's envelope tells the receiver what the sender decided
    (:data:`objcomm._transport.p2p.ENVELOPE`), and a receiver over its ``max_bytes`` drops what came (it is in its
    buffer already) and raises alone.

    On a GPU group, a message of a reduction's tree or a scan (``tree``: :func:`objcomm._transport.p2p.tree_send`)
    whose rest is its frame alone (no out-of-band ``tensors``, which stay on the GPU): NCCL's send and receive move
    exact sizes, so each such message is :func:`backend_room`'s length, and an edge whose value is past the slot
    costs one message where the slot and then its rest cost two (the scale model's all_reduce log-normal on NCCL at
    8192 ranks: 2.06x -> 1.13x the ideal; a value in the slot pays the room's bytes: 1.01x -> 1.13x)."""
    return (cpu or tree and not tensors) and not agreed and 0 < rest <= BACKEND_WHOLE_BYTES


def backend_room(*, cpu: bool, tree: bool = False) -> int:
    """The bytes a message through the backend holds after its envelope and its slot, for a rest that comes with it
    (:func:`backend_whole`): on a CPU group the room of the receiver's buffer (gloo takes a shorter message), on a
    GPU group the padding of every message of a tree (``tree``); else 0 (a GPU group's other messages are the slot
    alone, with no envelope)."""
    return BACKEND_WHOLE_BYTES if cpu or tree else 0


# A result of at least this many bytes is received in place by two levels' leaders (in_place_table). A fresh memory
# file's pages cost about what the copy into one did (bench_in_place.py: 0.97x the copy's time from a 32 MiB table,
# 1.03x for 8 MiB, where the copy's buffer is malloc's, reused, below glibc's largest mmap threshold, 32 MiB).
IN_PLACE_FROM = 32 << 20


def in_place_table(totals: Sequence[int], *, cpu: bool) -> bool:
    """Whether the leaders of two levels, whose hosts take an all_gather's result from one shared file, receive their
    exchange into that file in place (no copy on the host, the result held once): where the exchange of the hosts'
    bundles (``totals`` bytes each, :func:`exchange_shape`) is one padded all_gather (rows of the largest bundle) or
    goes by stripes (the stream of bundles back to back, in rows of a stripe), of at least :data:`IN_PLACE_FROM`
    bytes in all."""
    widest = max(totals, default=0)
    shape = exchange_shape(totals, cpu=cpu) if widest else EXACT
    row = widest if shape == PADDED else stripe_width(totals) if shape == STRIPES else 0
    return row > 0 and len(totals) * row >= IN_PLACE_FROM


def leaders_relay_first(*, op: str, moved: int) -> bool:
    """On two levels, whether an ``op`` whose rest is ``moved`` bytes makes its receivers vote first because a leader
    holds all of it to relay it to its host: a broadcast past ``SCRATCH_BYTES`` (a refusing leader would hold it
    whole, past its own ``max_bytes``). The same answer on every rank (the slot's total)."""
    return op == "broadcast" and moved > SCRATCH_BYTES


def exchange_shape(lengths: Sequence[int], *, cpu: bool = False) -> str:
    """How the backend moves every rank's rest to every rank (``lengths``: each rank's rest, 0 for none):
    :data:`PADDED` (one all_gather of the widest) when that moves at most :data:`PADDED_WITHIN` times the bytes,
    else :data:`EXACT` (NCCL: an uneven all_gather; gloo: one batch where each rank sends its rest to every peer).
    On gloo (``cpu``), :data:`STRIPES` instead (:mod:`objcomm._transport.exchange`: each rest to the ranks whose
    stripe of the stream of rests holds it, then the stripes' all_gather) where they save the busiest rank more
    bytes (``max(n_max, c) + (W-1)c``, c = ceil(T/W), against ``(W-1) n_max`` padded, ``max((W-1) n_max, T -
    n_min)`` in a batch) than its link moves in the latency of that all_gather's W - 1 hops (:data:`HOP_BYTES`
    each): one rest that dwarfs the others, or many ranks whose rests differ. The same on every rank; O(W)."""
    world, total, widest = len(lengths), sum(lengths), max(lengths, default=0)
    shape = PADDED if world * widest <= PADDED_WITHIN * total else EXACT
    if not cpu or world < 3:
        return shape
    busiest = (world - 1) * widest if shape == PADDED else max((world - 1) * widest, total - min(lengths))
    width = stripe_width(lengths)
    return STRIPES if busiest - max(widest, width) - (world - 1) * width >= (world - 1) * HOP_BYTES else shape


def stripe_width(lengths: Sequence[int]) -> int:
    """The bytes of each rank's stripe of the stream of every rest (:mod:`objcomm._transport.exchange`): ceil(T/W)."""
    return -(-sum(lengths) // max(len(lengths), 1))


def pieces(length: int, chunk: int) -> int:
    """How many transfers of at most ``chunk`` bytes move ``length`` bytes (0 for none)."""
    return -(-length // chunk) if length > 0 else 0
