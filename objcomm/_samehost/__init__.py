"""Optional media for ranks that share a host: the socket channel and shared memory.

:mod:`.hosts` finds which ranks share a host; :mod:`.channel` is the socket channel between them (what moves over
it: :mod:`.mesh`; its messages read by :mod:`.inbox`, waited for in :mod:`.inbox_waits`); :mod:`.channel_slots`
carries round 1 over it (what ranks check of it: :mod:`.channel_checks`; whether send/recv take it:
:mod:`.p2p_state`; opening it in the background: :mod:`.opener`), :mod:`.channel_rests` the rest of a message;
:mod:`.shm` (its parts: :mod:`.shm_parts`; send/recv: :mod:`.shm_p2p`), :mod:`.segments` and :mod:`.sealed` publish
large payloads once per host in shared memory; :mod:`.rests` picks which of the two takes a collective's rest. Each
implements the medium protocols of :mod:`objcomm._transport.base`; turn them off with ``OBJCOMM_LOCAL=0`` /
``OBJCOMM_SHM=0`` and every call takes the backend. See docs/same-host.md.
"""
