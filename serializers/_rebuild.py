"""Validated constructors that restricted-pickle payloads name instead of numpy's and torch's own.

numpy's ``_reconstruct`` + ``ndarray.__setstate__`` and torch's ``_rebuild_tensor_v2`` accept
state that can forge memory layout (object dtypes, overlapping fields, strides and offsets
outside the data) or allocate far beyond the payload. restricted-pickle's encoder writes arrays,
scalars, dtypes, tensors, Parameters and UUIDs as calls to the functions below, which rebuild
the value from a dtype string, a shape and the bytes actually present — and refuse anything
else. Their ``module.name`` is part of the wire format (``docs/security.md``).

Every function raises :class:`DecodeError` for input it will not build. While restricted-pickle
loads, the work its constructors do is charged to a per-load budget (:mod:`serializers._budget`, in units of
about one byte copied, eight bytes of memory built or 20 ns of CPU): a payload can name one big
value many times (pickle's memo), so each call must pay for what it builds, not only be bounded by
its argument. restricted-pickle's guards charge every call a fixed cost and the size of what it
returns; the functions here charge what that misses (the fields of a structured dtype, copies,
scans of the data). Error messages describe payload values with :func:`brief`, never ``repr`` (a
memo-shared list has an exponentially long ``repr``).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence, Tuple

from serializers._budget import charge, unshared
from serializers._errors import DecodeError

MAX_DIMS = 32
MAX_DTYPE_TEXT = 64
MAX_FIELDS = 256
FIELD_UNITS = 128  # work units a structured dtype's field costs (~1 µs and ~120 bytes measured)
DIM_UNITS = 32  # work units a tensor's dimension costs (torch's views and reshape: ~1 µs a dimension)
MAX_INT_DIGITS = 4300  # CPython's own int/str conversion limit (3.11+), applied on every version
_SIMPLE_KINDS = frozenset("biufcmMSUV")
_TORCH_DTYPES = frozenset(
    "uint8 int8 int16 short int32 int int64 long float16 half float32 float float64 double complex64 cfloat "
    "complex128 cdouble bool bfloat16 uint16 uint32 uint64 float8_e5m2 float8_e4m3fn float8_e5m2fnuz "
    "float8_e4m3fnuz".split()
)


def _refuse(what: str) -> DecodeError:
    return DecodeError(f"payload refused: {what}")


def brief(value: Any) -> str:
    """A short description of a payload value that costs O(1) to build, whatever the value."""
    cls = type(value)
    if cls is int:
        return repr(value) if value.bit_length() <= 64 else f"an int of {value.bit_length():,} bits"
    if cls in (str, bytes, bytearray):
        return repr(value[:40]) + ("..." if len(value) > 40 else "")
    if cls in (float, bool, type(None)):
        return repr(value)
    if cls in (list, tuple, dict, set, frozenset):
        return f"a {cls.__name__} of {len(value):,} items"
    return f"a {cls.__name__}"


def _byte_string(data: Any, what: str) -> Any:
    if type(data) not in (bytes, bytearray):
        raise _refuse(f"{what}: expected bytes, got {type(data).__name__}")
    return data


def _shape(shape: Any, max_dims: int = MAX_DIMS) -> Tuple[int, ...]:
    if type(shape) not in (tuple, list) or len(shape) > max_dims:
        raise _refuse(f"shape {brief(shape)}: expected a tuple of at most {max_dims} sizes")
    for size in shape:
        if type(size) is not int or not 0 <= size < 2**62:
            raise _refuse(f"shape {brief(shape)}: sizes must be ints in [0, 2**62)")
    return tuple(shape)


def _count(shape: Tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _simple_numpy_dtype(descr: Any) -> Any:
    import numpy as np

    if type(descr) is not str or len(descr) > MAX_DTYPE_TEXT:
        raise _refuse(f"numpy dtype {brief(descr)}: expected a short dtype string")
    try:
        dtype = np.dtype(descr)
    except Exception as exc:
        raise _refuse(f"numpy dtype {brief(descr)}: {exc}") from None
    if dtype.fields is not None or dtype.subdtype is not None or dtype.hasobject or dtype.kind not in _SIMPLE_KINDS:
        raise _refuse(f"numpy dtype {brief(descr)}: only plain (non-object, non-structured) dtypes are built")
    if dtype.itemsize <= 0:
        raise _refuse(f"numpy dtype {brief(descr)}: zero-sized items")
    return dtype


def numpy_dtype(descr: Any) -> Any:
    """A numpy dtype from ``dtype.str`` or, for structured dtypes, ``dtype.descr`` of plain fields."""
    import numpy as np

    if type(descr) is str:
        return _simple_numpy_dtype(descr)
    if type(descr) not in (list, tuple) or not 0 < len(descr) <= MAX_FIELDS:
        raise _refuse(f"numpy dtype {brief(descr)}: expected a dtype string or a list of (name, dtype string)")
    # Paid for each time: the memo lets a payload pass one field list to many calls for a few bytes each.
    charge(FIELD_UNITS * len(descr), "a structured numpy dtype")
    fields = []
    for field in descr:
        if type(field) not in (list, tuple) or len(field) != 2 or type(field[0]) is not str or len(field[0]) > 256:
            raise _refuse(f"numpy dtype field {brief(field)}: expected (name, dtype string)")
        fields.append((field[0], _simple_numpy_dtype(field[1])))
    try:
        dtype = np.dtype(fields)  # numpy lays the fields out packed: no overlap, no object
    except Exception as exc:
        raise _refuse(f"numpy dtype {brief(descr)}: {exc}") from None
    if dtype.hasobject or dtype.itemsize <= 0:
        raise _refuse(f"numpy dtype {brief(descr)}")
    return dtype


def _check_code_points(dtype: Any, data: Any) -> None:
    """numpy builds ``str`` from UCS4 data without checking it: refuse values above U+10FFFF."""
    import numpy as np

    if dtype.fields is not None:
        if any(dtype.fields[name][0].kind == "U" for name in dtype.names):
            raise _refuse(f"structured dtype {dtype} with unicode fields")
        return
    if dtype.kind == "U" and data:
        charge(len(data) >> 2, "checking unicode array data")  # the data may be a memoized bytearray: no copy pays
        units = np.frombuffer(data, dtype=np.dtype("u4").newbyteorder(dtype.byteorder))
        if int(units.max()) > 0x10FFFF:
            raise _refuse(f"{dtype} data holding code points above U+10FFFF")


def ndarray(descr: Any, shape: Any, order: Any, data: Any) -> Any:
    """A numpy array of ``shape`` over exactly the bytes given (writable; C or Fortran order)."""
    import numpy as np

    dtype = numpy_dtype(descr)
    shape = _shape(shape)
    if order not in ("C", "F"):
        raise _refuse(f"array order {brief(order)}")
    data = _byte_string(data, "array data")
    expected = _count(shape) * dtype.itemsize
    if len(data) != expected:
        raise _refuse(f"an array of shape {shape} and dtype {dtype}: {len(data):,} bytes given, {expected:,} needed")
    _check_code_points(dtype, data)
    if expected == 0:
        return np.empty(shape, dtype=dtype, order=order)
    if type(data) is bytearray:
        data = unshared(data, "an array's bytes")
    array = np.frombuffer(data, dtype=dtype).reshape(shape, order=order)  # holds the buffer: it cannot resize
    if type(data) is bytearray:
        return array
    charge(expected, "an array copy")
    return array.copy(order="K")


def numpy_scalar(descr: Any, data: Any) -> Any:
    """A numpy scalar from its dtype string and exactly ``itemsize`` bytes."""
    import numpy as np

    dtype = numpy_dtype(descr)
    if type(data) is not bytes:  # as the encoder writes it (tobytes): the walk charges a bytes argument's size to
        # each use of what it built as a key, not a bytearray's (unhashable itself: a helper's find, two equal
        # "S" scalars from one memoized bytearray, compared whole at each of thousands of set insertions)
        raise _refuse(f"a numpy scalar's data: expected bytes, got {type(data).__name__}")
    if len(data) != dtype.itemsize:
        raise _refuse(f"a {dtype} scalar: {len(data)} bytes given, {dtype.itemsize} needed")
    charge(dtype.itemsize, "a numpy scalar")  # a bytes, str or void scalar copies its data
    _check_code_points(dtype, data)
    scalar = np.frombuffer(data, dtype=dtype)[0]
    # A structured scalar indexed from read-only bytes is a read-only view, and hashable: hashing one
    # walks every field (~100 µs for 256), each time it is used as a key. The sender's was writable
    # (and unhashable), as numpy's own unpickling builds it: so is this copy.
    return scalar.copy() if dtype.fields is not None else scalar


def torch_dtype(name: Any) -> Any:
    """``torch.<name>`` for the dtypes tensors may have here (not quantized or bit-packed ones)."""
    if type(name) is not str or name not in _TORCH_DTYPES:
        raise _refuse(f"torch dtype {brief(name)}")
    import torch

    dtype = torch.__dict__.get(name)
    if not isinstance(dtype, torch.dtype):
        raise _refuse(f"torch dtype {brief(name)}: not in this torch version")
    return dtype


def tensor(dtype_name: Any, shape: Any, data: Any, requires_grad: Any) -> Any:
    """A dense CPU tensor of ``shape`` over exactly the bytes given."""
    import torch

    dtype = torch_dtype(dtype_name)
    shape = _shape(shape)
    data = _byte_string(data, "tensor data")
    if type(requires_grad) is not bool:
        raise _refuse("tensor requires_grad: expected a bool")
    charge(DIM_UNITS * len(shape), "a tensor's shape")
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else torch.empty((), dtype=dtype).element_size()
    expected = _count(shape) * itemsize
    if len(data) != expected:
        raise _refuse(f"a tensor of shape {shape} and dtype {dtype}: {len(data):,} bytes given, {expected:,} needed")
    if expected == 0:
        result = torch.empty(shape, dtype=dtype)
    else:
        if type(data) is not bytearray:
            charge(expected, "a tensor copy")
            data = bytearray(data)
        else:
            data = unshared(data, "a tensor's bytes")
        # Through numpy, which holds a buffer export: torch.frombuffer does not, and a bytearray the
        # payload still holds could then be resized under the tensor (a use after free).
        import numpy as np

        flat = torch.from_numpy(np.frombuffer(data, dtype=np.uint8))
        result = flat.view(dtype).reshape(shape)
    if requires_grad:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise _refuse(f"requires_grad on a {dtype} tensor")
        result.requires_grad_(True)
    return result


def parameter(data: Any, requires_grad: Any) -> Any:
    """``torch.nn.Parameter(data, requires_grad)`` for a tensor this module built."""
    import torch

    if type(data) is not torch.Tensor or type(requires_grad) is not bool:
        raise _refuse("a Parameter: expected a plain tensor and a bool")
    nbytes = data.numel() * data.element_size()  # (a second Parameter over one tensor: its own copy, as sent)
    data = unshared(data, "a Parameter's tensor", nbytes, lambda t: t.clone())
    return torch.nn.Parameter(data.detach(), requires_grad=requires_grad)


def uuid(value: Any) -> Any:
    """``uuid.UUID(int=value)`` (the range is checked by UUID itself)."""
    import uuid as _uuid

    if type(value) is not int:
        raise _refuse("a UUID: expected an int")
    try:
        return _uuid.UUID(int=value)
    except ValueError as exc:
        raise _refuse(f"a UUID: {exc}") from None


def bounded_int_text(text: Any, what: str) -> str:
    """``text`` when it is a short enough decimal literal to convert in linear time."""
    if type(text) is not str or len(text) > MAX_INT_DIGITS + 1:
        raise _refuse(f"{what}: a number of more than {MAX_INT_DIGITS} digits")
    return text


# -- encoding side: what restricted-pickle's pickler writes ------------------------------------


def reduce_numpy(value: Any) -> Any:
    """``(constructor, args)`` for a numpy array, scalar or dtype; None for anything else."""
    import numpy as np

    cls = type(value)
    if cls is np.ndarray:
        if value.dtype.hasobject:
            raise TypeError("restricted-pickle cannot carry numpy arrays of dtype=object; use pickle")
        order = "F" if value.flags.f_contiguous and not value.flags.c_contiguous else "C"
        data = value if value.flags.c_contiguous or order == "F" else np.ascontiguousarray(value)
        buffer = _pickle_buffer(data.reshape(-1, order="A").view(np.uint8)) if data.size else b""
        return ndarray, (_numpy_descr(value.dtype), tuple(value.shape), order, buffer)
    if isinstance(value, np.generic):
        if value.dtype.hasobject:
            raise TypeError("restricted-pickle cannot carry numpy object scalars; use pickle")
        return numpy_scalar, (_numpy_descr(value.dtype), value.tobytes())
    if isinstance(value, np.dtype):
        return numpy_dtype, (_numpy_descr(value),)
    return None


def _numpy_descr(dtype: Any) -> Any:
    if dtype.fields is None:
        return dtype.str
    descr = [(name, dtype.fields[name][0].str) for name in dtype.names]
    import numpy as np

    if np.dtype(descr) != dtype or any(np.dtype(d).fields is not None for _, d in descr):
        raise TypeError(f"restricted-pickle carries structured dtypes of plain packed fields only, not {dtype}")
    return descr


def _pickle_buffer(array: Any) -> Any:
    import pickle

    # a writable PickleBuffer pickles in-band as bytearray (one copy, decoded writable, no re-copy)
    return pickle.PickleBuffer(array) if array.flags.writeable else array.tobytes()


def reduce_torch(value: Any) -> Any:
    """``(constructor, args)`` for a dense tensor, Parameter, Size or device; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        if type(value) is torch.nn.Parameter:
            return parameter, (value.detach(), value.requires_grad)
        if type(value) is not torch.Tensor:
            raise TypeError(f"restricted-pickle cannot carry tensor subclass {type(value).__name__}; use pickle")
        if value.__dict__:  # they would be lost: only the data and shape travel
            raise TypeError(
                f"restricted-pickle cannot carry attributes set on a tensor ({', '.join(value.__dict__)}); use pickle"
            )
        if value.layout != torch.strided or value.is_quantized or value.is_nested or value.device.type == "meta":
            raise TypeError("restricted-pickle carries dense tensors only; use pickle for sparse/quantized ones")
        name = str(value.dtype).rpartition(".")[2]
        if name not in _TORCH_DTYPES:
            raise TypeError(f"restricted-pickle cannot carry {value.dtype} tensors; use pickle")
        flat = value.detach().cpu().contiguous().reshape(-1)
        raw: Any = _pickle_buffer(flat.view(torch.uint8).numpy()) if flat.numel() else b""
        return tensor, (name, tuple(value.shape), raw, value.requires_grad)
    return None


def reduce_any(value: Any) -> Any:
    """What restricted-pickle's pickler asks for every non-builtin value: a safe reduction or None."""
    module = type(value).__module__
    if module == "numpy" or module.startswith("numpy."):
        return reduce_numpy(value)
    torch = sys.modules.get("torch")
    if module.startswith("torch") or (torch is not None and isinstance(value, torch.Tensor)):  # subclasses too
        return reduce_torch(value)
    if module == "uuid" and type(value).__name__ == "UUID":
        return uuid, (value.int,)
    return None


__all__: Sequence[str] = ()
