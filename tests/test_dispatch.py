"""Every subscriber dispatches events the same way: methods named a prefix + an event kind, looked up once
(`events.handlers`). A misspelt kind would never be called, silently: each such method must name a kind."""

from __future__ import annotations

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.model import UiModel


@pytest.mark.parametrize(("cls", "prefixes"), [(UiModel, UiModel.HANDLERS), (RunMirror, RunMirror.HANDLERS),
                                               (Report, ("_on_",)), (Printer, ("_line_",))])
def test_each_handler_method_names_an_event_kind(cls, prefixes):
    named = [(prefix, name[len(prefix):]) for name in dir(cls) for prefix in prefixes if name.startswith(prefix)]
    assert named, f"{cls.__name__} has no {prefixes} methods"
    unknown = [prefix + kind for prefix, kind in named if kind not in {cls.kind for cls in ev.EVENT_TYPES}]
    assert not unknown, f"{cls.__name__}: {unknown} name no event kind"


def test_a_kind_with_methods_under_two_prefixes_runs_both_in_order():
    seen = []

    class Base:
        def _on_AgentQueued(self, e):
            seen.append(("base", e.agent))

    class Sub(Base):
        def _see_AgentQueued(self, e):
            seen.append(("sub", e.agent))

        def _see_RunNotice(self, e):
            seen.append(("notice", e.message))

    table = ev.handlers(Sub(), "_on_", "_see_")
    assert set(table) == {"AgentQueued", "RunNotice"}
    table["AgentQueued"](ev.AgentQueued(0.0, "a", 0))
    table["RunNotice"](ev.RunNotice(0.0, "hello"))
    assert seen == [("base", "a"), ("sub", "a"), ("notice", "hello")]


def test_a_keepalive_reaches_the_mirror_as_life_on_a_bytes_endpoint_without_a_new_version():
    """UiModel takes a KeepAlive on its fast path (no version: nothing to redraw); the mirror's own handler
    must still run, or a liveness = "bytes" agent's countdown would not restart on a keep-alive."""
    mirror = RunMirror()
    mirror(ev.StallPolicyChanged(0.0, "box", ev.StallPolicy(60.0, 5.0, (0.5,), "bytes", 30.0, 1, False)))
    mirror(ev.AgentStarted(1.0, "a", 1, 1, 1, "box", 60.0, 5.0))
    version = mirror.version
    mirror(ev.KeepAlive(4.0, "a", 1))
    assert mirror.keepalive_at["a"] == 4.0 and mirror.version == version
    assert mirror.agents["a"].attempt.last_alive == 4.0
