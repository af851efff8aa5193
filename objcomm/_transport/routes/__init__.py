"""Which way each part of a call goes: every cut-off that picks a route, as pure functions of numbers.

Nothing here moves a byte or reads a process group. The object API, the transport and the same-host media ask
these functions. What a call knows before its round 1 (the group's size, device and slot) is decided once per group:
:func:`call_route` returns a :class:`CallRoute` (in :mod:`.calls`) that the transport's rounds carry out, whose
methods answer what depends on round 1. :func:`plan` composes the cut-offs and that object into the whole route of
one call from made-up numbers, so that tests and ``benchmarks/scale_model.py`` can cost a call at any world size
without starting a rank. The cut-offs live in :mod:`.cutoffs`, the composition in :mod:`.plans`; every name is
re-exported here (a test that changes a constant changes it in :mod:`.cutoffs`, where the functions read it; a
group's :class:`CallRoute` read it when it was made, see :mod:`.calls`).

A call moves in up to two rounds. In round 1 every sender's fixed-size *slot* (``slot_bytes``: a 24-byte prefix,
then the frame when it fits, then the tensor sizes when they fit) reaches its receivers; the *rest* (a frame past
the slot, and every out-of-band tensor) moves in round 2, frame and tensors of one sender back to back.

======================  ===============================================================  ==========================
decision                cut-off                                                          function
======================  ===============================================================  ==========================
express path            default settings, no compression, the same-host channel is the   :func:`express_possible`
                        slot medium (then: whole frame in the slot, no tensors)
slot medium             the same-host channel when ``local`` is on, the group lies on    :func:`round_one`
                        one host and the channel is open; else the backend
ends after round 1      an error report anywhere, or every slot carries its whole        ``limits.round_one_ends``
                        message
receivers answer first  broadcast, send/recv: sizes not listed in the slot, a piece      :func:`agreement_needed`
                        past ``SCRATCH_BYTES``, or a same-host medium may take the rest
                        (on two levels a broadcast's rest past ``SCRATCH_BYTES``: a      :func:`leaders_relay_first`
                        leader relays all of it)
                        (scatter always votes; all_gather and gather read every
                        receiver's limit in round 1 and never do; nor does a broadcast   :func:`limits_with_slot`
                        on NCCL through the backend: its round 1, an all_reduce of the
                        slot, carries every receiver's limit)
everyone announces      without the channel (``local`` off), on a CPU group on one host,  :func:`all_announce`
                        a rest from :data:`ANNOUNCED_FROM` (2 MiB): every rank takes part in
                        shared memory's announcement, declining where its settings do
                        not take the rest (then everyone moves it the normal way; none
                        takes a smaller one); a gather's destination first sends every
                        slot to every rank
rest medium             the channel: round 1 went through it, CPU, the largest rest      :func:`rest_medium`
                        below ``min(shm_threshold, CHANNEL_MOST)`` (a gather's, all of
                        them at most ``CHANNEL_MOST``); shared memory: on,
                        CPU, one host, the largest rest at least ``shm_threshold``;
                        else the backend. After the channel, by one rank's settings      :func:`rest_after_channel`
                        (what it moves by, and what its echo compares), where nothing
                        moves: the channel
send's rest with slot   through a CPU group's backend, no answer first, a rest of at     :func:`backend_whole`
                        most ``BACKEND_WHOLE_BYTES``: slot and rest in one message; on a
                        GPU group a tree's message whose rest is its frame alone, every  :func:`backend_room`
                        message of a tree then that long (NCCL moves exact sizes)
backend exchange        all_gather's rests: one padded all_gather when                   :func:`exchange_shape`
                        ``world x widest <= PADDED_WITHIN x total``, else one exchange
                        at exact sizes (an uneven all_gather on NCCL, one batch of
                        send/recv on gloo); either in rounds of ``chunk_bytes``. On
                        gloo, stripes (each rest to the ranks whose stripe holds it,
                        then their all_gather) where they save the busiest rank more
                        than W - 1 hops of ``HOP_BYTES``
all_gather's slots      on NCCL from :data:`SUMMED_SLOTS_FROM` ranks: one all_reduce (a    :func:`slots_summed`
                        sum, a tree) of the table, zeros but each rank's own slot
an all_gather's slot    through the backend's all_gather: the smaller of the wider slots  :func:`slot_after`
width                   the two all_gathers before it on the group suggest (the same on
                        every rank: each read the same slots), wider than the settings'
                        where their frames, alike within ``PADDED_WITHIN``, passed it and
                        no rank sent tensors: the widest and an eighth (16 KiB at most), its table at most
                        :data:`LEARNED_TABLE_MOST`; the frames then ride in round 1.
                        Where every frame passed it and no wider slot is taken (past
                        that table: from 8191 ranks at 4 KiB), :data:`NARROW_SLOT`
                        where it saves 1 MiB (:func:`narrow_pays`; on NCCL's summed
                        slots too): round 1 moves a quarter. A
                        broadcast's (an all_reduce result's broadcast: its own), up to
                        :data:`LEARNED_BROADCAST_MOST`, never narrower
gather's slots          through the backend from :data:`TREE_GATHER_FROM` ranks: up a      :func:`slots_up_tree`
                        tree of send/recv (:data:`SLOT_TREE_RADIX`: ceil(log4 W) levels), each slot
                        trimmed to what it carries; below it the backend's gather
                        (every rank to the destination). The destination's word:
                        on NCCL back down the slots' tree, where they took it        :func:`word_down_tree`
                        (else an all_reduce); on gloo a broadcast
two levels              all_gather, gather, broadcast of a CPU group with ``local`` on   :func:`two_levels`
                        that spans hosts, some with two ranks or more: each host's
                        channel to its leader, the leaders on the backend, back
the reductions' tree    on two levels where every host holds consecutive group ranks:      :func:`tree_on_two_levels`
                        each host's ranks up a tree over its channel to the leader, then
                        the leaders' tree through the backend; else the group's tree
                        (on one host with the channel open, its messages through it).
                        A message's rest up to ``TREE_PIECED_UP_TO`` in pieces of at     :func:`tree_piece`
                        most ``SCRATCH_BYTES``: no answer where its slot lists the sizes
                        (nor on shared memory's account to a rank known to run on
                        another host)
a host's all_gather     on two levels, a shared file from ``shm_threshold``: the           :func:`in_place_table`
result, in place        leaders' padded all_gather (hosts' bundles within 2x) or their
                        stripes write it in place from ``IN_PLACE_FROM``; else the leader
                        copies into it
all_reduce's result     back down the reduce tree (send/recv: the message of each edge) :func:`result_down_tree`
                        on NCCL where a broadcast's round 1 would take the backend, and
                        on gloo's two levels from :data:`TREE_DOWN_FROM` leaders (the
                        leaders' tree, then each host's); else that broadcast
broadcast's rest        on NCCL from :data:`TREE_DOWN_FROM` ranks, while the source's    :func:`rest_down_tree`
through the backend     ceil(log2 W) - 1 extra sends of the rest move at most
                        W - 1 - ceil(log2 W) hops of ``HOP_BYTES`` (44.7 MB at 8192
                        ranks): each piece down the binomial tree from the source
                        (send/recv); else the backend's broadcast (NCCL's: a ring)
scatter's and           the settings' slot up to :data:`PARTS_TABLE` of slots a rank      :func:`part_slot`
all_to_all's slots      (1024 ranks), a smaller one past it (512 bytes at 8192 ranks)
a broadcast's rest      after the receivers' vote, on NCCL from :data:`TREE_DOWN_FROM`   :func:`rest_spread`
part by part            ranks, where 2L hops and each rank moving the part twice beat
                        both of those (from 77 KB to 535 MB at 8192 ranks): a scatter
                        of W blocks down the binomial tree, then Bruck's all_gather
                        (``patterns.spread``, send/recv); on two levels (gloo) among     :func:`leaders_spread`
                        the leaders from 5 of them, past L x hop / (L - 2) bytes
======================  ===============================================================  ==========================

Example::

    >>> from objcomm._transport import routes
    >>> p = routes.plan("all_gather", routes.Topology(world=8192), rests=[0] * 8190 + [1 << 20, 100 << 20])
    >>> [step.collective for step in p.steps], p.backend_calls
    (['all_gather', 'stripes', 'all_gather'], 3)
"""

from objcomm._transport.routes.calls import NOT_FORCED, CallRoute, Forced, call_route
from objcomm._transport.routes.cutoffs import (
    ANNOUNCED_FROM,
    BACKEND,
    BACKEND_WHOLE_BYTES,
    CHANNEL,
    CHANNEL_MOST,
    EXACT,
    HOP_BYTES,
    IN_PLACE_FROM,
    LEARNED_BROADCAST_MOST,
    LEARNED_TABLE_MOST,
    NARROW_SAVES_LEAST,
    NARROW_SLOT,
    PADDED,
    PADDED_WITHIN,
    PART_SLOT_LEAST,
    PARTS_TABLE,
    SHARED_MEMORY,
    SLOT_TREE_RADIX,
    STRIPES,
    SUMMED_SLOTS_FROM,
    TREE_DOWN_FROM,
    TREE_GATHER_FROM,
    TREE_PIECED_UP_TO,
    agreement_needed,
    all_announce,
    backend_room,
    backend_whole,
    channel_takes,
    exchange_shape,
    express_possible,
    in_place_table,
    leaders_relay_first,
    leaders_spread,
    limits_with_slot,
    narrow_pays,
    part_slot,
    pieces,
    rest_after_channel,
    rest_down_tree,
    rest_medium,
    rest_spread,
    result_down_tree,
    round_one,
    shared_memory_takes,
    slot_after,
    slots_summed,
    slots_up_tree,
    stripe_width,
    tree_on_two_levels,
    tree_piece,
    two_levels,
    word_down_tree,
)
from objcomm._transport.routes.plans import (
    Knobs,
    Plan,
    Step,
    StripeMoves,
    Topology,
    plan,
    stripe_moves,
    tree_calls,
    tree_messages,
    vote_calls,
)

__all__ = [
    "BACKEND",
    "BACKEND_WHOLE_BYTES",
    "CallRoute",
    "CHANNEL",
    "CHANNEL_MOST",
    "EXACT",
    "Forced",
    "HOP_BYTES",
    "IN_PLACE_FROM",
    "Knobs",
    "LEARNED_BROADCAST_MOST",
    "LEARNED_TABLE_MOST",
    "NARROW_SAVES_LEAST",
    "NARROW_SLOT",
    "NOT_FORCED",
    "PADDED",
    "PADDED_WITHIN",
    "PART_SLOT_LEAST",
    "PARTS_TABLE",
    "Plan",
    "SHARED_MEMORY",
    "STRIPES",
    "SLOT_TREE_RADIX",
    "SUMMED_SLOTS_FROM",
    "Step",
    "StripeMoves",
    "TREE_DOWN_FROM",
    "TREE_GATHER_FROM",
    "TREE_PIECED_UP_TO",
    "ANNOUNCED_FROM",
    "Topology",
    "agreement_needed",
    "backend_room",
    "backend_whole",
    "call_route",
    "channel_takes",
    "exchange_shape",
    "express_possible",
    "in_place_table",
    "leaders_relay_first",
    "leaders_spread",
    "limits_with_slot",
    "narrow_pays",
    "part_slot",
    "all_announce",
    "pieces",
    "plan",
    "rest_down_tree",
    "rest_after_channel",
    "rest_medium",
    "rest_spread",
    "result_down_tree",
    "round_one",
    "shared_memory_takes",
    "slot_after",
    "slots_summed",
    "slots_up_tree",
    "stripe_moves",
    "stripe_width",
    "tree_calls",
    "tree_messages",
    "tree_piece",
    "tree_on_two_levels",
    "two_levels",
    "vote_calls",
    "word_down_tree",
]
