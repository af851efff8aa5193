"""The pickle family: stdlib ``pickle`` and ``cloudpickle`` (``restricted-pickle`` builds on them).

All of them write pickle protocol 5 and lift out-of-band objects through ``reducer_override``,
which the C pickler calls only for non-builtin values, so plain data pays nothing for it.
"""

from __future__ import annotations

import functools
import io
import pickle
from typing import Any, List, Tuple

from serializers._errors import DecodeError, EncodeError, ObjcommError, decode_error, raised_by
from serializers._path import describe, locate
from serializers._protocol import Buffer, Lift, Restore, Serializer

PROTOCOL = 5
EXTERNAL = ("serializers._pickle", "external_ref")  # the stand-in global for out-of-band objects
SPARE_BYTES = 64 << 10  # a pickler whose pickle stayed below this is kept for the next dumps (see _dump)
SPARES = 4  # at most this many per pickler class (one per thread pickling at the same time)


def external_ref(key: int) -> Any:
    """Stand-in global for an out-of-band object; loads() without ``restore=`` ends up here."""
    raise DecodeError(
        f"the payload refers to out-of-band object #{key}, but no out-of-band objects came with it; "
        "decode it through objcomm, or pass restore= to loads()"
    )


@functools.cache
def _lifting(base: type) -> Any:
    """A Pickler subclass of ``base`` that offers each non-builtin value to ``lift``."""

    # the base's own hook, found once: it runs for every value offered and declined (each small numpy array)
    parent = getattr(base, "reducer_override", None)

    class LiftingPickler(base):  # type: ignore[misc]  # mypy takes a base held in a variable as Any
        _lift: Lift  # set by dumps() for each pickle (no __init__ of its own: one less Python call per dumps)
        spares: List[Tuple[io.BytesIO, Any]] = []  # this class's (file, pickler) pairs kept for the next dumps (_dump)

        if parent is None:

            def reducer_override(self, obj: Any) -> Any:
                key = self._lift(obj)
                return NotImplemented if key is None else (external_ref, (key,))
        else:

            def reducer_override(self, obj: Any) -> Any:
                key = self._lift(obj)
                return parent(self, obj) if key is None else (external_ref, (key,))

    return LiftingPickler


def _lifts_nothing(obj: Any) -> None:
    """What a kept pickler holds as its lift between pickles."""
    return None


def _dump(base: type, obj: Any, lift: Lift) -> Buffer:
    """``obj`` pickled by the lifting pickler of ``base``, offering ``lift`` each non-builtin value.

    Making a pickler costs more than pickling a small object with it (~0.6 µs), so a pickler that pickled
    something small is kept, memo cleared, for the next call: taken from its class's spares by one thread
    at a time (``list.pop``/``append`` are atomic), so threads and a ``dumps`` inside a reducer each get
    their own. A pickle past :data:`SPARE_BYTES` is handed over as its file's buffer, without a copy, and
    that pickler is not kept (nor one that raised, whose state is unknown). Only for picklers that keep no
    state between pickles besides their memo (stdlib pickle's; not cloudpickle's).
    """
    cls = _lifting(base)
    spares = cls.spares
    try:
        file, pickler = spares.pop()
    except IndexError:
        file = io.BytesIO()
        pickler = cls(file, protocol=PROTOCOL)
    pickler._lift = lift
    pickler.dump(obj)
    pickler._lift = _lifts_nothing  # the lifter and what it holds are not kept with the pickler
    if file.tell() > SPARE_BYTES:
        return file.getbuffer()
    data = file.getvalue()
    file.seek(0)
    file.truncate()
    pickler.clear_memo()
    if len(spares) < SPARES:
        spares.append((file, pickler))
    return data


class _Unpickler(pickle.Unpickler):
    """Resolves the out-of-band stand-in to ``restore``; everything else as usual."""

    def __init__(self, file: Any, restore: Restore | None) -> None:
        super().__init__(file)
        self._restore = restore

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == EXTERNAL and self._restore is not None:
            return self._restore
        return super().find_class(module, name)


class PickleSerializer(Serializer):
    """Stdlib pickle, protocol 5: carries every picklable type exactly; loading can run code."""

    name = "pickle"
    safe = False
    description = "stdlib pickle (protocol 5): any picklable object, exact; loads can run arbitrary code"
    supports_external = True
    # numpy arrays up to this size are pickled in place (protocol 5, in band), exactly: objcomm lifts larger
    # ones out of the payload. Measured (docs/bench.md, many small arrays): below it, pickling an array costs
    # less than lifting it; above, the lift's fewer copies win. Not inherited (see __init_subclass__).
    in_band_array_bytes = 4 << 10
    _raises_own_errors = True
    # what an encode error suggests, by cause (see _encode_error): pickle found no importable name for
    # a value (a lambda, a local function, a class defined in __main__), which cloudpickle carries by value
    by_value_hint = "cloudpickle can carry lambdas, closures and classes defined in __main__"
    # ... or the value holds something that has no pickled form at all
    hint = (
        "no pickle carries it (a lock, a socket, a generator?): leave it out of the object, "
        "or give its class a __getstate__ that drops it"
    )
    _reusable = True  # its pickler keeps no state between pickles but its memo (see _dump)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._reusable = bool(vars(cls).get("_reusable", False))  # a subclass's pickler is kept only if it says so
        # and keeps arrays in band only if it says so: its loads may build them otherwise (restricted-pickle's
        # guards cost more per array than a lifted array does, so it lifts them all)
        cls.in_band_array_bytes = vars(cls).get("in_band_array_bytes", -1)

    def _pickler_base(self) -> type:
        return pickle.Pickler

    def _dumps_plain(self, obj: Any) -> Buffer:
        return pickle.dumps(obj, protocol=PROTOCOL)

    def dumps(self, obj: Any, /, *, lift: Lift | None = None) -> Buffer:
        try:
            if lift is None:
                return self._dumps_plain(obj)
            if self._reusable:
                return _dump(self._pickler_base(), obj, lift)
            file = io.BytesIO()
            pickler = _lifting(self._pickler_base())(file, protocol=PROTOCOL)
            pickler._lift = lift
            pickler.dump(obj)
            return file.getbuffer()
        except Exception as exc:
            raise self._encode_error(obj, exc) from exc

    def _unpickler(self, file: Any, restore: Restore | None) -> pickle.Unpickler:
        return _Unpickler(file, restore)

    def _loads_plain(self, data: Buffer) -> Any:
        return pickle.loads(data)

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        try:  # what ``with decoding(self.name, data)`` does, without a context manager's three calls per load
            if restore is None and type(self)._unpickler is PickleSerializer._unpickler:
                return self._loads_plain(data)  # the C fast path: no hooks to install
            return self._unpickler(io.BytesIO(data), restore).load()
        except ObjcommError:
            raise
        except Exception as exc:
            raise decode_error(self.name, data, exc) from exc

    def _encode_error(self, obj: Any, exc: BaseException) -> EncodeError:
        def rejects(value: Any, is_key: bool) -> bool:
            try:
                self._dumps_plain(value)
            except Exception:
                return True
            return False

        found = locate(obj, rejects)
        path, value, _ = found if found is not None else ("$", obj, False)
        where = f"{self.name} cannot encode {describe(value)} at {path}"
        own = raised_by(exc)
        if own is not None:  # a __reduce__ or __getstate__ raised: no other serializer would fix that
            return EncodeError(
                f"{where}: {own} raised {type(exc).__name__}: {exc}; that is the object's own code, "
                f"not a limit of {self.name}: fix it there"
            )
        # pickle found no importable name for the value (a lambda, a local function or class): cloudpickle
        # pickles such values by value
        by_name = isinstance(exc, pickle.PicklingError) or (
            isinstance(exc, AttributeError) and "local object" in str(exc)
        )
        return EncodeError(f"{where}: {exc}; {self.by_value_hint if by_name else self.hint}")


class CloudpickleSerializer(PickleSerializer):
    """cloudpickle: pickle plus lambdas, closures and classes defined in ``__main__``."""

    name = "cloudpickle"
    description = "cloudpickle: pickle plus lambdas, closures, __main__ classes; loads can run arbitrary code"
    _raises_own_errors = True
    hint = "the value holds something cloudpickle cannot pickle (a lock, a socket, a generator?)"
    by_value_hint = hint
    in_band_array_bytes = PickleSerializer.in_band_array_bytes  # it pickles arrays as pickle does

    def _pickler_base(self) -> type:
        import cloudpickle

        return cloudpickle.Pickler  # type: ignore[no-any-return]  # cloudpickle has no type hints

    def _dumps_plain(self, obj: Any) -> Buffer:
        import cloudpickle

        return cloudpickle.dumps(obj, protocol=PROTOCOL)
