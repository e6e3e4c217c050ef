"""The engine's parts take ports, not the engine: no module under engine/ but the engine itself and the few that
put a run together or hand it commands imports `Engine`, and the import picture inside engine/ has no circle
(a type-only import counts: it is how a back-pointer to a hub comes in). Read from the source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import cerevisor_tui

ENGINE = Path(cerevisor_tui.__file__).parent / "engine"
# what may hold the whole engine: the module itself, the run's assembly for a command, the in-process control
HOLDERS = {"engine", "run_setup", "control"}


def engine_imports(path: Path) -> set[str]:
    """The modules of engine/ (by short name) that `path` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("cerevisor_tui.engine."):
                found.add(node.module.removeprefix("cerevisor_tui.engine.").split(".")[0])
            elif node.module == "cerevisor_tui.engine":
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("cerevisor_tui.engine.").split(".")[0] for a in node.names
                      if a.name.startswith("cerevisor_tui.engine.")}
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    return {path.stem: engine_imports(path) for path in ENGINE.glob("*.py")}


def test_no_feature_module_imports_the_engine():
    takers = sorted(name for name, imports in graph().items() if "engine" in imports and name not in HOLDERS)
    assert takers == []


def test_the_import_picture_inside_engine_has_no_circle():
    edges = graph()
    circles: list[list[str]] = []

    def visit(name: str, path: list[str]) -> None:
        for nxt in sorted(edges.get(name, ())):
            if nxt in path:
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt in edges:
                visit(nxt, path + [nxt])

    for start in sorted(edges):
        visit(start, [start])
    assert circles == []


def test_the_reader_sees_a_circle_where_there_is_one(tmp_path: Path):
    """The check itself can fail: a type-only back-pointer is an import."""
    module = tmp_path / "pools.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from cerevisor_tui.engine.engine import Engine\n", encoding="utf-8")
    assert engine_imports(module) == {"engine"}
