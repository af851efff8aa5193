"""mpi4py's vocabulary in objcomm's calls: what a program ported from mpi4py writes (``dest=``, ``root=``, ``bcast``,
``"SUM"``, ``MPI.LAND``) and what to write instead (``docs/from-mpi4py.md``): keyword hints on every public function
and ``Communicator`` method (:func:`mpi4py_keywords`), names looked up on the module or a communicator
(:func:`no_attribute`), and op names in any case (:func:`named_op`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, TypeVar, cast

from objcomm._api import reduce as _reduce

FROM_MPI4PY = " (objcomm follows torch.distributed's names: see docs/from-mpi4py.md)"

# mpi4py's keyword -> the parameters that mean the same here; a function takes at most one of them
MPI4PY_KEYWORDS: Dict[str, Tuple[str, ...]] = {
    "dest": ("dst",),
    "source": ("src",),
    "root": ("src", "dst"),  # the root sends (bcast, scatter) or receives (gather, reduce)
    "sendobj": ("obj", "objs"),
    "status": ("return_sender",),
}

# mpi4py's names (of its Comm methods and MPI module) -> what to write instead; {on}: "objcomm" or "Communicator"
MPI4PY_NAMES: Dict[str, str] = {
    "bcast": "did you mean {on}.broadcast?",
    "allgather": "did you mean {on}.all_gather?",
    "allreduce": "did you mean {on}.all_reduce?",
    "alltoall": "did you mean {on}.all_to_all?",
    "probe": "there is no probe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "iprobe": "there is no iprobe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "barrier": "use torch.distributed.barrier(group)",
    "Barrier": "use torch.distributed.barrier(group)",
    "Get_rank": "use torch.distributed.get_rank(group)",
    "Get_size": "use torch.distributed.get_world_size(group)",
    "rank": "use torch.distributed.get_rank(group)",
    "size": "use torch.distributed.get_world_size(group)",
    "COMM_WORLD": "every call takes group=None, the default group (objcomm.Communicator() holds settings for one)",
    "ANY_SOURCE": "pass src=None to receive from any rank",
    "ANY_TAG": "there is no receive from any tag: each recv names its tag",
    "Status": "recv(..., return_sender=True) returns (sender's global rank, obj)",
    "SUM": 'pass op="sum"',
    "PROD": 'pass op="prod"',
    "MIN": 'pass op="min"',
    "MAX": 'pass op="max"',
    "LAND": "pass op=lambda a, b: a and b",
    "LOR": "pass op=lambda a, b: a or b",
    "MAXLOC": "all_reduce((value, rank), lambda a, b: b if b[0] > a[0] else a)",
    "MINLOC": "all_reduce((value, rank), lambda a, b: b if b[0] < a[0] else a)",
    "PROC_NULL": "there is no PROC_NULL: skip the call where there is no peer",
    "ssend": "there is no synchronous send: {on}.send returns once a small message is posted, a large one once taken",
    "issend": "there is no synchronous send: {on}.isend's wait() returns once a small message is posted",
    "Split": "use torch.distributed.new_group(ranks), then group=group in each call",
    "Create_group": "use torch.distributed.new_group(ranks), then group=group in each call",
    "waitall": "[request.wait() for request in requests]",
    "waitany": "concurrent.futures.wait([r.get_future() for r in requests], return_when=FIRST_COMPLETED)",
    "testall": "all(request.is_completed() for request in requests)",
    "bsend": "there is no buffered send: {on}.send returns once a small message is posted, a large one once taken",
    "ibsend": "there is no buffered send: {on}.isend's wait() returns once a small message is posted",
    "mprobe": "there is no probe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "improbe": "there is no probe: {on}.irecv(src, tag) gives a Request; its is_completed() says whether it arrived",
    "ibarrier": "use torch.distributed.barrier(group, async_op=True)",
    "Ibarrier": "use torch.distributed.barrier(group, async_op=True)",
    "Abort": "raise, or exit: torchrun ends the other ranks (torch.distributed.destroy_process_group() first, if kept)",
    "Wtime": "use time.perf_counter()",
    "Dup": "use torch.distributed.new_group(ranks) on every rank: a group of its own",
    "Free": "use torch.distributed.destroy_process_group(group)",
    # mpi4py's buffer (upper-case) calls: objcomm moves objects, tensors inside them included
    **{
        name: f"objcomm moves objects: {{on}}.{ours}(...) (tensors inside them travel as tensors)"
        for name, ours in (
            ("Bcast", "broadcast"),
            ("Scatter", "scatter"),
            ("Gather", "gather"),
            ("Allgather", "all_gather"),
            ("Alltoall", "all_to_all"),
            ("Reduce", "reduce"),
            ("Allreduce", "all_reduce"),
            ("Scan", "scan"),
            ("Exscan", "exscan"),
            ("Send", "send"),
            ("Recv", "recv"),
            ("Isend", "isend"),
            ("Irecv", "irecv"),
            ("Sendrecv", "sendrecv"),
        )
    },
}

# mpi4py's Request methods -> what to write instead
MPI4PY_REQUEST_NAMES: Dict[str, str] = {
    "test": "if request.is_completed(): obj = request.wait()",
    "Test": "if request.is_completed(): obj = request.wait()",
    "Wait": "use request.wait()",
    "cancel": "there is no cancel: an operation, once issued, completes or fails (wait() says which)",
    "Cancel": "there is no cancel: an operation, once issued, completes or fails (wait() says which)",
    "Free": "nothing to free: a finished Request holds nothing",
    "free": "nothing to free: a finished Request holds nothing",
}

# mpi4py's class methods of Request, looked up on objcomm.Request itself
MPI4PY_REQUEST_CLASS_NAMES: Dict[str, str] = {
    "waitall": "[request.wait() for request in requests]",
    "testall": "all(request.is_completed() for request in requests)",
    "waitany": "concurrent.futures.wait([r.get_future() for r in requests], return_when=FIRST_COMPLETED), then take the"
    " completed request out of the list (docs/from-mpi4py.md: its wait() would return the same object again)",
    "testany": "next((i for i, r in enumerate(requests) if r.is_completed()), None)",
    "waitsome": "concurrent.futures.wait([r.get_future() for r in requests], return_when=FIRST_COMPLETED)",
}
MPI4PY_REQUEST_CLASS_NAMES.update({name.capitalize(): hint for name, hint in list(MPI4PY_REQUEST_CLASS_NAMES.items())})

F = TypeVar("F", bound=Callable[..., Any])


def keyword_hint(name: str, params: Sequence[str], function: str) -> Optional[str]:
    """What to say about keyword ``name``, which ``function`` (with parameters ``params``) does not take; None:
    nothing better than Python's own message."""
    for meant in MPI4PY_KEYWORDS.get(name, ()):
        if meant == "return_sender" and meant in params:
            return "did you mean return_sender=True? It returns (sender's global rank, obj)" + FROM_MPI4PY
        if meant in params:
            return f"did you mean {meant}=?" + FROM_MPI4PY
    if name == "root":
        return f"{function}() has no root: every rank takes part and gets the result" + FROM_MPI4PY
    if name == "status":  # Request.wait(status=...), after an irecv from any rank
        return "there is no Status: irecv(..., return_sender=True) makes wait() return (sender's global rank, obj)" + (
            FROM_MPI4PY
        )
    if name in ("buf", "recvbuf"):
        return "objcomm allocates what it receives: leave buf out" + FROM_MPI4PY
    if name == "tag" and "sendtag" in params:  # sendrecv: a tag each way
        return "sendrecv takes sendtag= and recvtag= (recvtag defaults to sendtag)"
    if name in ("group_dst", "group_src") and name[6:] in params:  # torch's group ranks (objcomm.compat takes them)
        return f"objcomm takes global ranks: {name[6:]}=dist.get_global_rank(group, r)" + FROM_MPI4PY
    names = {p.lower(): p for p in params if p != "self"}
    close = difflib.get_close_matches(name, [p for p in params if p != "self"], n=1, cutoff=0.8)
    if close:
        return f"did you mean {close[0]}=?"
    # one letter swapped, dropped, added or changed, in any case (tga, Tag, dts, asyncop), or mpi4py's word so typed
    # (sorce): a looser ratio also matched words that mean something else (sync: async_op, target: tag)
    for typed, meant in [(key, key) for key in names] + [(key, ps[0]) for key, ps in MPI4PY_KEYWORDS.items()]:
        if _one_edit(name.lower(), typed) and meant.lower() in names:
            return f"did you mean {names[meant.lower()]}=?" + (FROM_MPI4PY if typed != meant else "")
    return None


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` becomes ``b`` by one edit (a letter swapped with the next, dropped, added or changed), both at
    least three letters long."""
    if a == b or min(len(a), len(b)) < 3 or abs(len(a) - len(b)) > 1:
        return a == b and len(a) >= 3
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (
            len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]
        )
    short, long = (a, b) if len(a) < len(b) else (b, a)
    return any(long[:i] + long[i + 1 :] == short for i in range(len(long)))


TOO_MANY_POSITIONAL = (
    "objcomm returns each result rather than filling a list as torch.distributed's *_object functions do "
    "(got = objcomm.all_gather(obj)), and takes everything after the object by keyword (src=, dst=, group=); "
    "objcomm.compat has torch's signatures"
)


RECV_BUFFER = "mpi4py's recv(buf, source, tag) takes a buffer, objcomm's none: recv(src, tag); "
SENDRECV_POSITIONAL = (  # mpi4py's sendrecv(sendobj, dest, sendtag=0, recvbuf=None, source=ANY_SOURCE, ...)
    "mpi4py's sendrecv(sendobj, dest, sendtag, recvbuf, source, recvtag) is objcomm's "
    "sendrecv(obj, dst, src=source, sendtag=sendtag, recvtag=recvtag) (recvtag defaults to sendtag, not to any tag)"
)
NO_OP = (
    'pass op: a name ("sum", "prod", "min", "max", "merge", "merge_sum") or a function op(a, b) -> c; mpi4py\'s '
    'reduce, allreduce, scan and exscan default to MPI.SUM, which is op="sum"'
)


def mpi4py_keywords(fn: F) -> F:
    """``fn``, whose unexpected keyword arguments (mpi4py's ``dest=``, ``source=``, ``root=``, a misspelt one) raise a
    TypeError that says what to write instead. A call that binds pays nothing but this frame: the names are looked at
    only once Python refused them."""
    signature = inspect.signature(fn).parameters
    params = tuple(signature)
    positional = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in signature.values())
    if any(p.kind == p.VAR_POSITIONAL for p in signature.values()):
        positional = 1 << 30  # (takes any number)
    function = fn.__qualname__
    method = bool(params) and params[0] == "self" and "<locals>" not in function

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except TypeError as exc:
            # a method as its caller's class names it (Communicator's point-to-point calls live in a base class)
            called = f"{type(args[0]).__name__}.{fn.__name__}" if method and args else function
            said = str(exc)
            if said.startswith(f"{function}("):  # Python's own words on the call's arguments: renamed alike
                said = called + said[len(function) :]
            unknown = [key for key in kwargs if key not in params]  # none: the TypeError came from inside fn
            if not unknown and len(args) > positional:  # torch's habit: all_gather_object(output_list, obj)
                if fn.__name__ == "sendrecv":  # (mpi4py's, rather)
                    raise TypeError(f"{said}; {SENDRECV_POSITIONAL}") from None
                if fn.__name__ == "wait":  # Request.wait(timeout): no list to fill
                    raise TypeError(said) from None
                buffer = RECV_BUFFER if fn.__name__ in ("recv", "irecv") else ""
                raise TypeError(f"{said}; {buffer}{TOO_MANY_POSITIONAL}") from None
            if not unknown and "op" in params and "'op'" in said and "missing" in said:
                raise TypeError(f"{said}; {NO_OP}") from None
            hint = keyword_hint(unknown[0], params, called) if unknown else None
            if hint is None and said != str(exc):
                raise TypeError(said) from None
            if hint is None:
                raise
            raise TypeError(f"{called}() got an unexpected keyword argument {unknown[0]!r}; {hint}") from None

    return cast(F, checked)


def no_attribute(owner: str, on: str, name: str, names: Dict[str, str] = MPI4PY_NAMES) -> AttributeError:
    """The AttributeError for ``name``, which ``owner`` (``"module 'objcomm'"``) lacks: for mpi4py's names, it says
    what to write instead (``on``: what the calls are made on, ``"objcomm"`` or ``"Communicator"``; ``names``:
    :data:`MPI4PY_NAMES`, or :data:`MPI4PY_REQUEST_NAMES` for a ``Request``)."""
    hint = names.get(name)
    message = f"{owner} has no attribute {name!r}"
    if hint is not None:
        message += "; " + hint.format(on=on) + FROM_MPI4PY
    return AttributeError(message)


def named_op(op: Any) -> Any:
    """``op``, with a named op spelt in another case (``"SUM"``, ``"Max"``: mpi4py's ``MPI.SUM`` written as a string) as
    objcomm names it, so that every rank reduces with the same function whatever case each wrote."""
    if type(op) is str and op not in _reduce.NAMED_OPS:
        lower = op.lower()
        if lower in _reduce.NAMED_OPS:
            return lower
    return op
