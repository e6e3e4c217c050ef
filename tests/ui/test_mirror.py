"""The console's mirror of a run, from its events alone: against the real engine on the built-in simulator it
ends with the engine's own figures, fed live or from a finished run's events.jsonl (what a read-only console
over a finished run uses), and its stall clock keeps the engine's deadline; commands go through `apply`."""

from __future__ import annotations

import dataclasses
import inspect

import anyio
import pytest

from cerevisor_tui.engine import events as ev
from cerevisor_tui.engine.control import COMMANDS, LocalControl, apply
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.journal import Journal, read_records
from cerevisor_tui.ui.control import RunControl
from cerevisor_tui.ui.mirror import RunMirror
from tests.ui.conftest import EventLog, kind, sim_config

AGENTS = [
    # the simulator answers the first request with HTTP 500: flaky's first attempt fails, its retry completes
    {"name": "flaky", "prompt": "hi", "max_tokens": 12, "retries": 1},
    {"name": "steady", "prompt": "hi", "turns": ["and then?"], "max_tokens": 12},
    {"name": "doomed", "prompt": "hi", "max_tokens": 12, "depends_on": ["never"], "retries": 0},
    {"name": "never", "prompt": "hi", "max_tokens": 12, "retries": 0},
    {"name": "after", "prompt": "go on from {{ flaky.output }}", "max_tokens": 12, "depends_on": ["flaky"]},
]


def workflow(tmp_path):
    # sequential: flaky's first request is the simulator's first; "never" is killed by the operator while queued
    return sim_config(tmp_path, agents=AGENTS, sim={"tokens_per_s": 400.0, "fail_first": 1},
                      run={"mode": "sequential"})


async def run_with_mirror(tmp_path) -> tuple[Engine, RunMirror, int]:
    """A whole run with a live mirror and a journal in tmp_path/run; "never" is killed before it starts."""
    engine = Engine(workflow(tmp_path), run_dir=str(tmp_path / "run"))
    mirror = RunMirror()
    engine.subscribe(mirror)
    journal = Journal(tmp_path / "run", engine.report)
    journal.open()
    engine.subscribe(journal)
    log = EventLog(engine)
    control = LocalControl(engine)
    code = 0
    try:
        async with anyio.create_task_group() as group:
            async def run() -> None:
                nonlocal code
                code = await engine.run()

            group.start_soon(run)
            await log.wait(kind("AgentQueued", "never"))
            assert control.kill("never") is True
            await log.wait(kind("RunFinished"), timeout=30)
    finally:
        journal.close()
    return engine, mirror, code


def figures(mirror: RunMirror) -> dict[str, tuple]:
    return {name: (a.status, a.turn, a.turns, a.attempts, a.completion_tokens, a.error)
            for name, a in mirror.agents.items()}


def engine_figures(engine: Engine) -> dict[str, tuple]:
    return {name: (st.status, st.turn, st.turns, st.attempts, st.completion_tokens, st.error)
            for name, st in engine.agents.items()}


@pytest.mark.anyio
async def test_a_mirror_fed_a_runs_events_ends_with_the_engines_own_state_and_a_finished_runs_journal_too(
        tmp_path):
    engine, live, code = await run_with_mirror(tmp_path)
    statuses = {name: st.status for name, st in engine.agents.items()}
    assert statuses == {"flaky": "completed", "steady": "completed", "doomed": "skipped", "never": "killed",
                        "after": "completed"}
    assert engine.agents["flaky"].attempts == 2  # the failed request, then its retry

    # live: every figure the agents pane shows is the engine's
    assert figures(live) == engine_figures(engine)
    for name, st in engine.agents.items():
        a = live.agents[name]
        assert (a.tokens, a.ttft_s, a.wave, a.endpoint) == (st.tokens, st.ttft_s, st.wave, st.endpoint)
        assert a.output_tokens_per_s == pytest.approx(st.output_tokens_per_s) if st.decode_s else a.decode_s == 0
        assert a.attempt is None
    assert live.finished is not None and live.finished.exit_code == code == 1
    assert (live.run_id, live.run_dir, live.mode, live.wave) == (engine.run_id, engine.run_dir, "sequential", 1)
    assert live.waves == [[a.name for a in level] for level in engine.waves]
    sim = live.endpoints["sim"]
    # the model the run resolved from /v1/models after it started, and the simulator's URL
    assert sim.model == engine.models["sim"] and sim.base_url == engine.base_urls["sim"] and sim.kind == "simulated"
    assert sim.stall == engine.policies["sim"].model_dump() and sim.warn_at == engine.policies["sim"].warn_at
    now = engine.load_event("sim")  # the load as the engine judges it at the end, the last it sent
    assert sim.load is not None and dataclasses.replace(sim.load, t=now.t) == now and sim.load.cap == 1
    assert live.effective_cap == engine.scheduler.effective_cap and not live.paused

    # read-only: a fresh mirror fed only from events.jsonl (no token deltas there) tells every agent's end
    records, unreadable = read_records(tmp_path / "run")
    assert unreadable == 0 and not any(r["event"] == "TokenDelta" for r in records)
    replayed = RunMirror()
    assert replayed.feed_records(records) == 0
    assert figures(replayed) == engine_figures(engine)
    for name, st in engine.agents.items():  # the tokens are the server's count of each turn's answer
        assert replayed.agents[name].tokens == st.completion_tokens
    assert replayed.finished is not None and replayed.finished.exit_code == 1
    assert replayed.endpoints["sim"].model == engine.models["sim"]
    assert replayed.notes["never"] == "killed by operator" and replayed.notes["doomed"] == "dependency never killed"


@pytest.mark.anyio
async def test_the_mirrors_stall_clock_keeps_the_engines_deadline_through_warnings_an_extension_and_a_kill(
        tmp_path):
    # the simulator stops sending tokens after 3: the 4 s idle deadline counts down (warnings at 1 s and 3.6 s)
    config = sim_config(tmp_path, agents=[{"name": "a", "prompt": "hi", "max_tokens": 50, "retries": 0}],
                        sim={"stall_after_tokens": 3},
                        stall={"idle_timeout_s": 4.0, "first_byte_timeout_s": 20.0, "warn_at": [0.25, 0.9],
                               "extend_s": 30.0, "extend_when_server_busy": False})
    engine = Engine(config)
    mirror = RunMirror()
    engine.subscribe(mirror)
    log = EventLog(engine)
    control = LocalControl(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        started = await log.wait(kind("AgentStarted", "a"))
        att = mirror.agents["a"].attempt
        assert att is not None and att.phase == "first_byte"
        assert att.deadline_at == pytest.approx(started.t + 20.0)  # the first-byte deadline, absolute

        warning = await log.wait(kind("StallWarning", "a"))
        a, st = mirror.agents["a"], engine.agents["a"]
        assert a.status == st.status == "stalling" and a.attempt.phase == st.current.phase == "idle"
        assert a.attempt.deadline_at == pytest.approx(warning.deadline_at) == pytest.approx(st.current.deadline_at)
        assert a.attempt.tokens == st.current.tokens == 3

        assert apply(control, "extend", {"agent": "a", "seconds": 30.0}) is True
        assert a.status == st.status == "streaming"
        assert a.attempt.deadline_at == pytest.approx(st.current.deadline_at) == pytest.approx(
            warning.deadline_at + 30.0)

        assert apply(control, "kill", {"agent": "a"}) is True
        await log.wait(kind("RunFinished"))
        group.cancel_scope.cancel()
    assert mirror.agents["a"].status == "killed" and mirror.agents["a"].error == "killed by operator"
    assert mirror.agents["a"].attempt is None and mirror.agents["a"].tokens == 3


def test_apply_checks_the_command_and_its_arguments_before_calling_it(tmp_path):
    engine = Engine(workflow(tmp_path))
    control = LocalControl(engine)
    cases = [
        ("launch", {}, "unknown command 'launch'"),
        ("set_mode", {}, "set_mode: missing argument mode"),
        ("set_mode", {"mode": "turbo"}, "unknown mode 'turbo'"),
        ("set_concurrency", {"cap": "4"}, "set_concurrency: cap must be int, not '4'"),
        ("set_concurrency", {"cap": True}, "set_concurrency: cap must be int"),
        ("nudge_cap", {"delta": 1, "by": 2}, "nudge_cap: unknown argument by (takes: delta)"),
        ("kill", {"agent": "nobody"}, "no agent named 'nobody'"),
        ("extend", {"agent": "steady", "seconds": float("inf")}, "must be a finite number"),
        ("set_stall", {"endpoint": "sim", "policy": {"idle_timeout_s": 5}}, "set_stall: first_byte_timeout_s"),
        ("probe", {"endpoint": "elsewhere"}, "no endpoint named 'elsewhere'"),
    ]
    for name, args, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            apply(control, name, args)
    assert apply(control, "set_concurrency", {"cap": 5}) == 5 and engine.scheduler.max_concurrency == 5
    assert apply(control, "nudge_cap", {"delta": -1}) == 4
    assert apply(control, "cycle_mode", {}) == "parallel"
    assert apply(control, "extend", {"agent": "steady", "seconds": None}) is False  # nothing runs yet
    policy = engine.policies["sim"].model_dump(mode="json") | {"idle_timeout_s": 5.0}
    seen: list[ev.Event] = []
    engine.subscribe(seen.append)
    assert apply(control, "set_stall", {"endpoint": "sim", "policy": policy}) is True
    assert engine.policies["sim"].idle_timeout_s == 5.0
    assert [(e.kind, e.endpoint, e.policy["idle_timeout_s"]) for e in seen if e.kind == "StallPolicyChanged"] == [
        ("StallPolicyChanged", "sim", 5.0)]
    assert apply(control, "set_stall", {"endpoint": "sim", "policy": policy}) is False  # the same: no event


def test_every_command_the_console_may_send_is_one_the_run_takes_by_the_same_name_and_arguments():
    wanted = {name for name, _ in inspect.getmembers(RunControl, inspect.isfunction) if not name.startswith("_")}
    assert wanted == set(COMMANDS)
    for name in COMMANDS:
        ours = inspect.signature(getattr(RunControl, name)).parameters
        theirs = inspect.signature(getattr(LocalControl, name)).parameters
        assert list(ours) == list(theirs), name


def test_a_journal_of_an_older_version_still_loads_and_unknown_records_are_skipped():
    mirror = RunMirror()
    skipped = mirror.feed_records([
        # RunStarted as it was written before it named each agent's endpoint and turns
        {"event": "RunStarted", "t": 1.0, "run_id": "r", "mode": "parallel", "max_concurrency": 2,
         "waves": [["a"], ["b"]], "endpoints": [{"name": "box", "kind": "local", "base_url": "http://box/v1"}]},
        {"event": "AgentStarted", "t": 2.0, "agent": "a", "attempt": 1, "turn": 1, "turns": 2, "endpoint": "box",
         "first_byte_deadline_s": 60.0, "idle_deadline_s": 30.0, "a_field_of_a_later_version": 1},
        {"event": "SomethingNew", "t": 3.0},
        {"event": "AgentFinished", "t": 4.0, "agent": "a", "status": "failed", "error": "HTTP 500"},
    ])
    assert skipped == 1
    assert list(mirror.agents) == ["a", "b"] and mirror.effective_cap == 2
    a = mirror.agents["a"]
    assert (a.status, a.turn, a.turns, a.endpoint, a.error, a.attempts) == ("failed", 1, 2, "box", "HTTP 500", 1)
    assert mirror.agents["b"].status == "pending" and mirror.agents["b"].wave == 1
