"""The console's mirror of a run, from its events alone: against the real engine on the built-in simulator it
ends with the engine's own figures, fed live or from a finished run's events.jsonl (what a read-only console
over a finished run uses), and its stall clock keeps the engine's deadline; commands go through `Engine.handle`."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.control import LocalControl
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.sinks.journal import Journal, read_events
from cerevisor_tui.ui.mirror import RunMirror
from tests.ui.conftest import EventLog, kind, sim_config

FIXTURES = Path(__file__).parent.parent / "fixtures"

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
            answers: list[cmd.Answer] = []
            control.send(cmd.Kill(agent="never"), answers.append)
            assert answers == [cmd.Answer(True)]
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
    assert sim.model == engine.connections.models["sim"] and sim.base_url == engine.connections.base_urls["sim"] and sim.kind == "simulated"
    assert sim.stall == engine.policies["sim"]
    assert sim.warn_at == engine.policies["sim"].warn_at
    now = engine.load_teller.event("sim")  # the load as the engine judges it at the end, the last it sent
    assert sim.load is not None and msgspec.structs.replace(sim.load, t=now.t) == now and sim.load.cap == 1
    assert live.effective_cap == engine.scheduler.effective_cap and not live.paused

    # read-only: a fresh mirror fed only from events.jsonl (no token deltas there) tells every agent's end
    events, unreadable = read_events(tmp_path / "run")
    assert unreadable == 0 and not any(e.kind == "TokenDelta" for e in events)
    replayed = RunMirror()
    for event in events:
        replayed(event)
    assert figures(replayed) == engine_figures(engine)
    for name, st in engine.agents.items():  # the tokens are the server's count of each turn's answer
        assert replayed.agents[name].tokens == st.completion_tokens
    assert replayed.finished is not None and replayed.finished.exit_code == 1
    assert replayed.endpoints["sim"].model == engine.connections.models["sim"]
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

        answers: list[cmd.Answer] = []
        control.send(cmd.Extend(agent="a", seconds=30.0), answers.append)
        assert answers == [cmd.Answer(True)]
        assert a.status == st.status == "streaming"
        assert a.attempt.deadline_at == pytest.approx(st.current.deadline_at) == pytest.approx(
            warning.deadline_at + 30.0)

        control.send(cmd.Kill(agent="a"), answers.append)
        assert answers[-1] == cmd.Answer(True)
        await log.wait(kind("RunFinished"))
        group.cancel_scope.cancel()
    assert mirror.agents["a"].status == "killed" and mirror.agents["a"].error == "killed by operator"
    assert mirror.agents["a"].attempt is None and mirror.agents["a"].tokens == 3


def test_a_command_is_checked_before_the_run_carries_it_out(tmp_path):
    """From the socket (a JSON object) or built in the console (a Struct), a command is checked against the same
    bounds before the engine carries it out, and a refusal is one line."""
    engine = Engine(workflow(tmp_path))
    objects = [
        ({"name": "launch"}, "Invalid value 'launch' - at `name`"),
        ({"name": "set_mode"}, "missing required field `mode`"),
        ({"name": "set_mode", "mode": "turbo"}, "at `mode`"),
        ({"name": "set_concurrency", "cap": "4"}, "Expected `int`, got `str` - at `cap`"),
        ({"name": "set_concurrency", "cap": True}, "Expected `int`, got `bool` - at `cap`"),
        ({"name": "set_concurrency", "cap": 10**40}, "at `cap`"),
        ({"name": "nudge_cap", "delta": 1, "by": 2}, "unknown field `by`"),
        ({"name": "extend", "agent": "steady", "seconds": -100000.0}, "Expected `float` > 0.0 - at `seconds`"),
        ({"name": "set_stall", "endpoint": "sim", "policy": {"idle_timeout_s": 5}},
         "missing required field `first_byte_timeout_s` - at `policy`"),
        ({"name": "set_stall", "endpoint": "sim", "policy": msgspec.to_builtins(engine.policies["sim"]) | {"spin": 1}},
         "unknown field `spin` - at `policy`"),
    ]
    for data, message in objects:
        with pytest.raises(cmd.CommandError) as caught:
            engine.handle(cmd.command_of(data))
        assert message in str(caught.value) and "\n" not in str(caught.value)
    replace, policy = msgspec.structs.replace, engine.policies["sim"]
    refused = [
        (cmd.SetConcurrency(cap=0), "Expected `int` >= 1 - at `cap`"),
        (cmd.Extend(agent="steady", seconds=float("inf")), "at `seconds`"),
        (cmd.Extend(agent="steady", seconds=float("nan")), "at `seconds`"),
        (cmd.Kill(agent="nobody"), "no agent named 'nobody'"),
        (cmd.SetStall(endpoint="sim", policy=replace(policy, idle_timeout_s=float("nan"))),
         "Expected `float` > 0.0 - at `policy.idle_timeout_s`"),
        (cmd.SetStall(endpoint="sim", policy=replace(policy, first_byte_timeout_s=float("inf"))),
         "at `policy.first_byte_timeout_s`"),
        (cmd.SetStall(endpoint="sim", policy=replace(policy, extend_s=-5.0)),
         "Expected `float` > 0.0 - at `policy.extend_s`"),
        (cmd.SetStall(endpoint="sim", policy=replace(policy, warn_at=(1.5,))), "Expected `float` < 1.0"),
        (cmd.Probe(endpoint="elsewhere"), "no endpoint named 'elsewhere'"),
    ]
    for command, message in refused:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
            engine.handle(command)
    assert engine.handle(cmd.SetConcurrency(cap=5)) == 5 and engine.scheduler.max_concurrency == 5
    assert engine.handle(cmd.NudgeCap(delta=-1)) == 4
    assert engine.handle(cmd.CycleMode()) == "parallel"
    assert engine.handle(cmd.Extend(agent="steady")) is False  # nothing runs yet
    policy = replace(policy, idle_timeout_s=5.0)
    seen: list[ev.Event] = []
    engine.subscribe(seen.append)
    assert engine.handle(cmd.SetStall(endpoint="sim", policy=policy)) is True
    assert engine.policies["sim"].idle_timeout_s == 5.0
    assert [(e.kind, e.endpoint, e.policy.idle_timeout_s) for e in seen if e.kind == "StallPolicyChanged"] == [
        ("StallPolicyChanged", "sim", 5.0)]
    assert engine.handle(cmd.SetStall(endpoint="sim", policy=policy)) is False  # the same: no event


def test_every_command_has_a_case_in_the_engine(tmp_path):
    """A command class without its case in `Engine.handle` would be refused at run time: each one is taken."""
    engine = Engine(workflow(tmp_path))
    samples = {cmd.SetMode: cmd.SetMode(mode="auto"), cmd.SetConcurrency: cmd.SetConcurrency(cap=2),
               cmd.NudgeCap: cmd.NudgeCap(delta=1), cmd.Kill: cmd.Kill(agent="steady"),
               cmd.Extend: cmd.Extend(agent="steady"), cmd.Retry: cmd.Retry(agent="steady"),
               cmd.Approve: cmd.Approve(agent="steady", call_id="c"), cmd.Deny: cmd.Deny(agent="steady", call_id="c"),
               cmd.SetStall: cmd.SetStall(endpoint="sim", policy=engine.policies["sim"]),
               cmd.Probe: None, cmd.CancelProbe: cmd.CancelProbe(endpoint="sim"), cmd.Release: cmd.Release(agent="steady"),
               cmd.SetGateway: cmd.SetGateway(release_after_s=1, max_sessions_per_key=2, keepalive_s=1,
                                              down_after_s=1)}  # refused with "serves no gateway": a case, taken
    for cls in cmd.COMMAND_TYPES:
        command = samples[cls] if cls in samples else cls()
        if command is None:
            continue  # a probe starts a task of the run's: covered by the probe tests
        try:
            engine.handle(command)
        except ValueError as exc:  # a tool call that is not waiting: refused by the tool layer, not unhandled
            assert "does not take" not in str(exc), cls
    assert engine.life.stopping  # Stop was taken


def test_a_journal_of_an_older_version_still_loads_and_what_this_version_does_not_know_is_skipped():
    """A field a record lacks takes its default (an older journal); a kind or a field this version does not know
    is not guessed at: the record is skipped and counted, never read in part."""
    mirror = RunMirror()
    skipped = mirror.feed_records([
        # RunStarted as it was written before it named each agent's endpoint and turns
        {"event": "RunStarted", "t": 1.0, "run_id": "r", "mode": "parallel", "max_concurrency": 2,
         "waves": [["a"], ["b"]], "endpoints": [{"name": "box", "kind": "local", "base_url": "http://box/v1"}]},
        {"event": "AgentStarted", "t": 2.0, "agent": "a", "attempt": 1, "turn": 1, "turns": 2, "endpoint": "box",
         "first_byte_deadline_s": 60.0, "idle_deadline_s": 30.0},
        {"event": "AgentStarted", "t": 2.5, "agent": "b", "attempt": 1, "turn": 1, "turns": 1, "endpoint": "box",
         "first_byte_deadline_s": 60.0, "idle_deadline_s": 30.0, "a_field_of_a_later_version": 1},
        {"event": "SomethingNew", "t": 3.0},
        {"event": "AgentFinished", "t": 4.0, "agent": "a", "status": "failed", "error": "HTTP 500"},
        {"event": "AgentFinished", "t": 4.0, "agent": "b", "status": "exploded"},
    ])
    assert skipped == 3
    assert list(mirror.agents) == ["a", "b"] and mirror.effective_cap == 2
    a = mirror.agents["a"]
    assert (a.status, a.turn, a.turns, a.endpoint, a.error, a.attempts) == ("failed", 1, 2, "box", "HTTP 500", 1)
    assert mirror.agents["b"].status == "pending" and mirror.agents["b"].wave == 1


def test_a_journal_written_by_the_dataclass_events_of_2026_12_reads_whole():
    """tests/fixtures/journals/events.jsonl (2026-12-01) was written by the last version whose events were
    dataclasses (a tool call, a stall kill and its retry, dependencies, then a --resume that reran an agent):
    every line reads as an event of this version, and the mirror ends where that run ended."""
    events, unreadable = read_events(FIXTURES / "journals")
    assert unreadable == 0 and len(events) == 111
    mirror = RunMirror()
    for event in events:
        mirror(event)
    assert not mirror.events_not_taken
    assert {name: a.status for name, a in mirror.agents.items()} == {"a0": "completed", "a1": "completed",
                                                                     "stuck": "completed"}
    assert mirror.finished is not None and mirror.finished.exit_code == 0  # the resumed run, which ran stuck again
    assert mirror.agents["stuck"].attempts == 1 and mirror.agents["a1"].turn == 2
