"""What the headless log says: attempts numbered within a turn (the word only on a retry), a wave's end as
counts, and a first-byte kill naming the silence it measured and the deadline."""

from __future__ import annotations

import asyncio
import json
import re

import anyio
import pytest

from cerevisor_tui.config import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.sim import start_in_thread
from tests.conftest import RawServer, http_head
from tests.test_reliability import start_run, workflow
from tests.test_stall import engine_for, recorder


def test_attempts_count_within_a_turn_and_show_only_on_a_retry(tmp_path):
    with start_in_thread(SimSettings(tokens_per_s=400, ttft_s=0.01, fail_first=1)) as sim:
        cfg = workflow(tmp_path / "w.toml", sim.base_url, agents=2, max_tokens=5, deps=False)
        proc = start_run(str(cfg), "--run-dir", str(tmp_path / "run"))
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    retried = re.search(r"(a\d): retrying as attempt 2 in ", out).group(1)
    other = "a1" if retried == "a0" else "a0"
    assert f"{retried}: turn 1/2, attempt 2 sent to box" in out
    for name in (retried, other):
        assert f"{name}: turn 2/2 sent to box" in out
    assert f"{other}: turn 1/2 sent to box" in out
    assert len(re.findall(r"\battempt \d", out)) == 2, out  # the retry's notice and its start: nothing else reads as one
    assert "wave 0 finished: 2 completed" in out
    report = {a["name"]: a for a in json.loads((tmp_path / "run" / "report.json").read_text())["agents"]}
    assert report[retried]["attempts"] == 3 and report[other]["attempts"] == 2  # every request sent
    transcript = [json.loads(line) for line in (tmp_path / "run" / "transcripts" / f"{retried}.jsonl").read_text().splitlines()]
    assert [(m["turn"], m["attempt"], m["role"]) for m in transcript] == [
        (1, 1, "user"), (1, 2, "assistant"), (2, 1, "user"), (2, 1, "assistant")]


def test_a_wide_wave_is_told_in_counts_not_names():
    names = [f"agent-{i:05d}" for i in range(10_000)]
    statuses = {name: ("completed" if i % 100 else "failed") for i, name in enumerate(names)}
    started = Printer.describe(ev.WaveStarted(0.0, 3, names))
    finished = Printer.describe(ev.WaveFinished(1.0, 3, statuses))
    assert finished == "wave 3 finished: 9900 completed, 100 failed"
    assert started == "wave 3 started: 10,000 agents (agent-00000, agent-00001, agent-00002, ...)"


@pytest.mark.anyio
async def test_a_first_byte_kill_after_a_long_busy_check_names_the_silence_and_the_deadline():
    async def silent(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        await writer.drain()
        await asyncio.sleep(10)

    async def slow_busy_check(endpoint: str, since: float) -> None:
        await anyio.sleep(1.0)  # a swamped server answering /metrics late: then not busy after all
        return None

    async with RawServer(silent) as srv:
        engine = engine_for(srv.base_url, False, first_byte_timeout_s=0.3)
        engine.watchdog.busy_check = slow_busy_check
        seen = recorder(engine)
        assert await engine.run() == 1
    killed = next(e for e in seen if e.kind == "AgentKilled")
    measured = re.fullmatch(r"no first token after ([\d.]+) s \(deadline 0\.3 s\)", killed.reason)
    assert measured and float(measured.group(1)) >= 1.3, killed.reason
