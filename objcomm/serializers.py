"""``objcomm.serializers``: the documented way to reach the torch-free ``serializers`` package.

``from objcomm import serializers`` and ``import objcomm.serializers`` give the very same module
object as ``import serializers`` (this module puts that package in its own place in ``sys.modules``),
so a serializer registered through one name is registered for all. Importing it imports no torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers see: the package's public names
    from serializers import *  # noqa: F403
    from serializers import __all__ as __all__
else:
    import serializers as _package

    sys.modules[__name__] = _package
