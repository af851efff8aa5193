"""The module graph: no import cycle among objcomm's modules, and serializers never imports torch.

Every import counts, module-level or inside a function (a lazy import that breaks a cycle at
import time is still a cycle in the design); only ``if TYPE_CHECKING:`` blocks are left out.
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


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: pathlib.Path, package: str) -> Set[str]:
    """The modules of ``package`` that ``path`` imports (resolved, relative imports included)."""
    module = _module_name(path)
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: Set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
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
                return path[path.index(nxt):] + [nxt]
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
