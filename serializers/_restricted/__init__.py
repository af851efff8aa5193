"""restricted-pickle: pickle whose payloads can name only vetted constructors, whatever the bytes say.

How a hostile payload is kept harmless (``docs/security.md`` states the guarantee):

1. **The opcode scan** (``_pickle_scan.scan``) runs pickle's stack machine on summaries of the
   values: it checks every declared length, memo index and text number against the bytes present,
   bounds tuple nesting and hashing work, keeps globals out of values, and refuses opcodes objcomm
   never writes — before the C unpickler allocates or hashes anything. Plain data (no global,
   call or state; tuples only of the scalars just before them) is recognised first by a fast walk
   (``_pickle_plain``; in C where it was built), which checks the one rule such a payload can break:
   declared lengths. Such a payload is loaded by ``pickle.loads`` in a namespace whose
   ``__import__`` refuses (``_plain_load``: the backstop should the fast walk ever be wrong, as the C
   unpickler imports every global it looks up by name), so no constructor runs in it.
2. **Guards, not globals.** ``find_class`` never imports or returns what the payload names. It
   returns a *guard*: a class (so NEWOBJ accepts it) whose metaclass routes a call (REDUCE, OBJ,
   INST) to a validating constructor, whose ``__new__`` routes NEWOBJ likewise, and whose
   ``__setstate__`` refuses BUILD on the global itself. Constructors take only values built from
   the payload (lists, tuples, dicts, bytes) and bound every size by them: ``bytearray(10**9)``,
   ``set(range(10**9))`` or ``Fraction("1e30000000")`` are refused. Pickle's memo lets a payload
   pass one value to many calls for a few bytes each, so no call is paid for by its arguments'
   size: each is charged to a budget proportional to the payload (``WORK_PER_BYTE``) what it costs,
   whatever its arguments: the guard charges its fixed cost (``units`` in ``_SPECS``) and the size
   of what it returned, the constructor what it copies, hashes or builds beyond that (a structured
   dtype's fields). stdlib types are built by ``_stdlib_rebuild``; numpy and torch values are
   rebuilt by ``_rebuild`` from dtype, shape and the bytes present; numpy's and torch's own
   reconstructors are never reachable. The allow-list is checked before any import.
3. **The probe pass.** BUILD (``__setstate__`` or attribute updates) is allowed only on instances
   of classes the user allowed, APPEND/SETITEM only on the containers that take them. When one of
   those opcodes acts on anything but a list, dict or set the payload's own opcodes built (which
   the scan's model of pickle's stack and memo tells exactly, ``_pickle_scan._target``), the
   payload is first run through the C unpickler with every guard returning an inert *probe* that
   knows only what kind of value it stands for; a BUILD, APPEND or SETITEM on a probe of the wrong
   kind refuses the payload. Pickle is straight-line code, so the real pass that follows applies
   BUILD only where the probe pass allowed it. Both passes run at C speed.
4. **Classes travel only as constructors.** The scan refuses a global used as anything but a
   callable or a direct argument of a call; guards refuse guards as arguments (but for a
   defaultdict's factory).

This module holds the serializer; ``allowlist.py`` the allow-list and the work budget, ``guards.py`` the
guards, probes and unpicklers, ``plain_load.py`` the plain load and its backstop, ``scan.py`` and ``plain.py``
the two walks, ``opcode_tables.py`` the full walk's opcode tables, ``stdlib.py`` the stdlib constructors.
"""

from __future__ import annotations

import io
import pickle
from typing import Any, Iterable, Set, Tuple, Union

from serializers import _budget, _rebuild
from serializers._errors import ContentRefusedError, DecodeError, ObjcommError, decode_error
from serializers._pickle import PROTOCOL, PickleSerializer
from serializers._protocol import Buffer, Restore
from serializers._restricted.allowlist import _SPECS, _WORK_FLOOR, WORK_PER_BYTE
from serializers._restricted.guards import _Guards, _RestoringUnpickler
from serializers._restricted.plain import is_plain, is_plain_python
from serializers._restricted.plain_load import _plain_load
from serializers._restricted.scan import ScanError, full_walk, full_walk_python

# -- the serializer ----------------------------------------------------------------------------


class _SafePickler(pickle.Pickler):
    """Writes numpy, torch and UUID values as calls to ``serializers._rebuild``."""

    def reducer_override(self, obj: Any) -> Any:
        reduced = _rebuild.reduce_any(obj)
        return NotImplemented if reduced is None else reduced


class python_walks:
    """Inside ``with python_walks():``, restricted-pickle runs both walks in pure Python, as an install
    without a compiler does (for tests and benchmarks; it swaps this module's globals, so not for
    threads that decode meanwhile)."""

    def __enter__(self) -> None:
        global is_plain, full_walk
        self._saved = is_plain, full_walk
        is_plain, full_walk = is_plain_python, full_walk_python

    def __exit__(self, *exc: Any) -> None:
        global is_plain, full_walk
        is_plain, full_walk = self._saved


_BASE_ALLOWED: Set[Tuple[str, str]] = set()


class RestrictedPickleSerializer(PickleSerializer):
    """Pickle whose loads builds only vetted types, so no payload can run code or forge memory.

    Built: builtin containers and scalars, ``collections``/``datetime``/``decimal``/``fractions``
    types, numpy arrays and scalars, dense torch tensors and Parameters, UUIDs, plus what you allow::

        serializers.get("restricted-pickle").allow(MyRecord, "mypkg.types.Other")

    Allowing a class lets a payload create instances with any attribute values (and call the class
    with any arguments): allow only classes that are harmless whatever their fields hold.
    """

    name = "restricted-pickle"
    safe = True
    description = "pickle whose loads only builds vetted types (containers, numpy, torch, yours); no code runs"
    _raises_own_errors = True
    hint = "restricted-pickle carries builtins, numpy, dense tensors and allowed classes; pickle carries more"
    _reusable = True  # _SafePickler keeps no state between pickles but its memo

    def __init__(self) -> None:
        self._allowed: Set[Tuple[str, str]] = set(_BASE_ALLOWED)
        self._guards = _Guards(self._allowed)

    def _pickler_base(self) -> type:
        return _SafePickler

    def _dumps_plain(self, obj: Any) -> Buffer:
        file = io.BytesIO()
        _SafePickler(file, protocol=PROTOCOL).dump(obj)
        return file.getbuffer()

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
        self._guards = _Guards(self._allowed)

    def allowed(self) -> Iterable[str]:
        """Everything a payload may name, as ``module.Name`` strings, sorted."""
        return sorted({f"{m}.{n}" for m, n in (*_SPECS, *self._allowed)})

    def loads(self, data: Buffer, /, *, restore: Restore | None = None) -> Any:
        try:
            raw = data if type(data) is bytes else bytes(data)
            plain = is_plain(raw)
            noted = [0]  # the bytes of its longest int past scan.NOTED_INT_BYTES
            needs_probe = not plain and full_walk(raw, noted)
        except Exception as exc:
            if isinstance(exc, ScanError) and "class or function" in str(exc):
                raise ContentRefusedError(f"{self.name} refused the payload: {exc}; nothing was run") from None
            raise DecodeError(f"{self.name} refused a malformed payload: {type(exc).__name__}: {exc}") from None
        if plain:
            # No global, call or state: the plain load refuses every global, so no constructor runs
            # (no work budget is needed) and no out-of-band reference can occur (restore unused).
            try:
                return _plain_load(raw)
            except ObjcommError:
                raise
            except Exception as exc:
                raise decode_error(self.name, data, exc) from exc
        guards = self._guards
        # What ``with decoding(...), work_budget(...)`` does, without two context managers per load.
        # BytesIO over bytes shares them: neither pass copies the payload again.
        outer = _budget.start_budget(WORK_PER_BYTE * len(raw) + _WORK_FLOOR)
        try:
            _budget.big_number(8 * noted[0], "an int")  # (n bytes, a sign bit among them: at most 8n - 1 bits)
            if needs_probe:
                guards.probe_unpickler(io.BytesIO(raw)).load()
                _budget.nesting_checked()
            if restore is None:
                return guards.unpickler(io.BytesIO(raw)).load()
            return _RestoringUnpickler(io.BytesIO(raw), guards, restore).load()
        except ObjcommError:
            raise
        except Exception as exc:
            raise decode_error(self.name, data, exc) from exc
        finally:
            _budget.end_budget(outer)
