"""A row's status tells what its agent waits on: its prefill as the server says it (`prefill 63% · 40 s`, the
time left counting down), an estimate (`prefill ~40% (est.)`), or its place in our queue (`queued #3`); the
stall column counts down to the deadline the prefill's projection set. From events alone, and in the console
against the engine on the built-in simulator."""

from __future__ import annotations

import re

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.widgets.agent_table import agent_row
from tests.ui.conftest import EventLog, console, kind

WARN_AT = (0.5, 0.8, 0.95)


def mirror_of(*events: ev.Event) -> RunMirror:
    m = RunMirror()
    m(ev.RunStarted(0.0, "r1", "parallel", 4, [["a", "b", "c"]], [ev.EndpointSummary("box", "local")],
                    agents={n: ev.AgentPlan("box", 0) for n in "abc"}))
    for e in events:
        m(e)
    return m


def test_a_prefill_reads_as_its_progress_and_the_time_left_counts_down():
    m = mirror_of(ev.AgentStarted(100.0, "a", 1, 1, 1, "box", 8.0, 600.0), ev.AgentStatus(100.0, "a", "prefill"),
                  ev.PrefillProgress(104.0, "a", 1, 10_000, 0, 6_300, 1_230.0, 40.0))
    a = m.agents["a"]
    assert agent_row(a, WARN_AT, "", 104.0).status == "prefill 63% · 40 s"
    assert agent_row(a, WARN_AT, "", 114.0).status == "prefill 63% · 30 s"
    assert agent_row(a, WARN_AT, "", 200.0).status == "prefill 63% · 0 s"  # never below nothing left
    # the watchdog moved the first-byte deadline to the projection: the stall column counts down to it
    m(ev.StallExtended(108.0, "a", 1, "first_byte", 47.0, "prefill 63%, 1,230 tok/s, about 36 s left", 155.0, 0))
    assert agent_row(a, WARN_AT, "", 115.0).stall == "first 0:40"
    # a long one reads in minutes; before a rate, the share alone
    m(ev.PrefillProgress(116.0, "a", 1, 10_000, 0, 6_400, 20.0, 180.0))
    assert agent_row(a, WARN_AT, "", 116.0).status == "prefill 64% · 3:00"
    m(ev.PrefillProgress(117.0, "a", 1, 10_000, 0, 6_500))
    assert agent_row(a, WARN_AT, "", 117.0).status == "prefill 65%"
    # the first token: streaming, its prefill no more
    m(ev.FirstToken(118.0, "a", 1, 1, 18.0))
    m(ev.AgentStatus(118.0, "a", "streaming"))
    assert agent_row(a, WARN_AT, "", 118.0).status == "streaming"


def test_an_estimated_prefill_says_so():
    m = mirror_of(ev.AgentStarted(100.0, "a", 1, 1, 1, "box", 8.0, 600.0), ev.AgentStatus(100.0, "a", "prefill"),
                  ev.PrefillProgress(104.0, "a", 1, 10_000, 3_000, 3_000, 1_000.0, 7.0, estimated=True))
    a = m.agents["a"]
    assert agent_row(a, WARN_AT, "", 105.0).status == "prefill ~40% (est.)"  # at the measured rate since
    assert agent_row(a, WARN_AT, "", 500.0).status == "prefill ~99% (est.)"  # never done by the estimate alone


def test_queued_agents_read_as_their_place_in_the_queue():
    m = mirror_of(*(e for i, n in enumerate("abc") for e in (ev.AgentQueued(1.0 + i, n, 0),
                                                            ev.AgentStatus(1.0 + i, n, "queued"))))
    positions = m.queue_positions()
    assert [agent_row(m.agents[n], WARN_AT, "", 5.0, queue_position=positions.get(n)).status for n in "abc"] == \
        ["queued #1", "queued #2", "queued #3"]
    m(ev.AgentStarted(6.0, "a", 1, 1, 1, "box", 8.0, 600.0))
    m(ev.AgentStatus(6.0, "a", "prefill"))
    assert m.queue_positions() == {"b": 1, "c": 2}


@pytest.mark.anyio
@pytest.mark.end_to_end  # a simulated prefill of 5.6 s on the wall clock, its row read while it runs
async def test_the_console_shows_the_prefill_of_a_long_prompt(tmp_path):
    config = validate({
        "run": {"mode": "parallel", "max_concurrency": 1, "run_dir": str(tmp_path / "runs"), "metrics_interval_s": 0.2},
        "stall": {"first_byte_timeout_s": 0.5, "idle_timeout_s": 30.0},
        "endpoints": [{"name": "sim", "kind": "simulated", "prompt_progress": "on",
                       "sim": {"tokens_per_s": 200.0, "ttft_s": 0.0, "prefill_tokens_per_s": 1250.0,
                               "max_num_batched_tokens": 256}}],
        "agents": [{"name": "a", "prompt": " ".join(f"w{i:05d}" for i in range(4000)), "max_tokens": 5}],
    })
    app = console(config)
    log = EventLog(app.control.engine)  # type: ignore[attr-defined]
    async with app.run_test():
        # 7,000 prompt tokens at 1,250 tok/s: 5.6 s of prefill, its row looked at with 1.7 s of it still to go (at
        # 2,500 tok/s, a loaded host's first progress with a rate once came past half of it)
        await log.wait(lambda e: e.kind == "PrefillProgress" and e.rate_tok_s is not None
                       and e.processed < 0.7 * e.total)
        app.screen.refresh_status()
        texts = app.screen.table.row_texts("a")
        # the time left at the rate read so far: seconds, or minutes where a loaded host read a slow start
        assert re.fullmatch(r"prefill \d+% · (\d+ s|\d+:\d\d)", texts[2]), texts
        await log.wait(kind("StallExtended", "a"))
        app.screen.refresh_status()
        assert app.screen.table.row_texts("a")[7].startswith("first ")
        finished = await log.wait(kind("AgentFinished", "a"))
    assert finished.status == "completed"


def test_an_agent_whose_local_server_refuses_its_port_reads_loading_and_streams_after():
    m = mirror_of(ev.AgentStarted(100.0, "a", 1, 1, 1, "box", 8.0, 600.0), ev.AgentStatus(100.0, "a", "prefill"),
                  ev.EndpointWaiting(100.5, "a", 1, "box", "cannot connect: connection refused", 0.5),
                  ev.AgentStatus(100.5, "a", "waiting"))
    assert agent_row(m.agents["a"], WARN_AT, "", 101.0).status == "loading"
    m(ev.FirstToken(130.0, "a", 1, 1, 30.0))
    m(ev.AgentStatus(130.0, "a", "streaming"))
    assert agent_row(m.agents["a"], WARN_AT, "", 130.0).status == "streaming"
