"""send/recv through shared memory, once :meth:`objcomm._samehost.shm.SharedMemory.send` and
:meth:`~objcomm._samehost.shm.SharedMemory.recv` found the second round worth it. The sender writes one segment
(:mod:`objcomm._samehost.shm_parts`) and sends six int64 words (:data:`_P2P`: its sequence number, or -1 when it
could not write, pid, token, host key, pid namespace, and where the segment is); the receiver, when it shares the
sender's host, fetches the segment and answers with one word (:data:`_SENT`, :data:`_OTHER_HOST`, :data:`_RESEND`,
:data:`_REFUSED_P2P`, :data:`_UNOPENABLE`), which the sender remembers (another host; a receiver that cannot open
sealed segments: files from then on). Words and answer go through ``route`` when the send's slot did (the same-host
channel), else through the group; the caller moves the rest the normal way when shared memory did not take it.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Union

import torch
import torch.distributed as dist

from objcomm import _state
from objcomm._format.message import Incoming, Outgoing, SizesOf
from objcomm._format.slot import SlotInfo
from objcomm._samehost import hosts as _hosts
from objcomm._samehost.sealed import Sealed, SealedSegment, Unopenable
from objcomm._samehost.segments import SegmentBook, SegmentFile, _me, _name, _Segment, _this_host, _Writer
from objcomm._samehost.shm_parts import Source, _part, _where, fetch
from objcomm._transport.base import NOT_USED, NotUsed, Route, Wire, guarded
from objcomm._transport.p2p import SHARED_WORDS, send_words

log = logging.getLogger("objcomm")

_P2P = SHARED_WORDS  # seq (or -1), pid, token, host key, pid namespace, where (see _where)
_SENT, _OTHER_HOST, _RESEND, _REFUSED_P2P, _UNOPENABLE = 0, 1, 2, 3, 4  # the receiver's answer


def send(
    book: SegmentBook,
    directory: str,
    separate: Union[bool, int],
    zero_copy: bool,
    wire: Wire,
    out: Outgoing,
    dst: int,
    op: str,
    route: Optional[Route],
    message: int,
) -> bool:
    """:meth:`objcomm._samehost.shm.SharedMemory.send` past its threshold, with that strategy's settings: write the
    segment, send the six words, read the answer. False: the caller sends the second round the normal way."""
    facts = _state.group_facts(wire.group)
    sealed = zero_copy and (dst, separate) not in facts.unsealed
    segment: Optional[Union[_Segment, SealedSegment]] = None
    seq, where = -1, 0
    try:
        if (dst, separate) in facts.remote_peers:
            log.debug("objcomm shm: %s to rank %d crosses hosts; normal transport", op, dst)
        else:
            try:
                seq = book.next_seq()
                part = _part(out, out.frame_nbytes <= wire.inline_capacity)
                if sealed:
                    segment = book.create_sealed(*part)
                else:
                    segment = book.create(_name(directory, _me(book.token), seq, 0), *part)
                where = _where(segment)
            except OSError as exc:
                log.debug("objcomm shm: %s could not write shared memory (%s); normal transport", op, exc)
                seq = -1
        words = [seq, os.getpid(), book.token, _hosts.host_key(separate), _hosts.pid_namespace(), where]
        send_words(wire, words, dst, op, route, message)
        if seq < 0:
            return False
        if route is not None:
            reply = route.answer_of(wire, dst, message, op)
        else:
            answer = torch.zeros(1, dtype=torch.int64)  # (zeroed: a short message leaves no old memory)
            guarded(op, wire, dist.recv, answer, src=wire.ranks[dst], group=wire.group, tag=wire.answer_tag)
            reply = int(answer.item())
        if reply == _OTHER_HOST:
            facts.remote_peers.add((dst, separate))
            log.debug("objcomm shm: %s to rank %d crosses hosts; normal transport", op, dst)
        elif reply == _UNOPENABLE:  # the receiver cannot open sealed segments: files from now on
            facts.unsealed.add((dst, separate))
        return reply in (_SENT, _REFUSED_P2P)  # a refusing receiver raises; it expects nothing more
    finally:
        if segment is not None:
            segment.release()


def recv(
    directory: str,
    separate: Union[bool, int],
    wire: Wire,
    info: SlotInfo,
    sizes_of: SizesOf,
    src: int,
    op: str,
    route: Optional[Route],
    message: int,
) -> Union[Incoming, NotUsed]:
    """:meth:`objcomm._samehost.shm.SharedMemory.recv` past its threshold, with that strategy's settings: read the six
    words, fetch the segment, answer. NOT_USED: the caller receives the second round the normal way."""
    if route is not None:
        seq, pid, token, key, namespace, where = route.recv_words(wire, _P2P, src, message, op)
    else:
        status = torch.zeros(_P2P, dtype=torch.int64)  # (zeroed: a short message leaves no old memory)
        guarded(op, wire, dist.recv, status, src=wire.ranks[src], group=wire.group, tag=wire.data_tag)
        seq, pid, token, key, namespace, where = status.tolist()
    if seq < 0:
        return NOT_USED
    answer, failure = _OTHER_HOST, None
    result: Union[Incoming, NotUsed] = NOT_USED
    if key == _hosts.host_key(separate):
        source: Source = SegmentFile(_name(directory, _Writer(_this_host(), namespace, token, pid), seq, 0), -where)
        if where > 0:  # opened through /proc/<pid>: in another pid namespace that pid names nothing (-1)
            source = Sealed(pid if namespace == _hosts.pid_namespace() != 0 else -1, where)
        try:
            result, answer = fetch(source, info.second_round_bytes, info.inline, info.length, sizes_of), _SENT
        except Unopenable as exc:
            log.debug("objcomm shm: %s could not open a sealed segment (%s); normal transport", op, exc)
            answer = _UNOPENABLE
        except OSError as exc:
            log.debug("objcomm shm: %s could not read shared memory (%s); normal transport", op, exc)
            answer = _RESEND
        except Exception as exc:  # a refused segment: raised once the sender knows not to send it again
            answer, failure = _REFUSED_P2P, exc
    else:
        log.debug("objcomm shm: %s from rank %d crosses hosts; normal transport", op, src)
    if route is not None:
        route.answer(wire, src, message, answer)
    else:
        reply = torch.tensor([answer], dtype=torch.int64)
        guarded(op, wire, dist.send, reply, dst=wire.ranks[src], group=wire.group, tag=wire.answer_tag)
    if failure is not None:
        raise failure
    return result
