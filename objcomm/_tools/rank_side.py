"""The rank side of local ranks (:mod:`objcomm._tools.launch` starts them): what a rank process does for
itself. :func:`die_with_parent` (PR_SET_PDEATHSIG and a watcher thread) ends a rank whose parent died even
by SIGKILL, :func:`join_group` joins the process group over the parent's master store on :data:`HOST`,
:func:`send` pickles one message up the rank's pipe, and :func:`exit_now` leaves without torch's slow
interpreter teardown, after :func:`flush_stdio` (which the parent also calls before it swaps fds 1 and 2).
Used by :func:`objcomm._tools.launch.run_local`'s ranks and by the test harness's workers
(``tests/_rank_worker.py``); it imports torch only inside :func:`join_group`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Optional

HOST = "127.0.0.1"


def die_with_parent(parent_pid: int, pdeathsig: bool = True) -> None:
    """Exit when the parent dies, even by SIGKILL: the kernel's death signal, and a watcher thread.

    ``pdeathsig`` only if the parent started us from its main thread: the kernel's signal fires
    when the starting *thread* ends.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it reaps us
    if pdeathsig and sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        except Exception:
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(70)

    if os.getppid() != parent_pid:
        os._exit(70)
    threading.Thread(target=watch, name="objcomm-watch-parent", daemon=True).start()


def join_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    store_timeout_s: Optional[float] = None,
) -> None:
    """Join the process group whose master store listens on ``port``."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    # torch.distributed imports TCPStore from torch._C without re-exporting it, so its stubs hide it
    store = dist.TCPStore(  # type: ignore[attr-defined]
        HOST, port, world_size, is_master=False, timeout=timedelta(seconds=store_timeout_s or timeout_s)
    )
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def flush_stdio() -> None:
    """Flush Python's standard streams (before a fork of fds or an ``os._exit``)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass


def exit_now(code: int = 0) -> None:
    """Run the atexit hooks (coverage etc.) and leave, skipping torch's ~0.5 s teardown per rank."""
    try:
        atexit._run_exitfuncs()
    except BaseException:
        pass
    flush_stdio()
    os._exit(code)


def send(conn: Any, message: Any) -> None:
    """Send one pickled message to the parent."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
