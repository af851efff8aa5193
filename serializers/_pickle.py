"""The pickle family: stdlib ``pickle``, ``cloudpickle`` and ``restricted-pickle``.

All three write pickle protocol 5 and lift out-of-band objects through ``reducer_override``,
which the C pickler calls only for non-builtin values, so plain data pays nothing for it.
"""

from __future__ import annotations

import functools
import io
import pickle
import pickletools
from typing import Any, Iterable, List, Optional, Set, Tuple, Union

from ._errors import ContentRefusedError, DecodeError, EncodeError
from ._path import describe, locate
from ._protocol import Buffer, Lift, Restore, Serializer

PROTOCOL = 5
_EXTERNAL = ("serializers._pickle", "external_ref")


def external_ref(key: int) -> Any:
    """Stand-in global for an out-of-band object; loads() without ``restore=`` ends up here."""
    raise DecodeError(
        f"the payload refers to out-of-band object #{key}, but no out-of-band objects came with it; "
        "decode it through objcomm, or pass restore= to loads()"
    )


@functools.cache
def _lifting(base: type) -> type:
    """A Pickler subclass of ``base`` that offers each non-builtin value to ``lift``."""

    class LiftingPickler(base):  # type: ignore[misc, valid-type]
        def __init__(self, file: Any, lift: Lift) -> None:
            super().__init__(file, protocol=PROTOCOL)
            self._lift = lift

        def reducer_override(self, obj: Any) -> Any:
            key = self._lift(obj)
            if key is not None:
                return external_ref, (key,)
            parent = getattr(super(), "reducer_override", None)
            return parent(obj) if parent is not None else NotImplemented

    return LiftingPickler


class _Unpickler(pickle.Unpickler):
    """Resolves the out-of-band stand-in to ``restore``; everything else as usual."""

    def __init__(self, file: Any, restore: Restore | None) -> None:
        super().__init__(file)
        self._restore = restore

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _EXTERNAL and self._restore is not None:
            return self._restore
        return super().find_class(module, name)


class PickleSerializer(Serializer):
    """Stdlib pickle, protocol 5: carries every picklable type exactly; loading can run code."""

    name = "pickle"
    safe = False
    description = "stdlib pickle (protocol 5): any picklable object, exact; loads can run arbitrary code"
    supports_external = True
    hint = "cloudpickle can carry lambdas, closures and classes defined in __main__"

    def _pickler_base(self) -> type:
        return pickle.Pickler

    def _dumps_plain(self, obj: Any) -> Buffer:
        return pickle.dumps(obj, protocol=PROTOCOL)

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        try:
            if lift is None:
                return self._dumps_plain(obj)
            file = io.BytesIO()
            _lifting(self._pickler_base())(file, lift).dump(obj)
            return file.getbuffer()
        except Exception as exc:
            raise self._encode_error(obj, exc) from exc

    def _unpickler(self, file: Any, restore: Restore | None) -> pickle.Unpickler:
        return _Unpickler(file, restore)

    def _loads_plain(self, data: Buffer) -> Any:
        return pickle.loads(data)

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        try:
            if restore is None and type(self)._unpickler is PickleSerializer._unpickler:
                return self._loads_plain(data)  # the C fast path: no hooks to install
            return self._unpickler(io.BytesIO(data), restore).load()
        except (ContentRefusedError, DecodeError):
            raise
        except Exception as exc:
            raise DecodeError(
                f"{self.name} cannot decode {memoryview(data).nbytes} bytes: {type(exc).__name__}: {exc}"
            ) from exc

    def _encode_error(self, obj: Any, exc: BaseException) -> EncodeError:
        def rejects(value: Any, is_key: bool) -> bool:
            try:
                self._dumps_plain(value)
            except Exception:
                return True
            return False

        found = locate(obj, rejects)
        path, value, _ = found if found is not None else ("$", obj, False)
        return EncodeError(f"{self.name} cannot encode {describe(value)} at {path}: {exc}; {self.hint}")


class CloudpickleSerializer(PickleSerializer):
    """cloudpickle: pickle plus lambdas, closures and classes defined in ``__main__``."""

    name = "cloudpickle"
    description = "cloudpickle: pickle plus lambdas, closures, __main__ classes; loads can run arbitrary code"
    hint = "the value holds something cloudpickle cannot pickle (a lock, a socket, an open file?)"

    def _pickler_base(self) -> type:
        import cloudpickle

        return cloudpickle.Pickler  # type: ignore[no-any-return]

    def _dumps_plain(self, obj: Any) -> Buffer:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=PROTOCOL)


def _safe_load_from_bytes(data: bytes) -> Any:
    """Safe stand-in for ``torch.storage._load_from_bytes`` (which loads with ``weights_only=False``)."""
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


_ALLOWED_GLOBALS: Set[Tuple[str, str]] = {
    *(("builtins", n) for n in ("set", "frozenset", "complex", "bytearray", "slice", "range", "object")),
    *(("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")),
    *(("datetime", n) for n in ("datetime", "date", "time", "timedelta", "timezone")),
    ("decimal", "Decimal"),
    ("fractions", "Fraction"),
    ("uuid", "UUID"),
    *((m, n) for m in ("numpy.core.multiarray", "numpy._core.multiarray") for n in ("_reconstruct", "scalar")),
    *((m, "_frombuffer") for m in ("numpy.core.numeric", "numpy._core.numeric")),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    *(("torch._utils", n) for n in ("_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter")),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "device"),
    _EXTERNAL,
}
def _argument_kinds() -> List[Optional[Tuple[int, int]]]:
    """Per opcode byte: ``(kind, size)`` of its argument, from pickletools' table; None: unknown opcode.

    kind 0: fixed ``size`` bytes; 1: up to a newline (``size`` lines); 2: a length prefix of ``size``
    bytes, then that many bytes.
    """
    table: List[Optional[Tuple[int, int]]] = [None] * 256
    prefixed = {
        pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
        pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8,
    }
    for op in pickletools.opcodes:
        arg = op.arg
        if arg is None:
            kind = (0, 0)
        elif arg.n >= 0:
            kind = (0, arg.n)
        elif arg.n == pickletools.UP_TO_NEWLINE:
            kind = (1, 2 if arg.name == "stringnl_noescape_pair" else 1)
        else:
            kind = (2, prefixed[arg.n])
        table[ord(op.code)] = kind
    return table


_ARGUMENTS = _argument_kinds()
_MEMO_PUTS = {ord("p"), ord("q"), ord("r")}  # PUT, BINPUT, LONG_BINPUT
_STOP = ord(".")


def _check_lengths(data: Buffer) -> None:
    """Walk the opcodes without building anything: every declared length must fit in the bytes that
    follow, and memo slots must be sequential. pickle allocates what a length opcode declares
    *before* reading it, and grows its memo to any index a PUT names; this refuses both cheaply."""
    raw = bytes(data)
    size, at, count = len(raw), 0, 0
    table = _ARGUMENTS
    while at < size:
        code = raw[at]
        kind = table[code]
        if kind is None:
            raise ValueError(f"unknown opcode {code:#x} at byte {at}")
        start = at + 1
        form, width = kind
        if form == 0:
            at = start + width
        elif form == 1:
            at = start
            for _ in range(width):
                newline = raw.find(b"\n", at)
                if newline < 0:
                    raise ValueError(f"unterminated line argument at byte {start}")
                at = newline + 1
        else:
            length = int.from_bytes(raw[start : start + width], "little", signed=width == 4 and code in (0x8B, 0x54))
            if length < 0 or start + width + length > size:
                raise ValueError(f"opcode at byte {at} declares {length:,} bytes, {size - start - width:,} remain")
            at = start + width + length
        if code in _MEMO_PUTS:
            index = int(raw[start : at - 1]) if code == ord("p") else int.from_bytes(raw[start:at], "little")
            if index > count:
                raise ValueError(f"memo slot {index} after {count} opcodes")
        if at > size:
            raise ValueError("truncated payload")
        if code == _STOP:
            return
        count += 1
    raise ValueError("payload ends without STOP")


_REPLACED_GLOBALS = {("torch.storage", "_load_from_bytes"): _safe_load_from_bytes}


class _RestrictedUnpickler(_Unpickler):
    def __init__(self, file: Any, restore: Restore | None, allowed: Set[Tuple[str, str]]) -> None:
        super().__init__(file, restore)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        replaced = _REPLACED_GLOBALS.get((module, name))
        if replaced is not None:
            return replaced
        if (module, name) in self._allowed or _is_dtype_global(module, name):
            return super().find_class(module, name)
        raise ContentRefusedError(
            f"restricted-pickle refused to load global {module}.{name}: it is not on the allow-list, "
            "so nothing was run. If you trust it, allow it with "
            f"serializers.get('restricted-pickle').allow('{module}.{name}')"
        )


def _is_dtype_global(module: str, name: str) -> bool:
    """``torch.float32`` and friends, and numpy's ``numpy.dtypes.Float32DType`` classes."""
    if module == "torch":
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return module == "numpy.dtypes" and name.endswith("DType") and name.isidentifier()


class RestrictedPickleSerializer(PickleSerializer):
    """Pickle whose loads resolves only an allow-list of globals, so a payload cannot run code.

    Allowed: builtin containers and scalars, ``collections``/``datetime``/``decimal`` types,
    numpy arrays, torch tensors, plus what you add::

        serializers.get("restricted-pickle").allow(MyRecord, "mypkg.types.Other")
    """

    name = "restricted-pickle"
    safe = True
    description = "pickle whose loads only resolves allow-listed globals (containers, numpy, torch, yours)"
    hint = "the same value may not be loadable either: restricted-pickle only loads allow-listed classes"

    def __init__(self) -> None:
        self._allowed: Set[Tuple[str, str]] = set(_ALLOWED_GLOBALS)

    def allow(self, *globals_: Union[type, str]) -> None:
        """Allow classes (or ``"module.Name"`` strings) to be loaded."""
        for item in globals_:
            if isinstance(item, str):
                module, _, name = item.rpartition(".")
                if not module:
                    raise ValueError(f"expected 'module.Name', got {item!r}")
            else:
                module, name = item.__module__, item.__qualname__
            self._allowed.add((module, name))

    def allowed(self) -> Iterable[str]:
        """The allowed globals as ``module.Name`` strings, sorted."""
        return sorted(f"{m}.{n}" for m, n in self._allowed)

    def _unpickler(self, file: Any, restore: Restore | None) -> pickle.Unpickler:
        return _RestrictedUnpickler(file, restore, self._allowed)

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        # pickle allocates whatever a length opcode declares before reading it (b"\x80\x05\x8e" + an
        # 8-byte length asks for gigabytes); walk the opcodes first, which checks every length against
        # the bytes actually present without allocating it.
        try:
            _check_lengths(data)
        except Exception as exc:
            raise DecodeError(f"{self.name} refused a malformed payload: {exc}") from None
        return super().loads(data, restore=restore)
