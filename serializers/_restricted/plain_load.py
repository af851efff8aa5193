"""restricted-pickle's load of a payload the fast walk showed plain: ``pickle.loads`` in a namespace whose
``__import__`` refuses, and the unpickler that refuses every global where that backstop does not hold.
"""

from __future__ import annotations

import pickle
import types
from io import BytesIO
from typing import Any

from serializers._errors import ContentRefusedError
from serializers._pickle import PROTOCOL
from serializers._restricted.stdlib import _refused


def _refuse_import(name: str, *args: Any, **kwargs: Any) -> Any:
    raise _refused(f"importing {name} for a payload the fast walk showed plain")


def _plain_load(raw: bytes) -> Any:
    return _loads(raw)  # type: ignore[name-defined]  # noqa: F821 - from the namespace given below


# The load of a payload the fast walk showed plain: ``pickle.loads`` over the bytes (no file, no
# Unpickler object), called from a function whose builtins hold only an ``__import__`` that refuses.
# The C unpickler resolves every global it looks up by name through ``PyImport_Import``, which calls
# the ``__import__`` of the calling frame's builtins: should the fast walk ever be wrong, a global
# in a "plain" payload is refused before anything is imported or looked up (the backstop), so no
# constructor runs in a plain load, which is why it needs no work budget. (Not so an extension code
# an application registered with ``copyreg`` and loaded once: answered from copyreg's cache. Neither
# walk accepts EXT1/2/4.) ``pickle.loads`` over bytes reads a FRAME's contents as the opcodes
# after it, which parses alike: the fast walk showed every frame begins and ends between opcodes. Checked at
# import (``_backstop_holds``): where a Python resolved a global another way, plain payloads load
# through ``_PlainUnpickler``, whose ``find_class`` refuses.
_plain_load = types.FunctionType(
    _plain_load.__code__, {"__builtins__": {"__import__": _refuse_import}, "_loads": pickle.loads}, "_plain_load"
)


class _PlainUnpickler(pickle.Unpickler):
    """The load of a plain payload where :func:`_plain_load`'s backstop does not hold: it refuses every global."""

    __slots__ = ()

    def find_class(self, module: str, name: str) -> Any:
        raise _refused(f"the global {module}.{name} in a payload the fast walk showed plain")


def _backstop_holds() -> bool:
    try:
        _plain_load(pickle.dumps(len, protocol=PROTOCOL))
    except ContentRefusedError:
        return True
    return False  # pragma: no cover - a Python whose unpickler resolves globals without __import__


if not _backstop_holds():  # pragma: no cover
    _plain_load = lambda raw: _PlainUnpickler(BytesIO(raw)).load()  # noqa: E731
