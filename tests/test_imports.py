"""The module graph: no import cycle, every import goes down the floors of the house, modules stay small.

Every import counts, module-level, inside a function (a lazy import that breaks a cycle at import time
is still a cycle in the design) or under ``if TYPE_CHECKING:`` (a type named from a floor above is an
upward dependency all the same). The floors are drawn in docs/internals.md.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Optional, Set

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, package: str) -> Set[str]:
    """The modules of ``package`` that ``path`` imports (resolved, relative imports included)."""
    module = _module_name(path)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # "from . import _x"
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {name for name in found if name == package or name.startswith(package + ".")}


def _graph(package: str) -> Dict[str, Set[str]]:
    files = sorted((ROOT / package).rglob("*.py"))
    modules = {_module_name(f): f for f in files}
    graph = {}
    for name, path in modules.items():
        # "from objcomm._x import Y" also names objcomm._x.Y: keep only what is a module. A parent
        # package is imported before any of its modules anyway ("from . import _x"): not an edge.
        graph[name] = {m for m in _imports(path, package) if m in modules and not (name + ".").startswith(m + ".")}
    return graph


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def walk(node: str) -> Optional[List[str]]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = walk(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_objcomm_modules():
    graph = _graph("objcomm")
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_import_cycle_among_serializers_modules():
    cycle = _find_cycle(_graph("serializers"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


# objcomm's floors, top to bottom: a module imports only from its own floor or the floors below it.
FLOORS = [
    ("objcomm.__main__", "objcomm._tools"),  # the command line and the benchmark: never imported by the library
    ("objcomm", "objcomm.compat", "objcomm.serializers"),  # the public modules
    ("objcomm._api",),  # what a call does: resolve, encode, route, move, decode
    ("objcomm._samehost",),  # optional media for ranks on one host: socket channel, shared memory
    ("objcomm._state",),  # what a process keeps between calls
    ("objcomm._transport",),  # moving messages over a torch process group
    ("objcomm._settings",),
    ("objcomm._format",),  # bytes only: frame, slot, tensor table, compression, limits
    ("objcomm._device", "objcomm._errors"),
]


def _floor(module: str) -> int:
    best = None
    for i, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[1]):
                best = (i, len(name))
    assert best is not None, f"{module} is on no floor: add it to FLOORS (and to docs/internals.md)"
    return best[0]


def test_every_import_goes_down_the_floors():
    upward = [
        f"{m} (floor {_floor(m)}) imports {n} (floor {_floor(n)})"
        for m, used in sorted(_graph("objcomm").items())
        for n in sorted(used)
        if _floor(n) < _floor(m)
    ]
    assert upward == []


def test_the_floor_check_sees_an_upward_import():
    assert _floor("objcomm._format.frame") > _floor("objcomm._transport.rounds") > _floor("objcomm._api.call")
    assert _floor("objcomm._tools.bench.runner") == 0 and _floor("objcomm.compat") == 1


MAX_LINES = 450
# Still past the guide, to be split (each entry shrinks away; a module that grows past it fails here).
TOO_LONG: Set[str] = set()


def test_modules_stay_under_the_line_guide():
    files = sorted([*(ROOT / "objcomm").rglob("*.py"), *(ROOT / "serializers").rglob("*.py")])
    long = {str(f.relative_to(ROOT)) for f in files if len(f.read_text().splitlines()) > MAX_LINES}
    assert long - TOO_LONG == set(), f"past {MAX_LINES} lines: split them"
    assert TOO_LONG - long == set(), "now under the guide: take them off TOO_LONG"
