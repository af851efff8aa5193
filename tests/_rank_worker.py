"""The worker side of the rank pool (tests/_ranks.py), and what crosses its pipes.

A request is ``HEADER`` (the call id) then the pickled ``(fn, args, kwargs)``; an empty
request (``CLOSE_REQUEST``) asks the worker to leave. Replies are pickled tuples:
``("ready", -1, pid)`` once the process group is up, ``("ok", call_id, result)`` and
``("err", call_id, traceback text, pickled exception or None)``.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import struct
import traceback
from contextlib import suppress
from typing import Any

from objcomm._tools import rank_side as _rank_side
from objcomm._transport import call_words as _call_words

__all__ = ["CLOSE_REQUEST", "HEADER", "describe", "dumps_call", "loads_exception", "loads_reply", "worker_main"]

HEADER = struct.Struct("<q")  # call id in front of every request
CLOSE_REQUEST = b""


def describe(fn) -> str:
    mod = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{mod}.{name}"


def dumps_call(fn, args, kwargs) -> bytes:
    """Pickle (fn, args, kwargs) by reference; fall back to cloudpickle for lambdas/closures."""
    obj = (fn, tuple(args), dict(kwargs))
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as plain_error:  # PicklingError, AttributeError ("local object"), TypeError
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"cannot pickle call to {describe(fn)} ({plain_error!r}) and cloudpickle is not installed"
            ) from plain_error
        try:
            return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as cp_error:
            raise TypeError(
                f"cannot send call to {describe(fn)} to the ranks: pickle failed with "
                f"{plain_error!r}, cloudpickle failed with {cp_error!r}"
            ) from cp_error


def loads_reply(rank: int, data: bytes) -> Any:
    """A worker's reply; an ``err`` reply saying why if it cannot be unpickled here."""
    try:
        return pickle.loads(data)
    except BaseException as exc:
        return (
            "err",
            None,
            f"rank {rank}: its reply could not be unpickled in the test process: {type(exc).__name__}: {exc}\n",
            None,
        )


def loads_exception(data: bytes | None) -> BaseException | None:
    try:
        return None if data is None else pickle.loads(data)
    except BaseException:
        return None


def _exception_payload(exc: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(data)  # some exceptions pickle but do not unpickle
        return data
    except Exception:
        return None


def worker_main(
    conn, rank: int, world_size: int, port: int, ppid: int, pdeathsig: bool, pg_timeout: float, store_timeout: float
) -> None:
    """One worker: join the group, say ``ready``, then run calls until asked to leave."""
    _rank_side.die_with_parent(ppid, pdeathsig)
    try:  # the parent sends SIGUSR1 to dump Python stacks of ranks that hang
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)
    except Exception:
        pass
    try:
        import torch
        import torch.distributed as dist

        try:
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        except ValueError:
            pass
        _rank_side.join_group(rank, world_size, port, timeout_s=pg_timeout, store_timeout_s=store_timeout)
        dist.barrier()
    except BaseException:
        _rank_side.flush_stdio()
        with suppress(Exception):
            _rank_side.send(conn, ("err", -1, traceback.format_exc(), None))
        return
    _rank_side.send(conn, ("ready", -1, os.getpid()))

    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent went away
        if data == CLOSE_REQUEST:
            break
        (call_id,) = HEADER.unpack_from(data)
        try:
            fn, args, kwargs = pickle.loads(data[HEADER.size :])
            _call_words.leave()  # each scenario starts in no collective of the object API, as a fresh process does
            result = fn(*args, **kwargs)
        except BaseException as exc:  # includes pytest's Failed/Skipped (BaseException subclasses)
            reply = ("err", call_id, traceback.format_exc(), _exception_payload(exc))
            del exc
        else:
            reply = ("ok", call_id, result)
            del result
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:
            data = pickle.dumps(
                (
                    "err",
                    call_id,
                    (
                        f"rank {rank}: the result of {describe(fn)} could not be pickled to send it back (result "
                        f"type {type(reply[2]).__module__}.{type(reply[2]).__qualname__}): {type(exc).__name__}: "
                        f"{exc}\nReturn something picklable from scenario functions.\n"
                    ),
                    None,
                )
            )
        _rank_side.flush_stdio()
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            break
        del reply, data

    with suppress(BaseException):
        dist.destroy_process_group()
    _rank_side.exit_now(0)


def barrier() -> None:
    """Scenario helper: a gloo barrier over the whole group."""
    import torch.distributed as dist

    dist.barrier()
