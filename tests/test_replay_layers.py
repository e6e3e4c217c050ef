"""The replay layer is plain Python under the run: nothing under cerevisor_tui/replay/ imports the engine, the
console, the gateway, the supervisor or Textual (read from the source, imports inside functions included)."""

from __future__ import annotations

from pathlib import Path

from cerevisor_tui import replay
from tests.ui.test_layers import _within, imported

FORBIDDEN = ("cerevisor_tui.engine", "cerevisor_tui.ui", "cerevisor_tui.gateway", "cerevisor_tui.supervisor",
             "textual")


def test_replay_imports_nothing_of_the_run_or_the_console():
    found = [f"{path.name}:{line}: {name}" for path in sorted(Path(replay.__file__).parent.glob("*.py"))
             for line, name in imported(path) if any(_within(name, layer) for layer in FORBIDDEN)]
    assert not found, found
