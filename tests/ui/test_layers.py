"""The console is a pure client of a run: no module under cerevisor_tui/ui/ imports the engine, the endpoints
layer, or httpx (what it knows of a run is the contract package's), and the contract imports neither side. Read from the source with `ast`, so an import
inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import cerevisor_tui

PACKAGE = Path(cerevisor_tui.__file__).parent
UI = PACKAGE / "ui"
ALLOWED: set[str] = set()
FORBIDDEN = ("cerevisor_tui.engine", "cerevisor_tui.endpoints", "httpx")


def imported(path: Path) -> list[tuple[int, str]]:
    """Every name `path` imports, absolute, with its line: `import x` as `x`, `from x import y` as `x.y` (y
    may be a module or a name in it: either way it comes from x)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):  # every node, so imports inside functions and classes are caught
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _within(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def offences(path: Path, forbidden: tuple[str, ...] = FORBIDDEN) -> list[str]:
    return [f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}" for line, name in imported(path)
            if any(_within(name, f) for f in forbidden) and not any(_within(name, a) for a in ALLOWED)]


def test_the_contract_imports_neither_the_run_nor_the_console():
    modules = sorted((PACKAGE / "contract").rglob("*.py"))
    assert len(modules) >= 2
    forbidden = ("cerevisor_tui.engine", "cerevisor_tui.ui", "cerevisor_tui.supervisor", "cerevisor_tui.endpoints",
                 "cerevisor_tui.commands", "textual", "httpx")
    assert [problem for path in modules for problem in offences(path, forbidden)] == []


def test_no_ui_module_imports_the_engine_the_endpoints_or_httpx():
    modules = sorted(UI.rglob("*.py"))
    assert len(modules) > 20  # the walk found the console's modules
    problems = [problem for path in modules for problem in offences(path)]
    assert problems == []


def test_the_check_catches_an_import_inside_a_function(monkeypatch):
    sample = UI / "_layer_probe_sample.py"  # parsed from its text only: never imported, never kept
    text = ("from cerevisor_tui.contract import events as ev\nfrom . import format\n"
            "def f():\n    from cerevisor_tui.engine.engine import Engine\n    import httpx\n"
            "    from ..endpoints import client\n    from cerevisor_tui import engine\n")
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: text if self == sample else
                        Path.read_bytes(self).decode(encoding or "utf-8"))
    assert offences(sample) == [
        "cerevisor_tui/ui/_layer_probe_sample.py:4 imports cerevisor_tui.engine.engine.Engine",
        "cerevisor_tui/ui/_layer_probe_sample.py:5 imports httpx",
        "cerevisor_tui/ui/_layer_probe_sample.py:6 imports cerevisor_tui.endpoints.client",
        "cerevisor_tui/ui/_layer_probe_sample.py:7 imports cerevisor_tui.engine",
    ]
