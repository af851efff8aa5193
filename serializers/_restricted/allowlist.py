"""restricted-pickle's allow-list: what each global a payload may name builds, what a call of it costs, and the work
budget a load has for such calls (see the package's docstring, point 2).
"""

from __future__ import annotations

import collections
import datetime
from typing import Any, Callable, Dict, Optional, Tuple

from serializers import _budget, _rebuild
from serializers._restricted.stdlib import (
    _bytearray,
    _collection,
    _complex,
    _counter,
    _datetime,
    _decimal,
    _defaultdict,
    _deque,
    _fraction,
    _frozenset,
    _ints_or_none,
    _no_args,
    _object,
    _odict,
    _refused,
)

SEALED, MAPPING, SEQUENCE, USER = "sealed", "mapping", "sequence", "user"
# The work constructors may do, in units per payload byte. A unit is about one byte copied, eight
# bytes of memory built or 20 ns of CPU (a tuple element hashed: 8), so what constructors build stays
# within 256 bytes and a few µs per payload byte (the bounds docs/security.md states and
# tests/serializing/test_restricted_constructor_work.py enforces for every constructor below).
WORK_PER_BYTE = 32
_WORK_FLOOR = 1 << 20
_MEMORY_SHIFT = 3  # a call is charged the size of what it returns, at a unit per 8 bytes
CALL_UNITS = 64  # a call of a class or function allowed with ``allow`` (about 1 µs)


# -- the allow-list: what each named global builds (stdlib types: ``_stdlib_rebuild``) ----------


def _torch_size(sizes: Any = ()) -> Any:
    import torch

    # a tuple only: hashing a Size hashes every size again, each use as a key (the walk charges that for
    # a tuple's items, not for a list's)
    if type(sizes) is not tuple or any(type(s) is not int or not 0 <= s < 2**63 for s in sizes):
        raise _refused("torch.Size() of anything but a tuple of sizes")
    _budget.charge(8 * len(sizes), "torch.Size")
    return torch.Size(sizes)


def _torch_device(kind: Any, index: Any = None) -> Any:
    import torch

    if type(kind) is not str or len(kind) > 32 or (index is not None and (type(index) is not int or index < 0)):
        raise _refused("torch.device() of anything but a short name and an index")
    device = torch.device(kind) if index is None else torch.device(kind, index)
    if index is not None and device.index != index:
        raise _refused(f"torch.device index {_rebuild.brief(index)}")
    return device


# (module, name) -> (call, NEWOBJ, kind of the result, the real class for defaultdict factories,
# units: what each call is charged besides the size of its result and what the constructor charges
# itself; its CPU at the least, at about 20 ns a unit, measured by
# tests/serializing/test_restricted_constructor_work.py)
_Spec = Tuple[Optional[Callable[..., Any]], Optional[Callable[..., Any]], str, Optional[type], int]
_SPECS: Dict[Tuple[str, str], _Spec] = {
    ("builtins", "set"): (_collection(set), None, SEALED, set, 32),
    ("builtins", "frozenset"): (_frozenset, None, SEALED, frozenset, 32),
    ("builtins", "complex"): (_complex, None, SEALED, complex, 32),
    ("builtins", "bytearray"): (_bytearray, None, SEALED, bytearray, 32),
    ("builtins", "slice"): (_ints_or_none("slice", slice, 3), None, SEALED, None, 32),
    ("builtins", "range"): (_ints_or_none("range", range, 3), None, SEALED, None, 32),
    ("builtins", "object"): (_object, _object, SEALED, object, 32),
    **{
        ("builtins", t.__name__): (_no_args(t), None, SEALED, t, 32)
        for t in (list, dict, tuple, int, float, str, bytes, bool)
    },
    ("collections", "OrderedDict"): (_odict, None, MAPPING, collections.OrderedDict, 64),
    ("collections", "Counter"): (_counter, None, MAPPING, collections.Counter, 192),
    ("collections", "defaultdict"): (_defaultdict, None, MAPPING, None, 64),
    ("collections", "deque"): (_deque, None, SEQUENCE, collections.deque, 32),
    **{
        ("datetime", t.__name__): (_datetime(t), None, SEALED, None, 256)
        for t in (datetime.datetime, datetime.date, datetime.time, datetime.timedelta, datetime.timezone)
    },
    ("decimal", "Decimal"): (_decimal, None, SEALED, None, 64),
    ("fractions", "Fraction"): (_fraction, None, SEALED, None, 192),
    ("torch", "Size"): (_torch_size, None, SEALED, None, 64),
    ("torch", "device"): (_torch_device, None, SEALED, None, 64),
    **{
        ("serializers._rebuild", f.__name__): (f, None, SEALED, None, units)
        for f, units in (
            (_rebuild.ndarray, 256),
            (_rebuild.numpy_scalar, 256),
            (_rebuild.numpy_dtype, 64),
            (_rebuild.tensor, 512),
            (_rebuild.parameter, 384),
            (_rebuild.uuid, 128),
        )
    },
}
_NUMPY_OWN = {"_reconstruct", "scalar", "_frombuffer", "ndarray", "dtype"}


def _why_refused(module: str, name: str) -> str:
    where = f"global {module}.{name}"
    if module.split(".")[0] == "numpy" and name in _NUMPY_OWN or module.startswith("torch") and "rebuild" in name:
        return (
            f"{where}: numpy's and torch's own reconstructors can forge memory; restricted-pickle decodes arrays "
            "and tensors only in the form its own encoder writes (serializers._rebuild)"
        )
    return (
        f"to load {where}: it is not on the allow-list. If you trust it, allow it with "
        f"serializers.get('restricted-pickle').allow('{module}.{name}')"
    )
