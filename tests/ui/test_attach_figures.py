"""A console attached to a run late, over the run's real control socket (the console's own attached handle, in
Textual's pilot): it shows the run's true totals, which the run tells it (RunTally), not what it counted since it
came; and the run's past notices are one line, not a toast each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cerevisor_tui.commands.console_client import attached_handle
from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.sim import SimServer
from cerevisor_tui.ui.app import CerevisorApp
from cerevisor_tui.ui.format import fmt_count
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.theme_files import load_themes
from cerevisor_tui.ui.widgets.load_pane import LoadPane
from tests.conftest import until
from tests.test_supervisor import Run

pytestmark = pytest.mark.anyio


async def test_a_console_attached_late_shows_the_runs_total_and_its_past_notices_in_one_line(tmp_path: Path):
    async with SimServer(SimSettings(tokens_per_s=200, ttft_s=0.02)) as sim:
        run = Run(sim.base_url, tmp_path / "run", agents=6)
        first = RunMirror()  # a console there from the start: every token delta came to it
        run.engine.subscribe(first)
        async with run:
            for i in range(6):
                run.engine.emit(ev.RunNotice(time.monotonic(), f"something happened ({i})", "warning", "Test"))
            await until(lambda: sum(a.status == "completed" for a in first.agents.values()) >= 1, "an agent done")
            run.engine.handle(cmd.Pause())  # nothing more admitted: the run's figures stand still once these end
            await until(lambda: not any(a.status in ev.ACTIVE for a in first.agents.values()), "the running ones")
            assert first.tokens_total >= 60

            said: list[tuple[str, str]] = []
            handle = attached_handle(run.run_dir, lambda message, severity: said.append((message, severity)))
            app = CerevisorApp(handle.control, handle.mirror, validate({}), run=handle.run, attached=True,
                               themes=load_themes(None))
            notified: list[tuple[str, str]] = []
            notify = app.notify

            def recorded(message: str, **kwargs) -> None:
                notified.append((kwargs.get("title", ""), message))
                notify(message, **kwargs)

            app.notify = recorded  # type: ignore[method-assign]
            async with app.run_test(size=(80, 24)) as pilot:
                late = handle.mirror
                await until(lambda: late.run_id and not late.replaying, "the replay to end")
                # the run's count, though the journal replayed no token delta and nothing streams now (waited for: a
                # delta the run told as the console came is read just after the replay ends)
                await until(lambda: late.tokens_total == first.tokens_total,
                            lambda: f"the late console's {late.tokens_total} against {first.tokens_total}")
                pane = app.screen.query_one(LoadPane)
                await until(lambda: f"total {fmt_count(first.tokens_total)}" in str(
                    pane.query_one("#throughput-label").content), lambda: str(pane.query_one("#throughput-label").content))
                await pilot.pause()
                app.screen.refresh_status()
                past = [(title, message) for title, message in notified if title != "Detached"]
                assert len(past) == 1, past  # one line for the run's past, not a toast per notice
                title, message = past[0]
                assert title == "Before this console" and message.startswith("6 earlier notices of this run "
                                                                              "(6 warnings)"), message
                assert message.endswith("the newest: Test: something happened (5)")
                assert str(run.run_dir) in message  # where they all are
                run.engine.emit(ev.RunNotice(time.monotonic(), "now", "information", "Live"))
                await until(lambda: ("Live", "now") in notified, lambda: str(notified))  # news is still news
                app.exit()
            assert not said, said
