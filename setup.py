"""The compiled parts: restricted-pickle's two walks in C (``serializers/_restricted/_walks_c.c``: the fast
walk of plain data and the full walk), and ``serializer="auto"``'s look at an object
(``serializers/_exact_tree_c.c``: whether msgspec carries it exactly).

Optional: where they cannot be built (no compiler), the install goes on; restricted-pickle runs the
same walks in pure Python (``serializers/_restricted/plain.py``, ``scan.py``), slower on small
payloads, and ``auto`` does without msgspec's fast lane (pickle first). Everything else is in ``pyproject.toml``.
"""

from setuptools import Extension, setup

WALKS = Extension("serializers._restricted._walks_c", ["serializers/_restricted/_walks_c.c"], optional=True)
EXACT_TREE = Extension("serializers._exact_tree_c", ["serializers/_exact_tree_c.c"], optional=True)
setup(ext_modules=[WALKS, EXACT_TREE])
