"""`replay run --as-agents`: a replay file's sessions as the run's own agents against the built-in simulator over
loopback HTTP: each turn after the answer and its gap, subagents after their parent's spawning answer, the run's
cap over the sessions, the server's prefix counters agreeing with the trace, the journal holding each prompt's
reference rather than its text, and the run attached to as any run."""

from __future__ import annotations

import json
import subprocess
import sys

import anyio
import pytest

from cerevisor_tui.commands.replay import as_agents
from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.replay.generate import generate
from cerevisor_tui.replay.run import ReplaySettings, Slo, prompt_text
from cerevisor_tui.replay.trace import TraceTurn, whole_prompts, write_trace
from cerevisor_tui.sim import SimServer

SPEED = 50.0


def turn(session: str, number: int, new: int, output: int, blocks: list[int], delay_ms: float = 0.0,
         parent: str | None = None) -> TraceTurn:
    return TraceTurn(session_id=session, turn=number, input_length=new, output_length=output, hash_ids=blocks,
                     delay_ms=delay_ms, parent=parent)


SPAWNING = [
    turn("p", 1, 1000, 20, [1, 2]),
    turn("p", 2, 100, 20, [1, 2, 3], delay_ms=400.0),
    turn("p/a", 1, 1200, 20, [1, 2, 3, 9], delay_ms=400.0, parent="p"),  # spawned by p's turn 2
    turn("p/a", 2, 50, 20, [1, 2, 3, 9], delay_ms=400.0),
    turn("p", 3, 100, 20, [1, 2, 3], delay_ms=400.0),
]


@pytest.mark.anyio
async def test_each_turn_goes_after_the_answer_and_its_gap_and_a_subagent_after_its_parents_spawning_answer(tmp_path):
    speed = 2.0
    async with SimServer(SimSettings(speed=SPEED)) as sim:
        report = await as_agents(SPAWNING, sim.base_url, ReplaySettings(speed=speed), "parallel", 2,
                                 run_dir=tmp_path / "run")
        bodies = [(request["messages"], request["max_tokens"]) for request in sim.state.requests]
    log = {(r.session_id, r.turn): r for r in report.turn_log}
    assert report.turns_completed == report.turns == 5 and report.sessions_completed == report.sessions == 1
    gap_s = 0.4 / speed
    for later, earlier in [(("p", 2), ("p", 1)), (("p", 3), ("p", 2)), (("p/a", 1), ("p", 2)),
                           (("p/a", 2), ("p/a", 1))]:
        assert log[later].sent_at >= log[earlier].ended_at + gap_s * 0.95, (later, earlier)
    assert log[("p/a", 1)].sent_at < log[("p", 3)].ended_at  # an agent of its own, beside its parent's next turn
    # each request is the turn's whole prompt alone, made of its blocks, with the turn's own output length
    wanted = sorted((prompt_text(t.hash_ids, whole, t.session_id), t.output_length) for t, whole in
                    whole_prompts(SPAWNING))
    assert sorted((messages[0]["content"], limit) for messages, limit in bodies) == wanted
    assert all(len(messages) == 1 for messages, _ in bodies)


@pytest.mark.anyio
async def test_the_runs_cap_admits_the_sessions_and_the_server_sees_the_traces_sharing(tmp_path):
    """Sequential: one session's agent at a time, each whole (it keeps its slot across its gaps), and the server's
    own prefix counters agree with what the trace shares between turns."""
    turns = generate("tiered-offload", sessions=3, seed=1)
    prompts = [whole for _, whole in whole_prompts(turns)]
    previous = [whole for t, whole in whole_prompts(turns) if t.turn < 8]
    async with SimServer(SimSettings(speed=SPEED)) as sim:
        report = await as_agents(turns, sim.base_url, ReplaySettings(speed=SPEED, clock=sim.state.engine.clock_s,
                                                                     slo=Slo(10.0, 30.0)),
                                 "sequential", 1, run_dir=tmp_path / "run")
    assert report.turns_completed == report.turns == 24 and not report.kills and report.concurrency == 1
    assert report.prefix_hit_rate == pytest.approx(sum(previous) / sum(prompts), abs=0.01)
    spans: dict[str, tuple[float, float]] = {}
    for r in report.turn_log:
        start, end = spans.get(r.session_id, (r.sent_at, r.ended_at))
        spans[r.session_id] = (min(start, r.sent_at), max(end, r.ended_at))
    ordered = sorted(spans.values())
    assert len(ordered) == 3
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:], strict=False))
    assert report.ttft["p50_s"] is not None and report.interactivity["p50_tokens_per_s"]
    assert report.goodput["turns"] == report.turns_completed  # one stream at a time on the simulator: ~40 tokens/s


@pytest.mark.anyio
async def test_the_journal_records_each_prompts_reference_not_its_text_and_the_report_is_the_runs(tmp_path):
    turns = [turn("big", 1, 20_000, 8, list(range(40))), turn("big", 2, 500, 8, list(range(41)), delay_ms=10.0)]
    run_dir = tmp_path / "run"
    async with SimServer(SimSettings(speed=SPEED)) as sim:
        report = await as_agents(turns, sim.base_url, ReplaySettings(speed=SPEED), "parallel", 4, run_dir=run_dir)
    assert report.turns_completed == 2
    journal = (run_dir / "events.jsonl").read_bytes()
    # two prompts of 80 KB and 82 KB of text: the journal names them by length and blocks
    assert len(journal) < 30_000
    users = [json.loads(line) for line in journal.splitlines() if b'"MessageRecorded"' in line]
    users = [e for e in users if e["role"] == "user"]
    assert [e["content"] for e in users] == [
        f"[replay big turn 1: a prompt of 20,000 tokens, blocks {json.dumps(list(range(40)), separators=(',', ':'))}]",
        f"[replay big turn 2: a prompt of 20,508 tokens, blocks {json.dumps(list(range(41)), separators=(',', ':'))}]"]
    run_report = json.loads((run_dir / "report.json").read_text())
    [agent] = run_report["agents"]
    assert agent["name"] == "big" and agent["status"] == "completed" and agent["turns"] == 2


@pytest.mark.anyio
async def test_a_subagent_whose_parent_fails_before_spawning_it_is_skipped_and_the_run_ends(tmp_path):
    """The parent's first prompt is past the simulator's context: it fails at turn 1, and its subagent, spawned by
    its turn 2, never runs (skipped, saying why) rather than waiting forever. A session id that cannot name an
    agent ("p/a" would name a file in a directory) runs under a name of its own."""
    turns = [turn("p", 1, 300_000, 8, []), turn("p", 2, 10, 8, []),
             turn("p/a", 1, 100, 8, [], parent="p"), turn("q", 1, 100, 8, [])]
    seen: list[ev.Event] = []
    async with SimServer(SimSettings(speed=SPEED)) as sim:
        with anyio.fail_after(60):
            report = await as_agents(turns, sim.base_url, ReplaySettings(speed=SPEED), "parallel", 4,
                                     run_dir=tmp_path / "run", on_run=lambda engine: engine.subscribe(seen.append))
    ends = {e.agent: (e.status, e.error) for e in seen if isinstance(e, ev.AgentFinished)}
    assert ends["q"] == ("completed", "")
    assert ends["p"][0] == "failed"
    assert ends["session-2"] == ("skipped", "its parent p failed before the turn that spawns it")
    assert report.turns_completed == 1 and report.turns_failed == 1 and report.first_error
    assert {r.session_id for r in report.turn_log} == {"p", "q"}


@pytest.mark.end_to_end  # the command in a process of its own, with its simulator
def test_the_command_runs_the_sessions_as_agents_and_prints_one_json_report(tmp_path):
    path = tmp_path / "agentx.jsonl"
    write_trace([t for t in generate("agentx", sessions=2, seed=3) if t.parent is None and t.turn <= 2], path)
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "cerevisor_tui", "replay", "run", str(path), "--sim", "agentx-slice",
                           "--speed", "200", "--as-agents", "--mode", "auto", "--concurrency", "2", "--run-dir",
                           str(run_dir), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    assert figures["turns_completed"] == figures["turns"] == 4 and figures["simulated"]
    assert figures["prefix_hit_rate"] > 0.5 and figures["caps"] and figures["kills"] == []
    assert f"cerevisor-tui attach {run_dir}" in done.stderr
    assert (run_dir / "report.json").is_file()


def test_mode_without_a_run_is_refused(tmp_path, capsys):
    from tests.conftest import cli_here

    path = tmp_path / "t.jsonl"
    write_trace(SPAWNING, path)
    done = cli_here(capsys, "replay", "run", str(path), "--mode", "auto")
    assert done.returncode == 2 and "--mode is the run's: add --as-agents" in done.stderr
    done = cli_here(capsys, "replay", "run", str(path), "--as-agents", "--release-after-s", "5")
    assert done.returncode == 2 and "--release-after-s is the gateway's: add --through-gateway" in done.stderr
    done = cli_here(capsys, "replay", "run", str(path), "--through-gateway", "--release-after-s", "-1")
    assert done.returncode == 2 and "--release-after-s must be between 0 and 86400" in done.stderr


@pytest.mark.anyio
async def test_a_console_attaches_to_the_replays_run_and_its_kill_ends_a_session_in_its_gap(tmp_path):
    """The run serves its control socket as any run does: an attached client sees the sessions as agents (their
    turns the file's), and a kill while a session waits out its gap ends it, and the subagent it had not spawned
    yet is skipped; the run ends then, without waiting out the gap."""
    from cerevisor_tui.contract.commands import Kill
    from cerevisor_tui.supervisor.client import ControlClient

    turns = [turn("p", 1, 200, 8, []), turn("p", 2, 10, 8, [], delay_ms=3_600_000.0),
             turn("c", 1, 100, 8, [], parent="p"), turn("q", 1, 100, 8, [])]
    run_dir = tmp_path / "run"
    opened = anyio.Event()
    seen: list[ev.Event] = []
    idle = anyio.Event()

    def on_event(event: ev.Event) -> None:
        seen.append(event)
        if isinstance(event, ev.AgentStatus) and event.agent == "p" and event.status == "idle":
            idle.set()

    async with SimServer(SimSettings(speed=SPEED)) as sim, anyio.create_task_group() as group:
        async def replaying() -> None:
            report = await as_agents(turns, sim.base_url, ReplaySettings(speed=1.0), "parallel", 4, run_dir=run_dir,
                                     on_run=lambda engine: opened.set())
            reports.append(report)

        reports: list = []
        group.start_soon(replaying)
        with anyio.fail_after(60):
            await opened.wait()
            client = await ControlClient.connect(run_dir)
            group.start_soon(client.run, on_event)
            await idle.wait()
            assert await client.command(Kill(agent="p", reason="enough")) is True
            await client.closed.wait()
        await client.close()
    [started] = [e for e in seen if isinstance(e, ev.RunStarted)]
    assert {name: plan.turns for name, plan in started.agents.items()} == {"p": 2, "c": 1, "q": 1}
    ends = {e.agent: (e.status, e.error) for e in seen if isinstance(e, ev.AgentFinished)}
    assert ends == {"p": ("killed", "enough"), "c": ("skipped", "its parent p killed before the turn that spawns it"),
                    "q": ("completed", "")}
    [report] = reports
    assert report.turns_completed == 2 and report.turns_failed == 0 and report.sessions_completed == 1


def test_autos_kv_projection_counts_a_replay_agent_at_its_traces_whole_length():
    """Auto projects the conversations' length to fit the KV cache: a replay agent's config holds a one-line prompt,
    so the projection takes its script's last prompt and answer (the trace's), not the config's text."""
    from cerevisor_tui.config.models import AgentConfig
    from cerevisor_tui.engine.attempt import TurnFigures
    from cerevisor_tui.engine.auto_feed import projected_context
    from cerevisor_tui.engine.clock import MONOTONIC
    from cerevisor_tui.engine.roster import Roster, RunLife
    from cerevisor_tui.engine.state import AgentState
    from cerevisor_tui.replay.agents import ReplaySessions
    from cerevisor_tui.replay.run import Plan

    sessions = ReplaySessions(Plan.of(SPAWNING), speed=1.0)
    roster = Roster(lambda event: None, MONOTONIC)
    for config in sessions.agent_configs():
        st = roster.add(AgentState(AgentConfig(**config), "e", 0))
        st.script = sessions.scripts[st.name]
    whole = {t.session_id: (w, t.output_length) for t, w in whole_prompts(SPAWNING)}  # each session's last turn
    expected = sum(prompt + answer for prompt, answer in whole.values()) / 2
    assert projected_context(roster, {"e": TurnFigures()}, RunLife(wave=0), "e") == expected


@pytest.mark.anyio
async def test_a_turn_the_run_retries_counts_once_answered_and_is_timed_from_its_first_request(tmp_path):
    """The server refuses the first request (503): the run retries it as any agent's, after its backoff; the report
    has the turn answered once, not failed, and its TTFT counts the wait from the first request."""
    from cerevisor_tui.engine.conversation import BACKOFF_BASE_S

    turns = [turn("r", 1, 300, 8, []), turn("r", 2, 10, 8, [], delay_ms=10.0)]
    seen: list[ev.Event] = []
    async with SimServer(SimSettings(speed=SPEED, fail_first=1, fail_status=503)) as sim:
        report = await as_agents(turns, sim.base_url, ReplaySettings(speed=SPEED), "parallel", 1,
                                 run_dir=tmp_path / "run", on_run=lambda engine: engine.subscribe(seen.append))
    assert [e.attempt for e in seen if isinstance(e, ev.AgentRetrying)] == [2]
    assert report.turns_completed == 2 and report.turns_failed == 0 and not report.first_error
    first = next(r for r in report.turn_log if r.turn == 1)
    assert first.first_at is not None and first.first_at - first.sent_at >= BACKOFF_BASE_S * 0.5
