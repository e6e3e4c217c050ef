"""Turn-level resume compares what an agent ran with: an agent that had not completed keeps the turns it had
answered only while its system prompt, model and sampling settings are what they were (each turn's user message
records them); otherwise it runs again from turn 1, and the run says why."""

from __future__ import annotations

import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.engine.resume import read_journal
from cerevisor_tui.engine.sinks.journal import Journal
from cerevisor_tui.sim import SimServer

FAST = SimSettings(tokens_per_s=2000, ttft_s=0.0)


def config(url: str, **agent):
    return validate({
        "run": {"warmup": "off"},
        "endpoints": [{"name": "e", "base_url": url, "kind": "local"}],
        "agents": [{"name": "long", "prompt": "first", "turns": ["second", "third"], "max_tokens": 4,
                    "system": "You are terse.", "temperature": 0.2, **agent}]})


async def run(engine: Engine, run_dir, *, stop_after_turn: int = 0) -> list[ev.Event]:
    journal = Journal(run_dir, engine.report)
    journal.open(resume=True)
    engine.subscribe(journal)
    seen: list[ev.Event] = []

    def watch(event: ev.Event) -> None:
        seen.append(event)
        if isinstance(event, ev.MessageRecorded) and event.role == "assistant" and event.turn == stop_after_turn:
            engine.handle(cmd.Stop(reason="stopped by the test"))

    engine.subscribe(watch)
    await engine.run()
    journal.close()
    return seen


@pytest.mark.anyio
@pytest.mark.parametrize("change,why", [
    ({}, ""),
    ({"system": "You are verbose."}, "system changed"),
    ({"temperature": 0.9}, "temperature 0.2 -> 0.9"),
    ({"max_tokens": 5}, "max_tokens 4 -> 5"),
    ({"model": "served"}, "model (the first listed) -> {served}"),  # named now: the one it had resolved
])
async def test_a_resumed_agent_reuses_its_answered_turns_only_under_the_same_settings(tmp_path, change, why):
    run_dir = tmp_path / "run"
    async with SimServer(FAST) as srv:
        first = Engine(config(srv.base_url), run_id="r1", run_dir=str(run_dir))
        await run(first, run_dir, stop_after_turn=2)
        state = read_journal(run_dir)
        assert [t.user for t in state.turns["long"]] == ["first", "second"]
        assert state.turns["long"][0].inputs["system"]  # each turn says what it was answered under

        cfg = config(srv.base_url)
        if "model" in change:  # an endpoint's setting
            served = first.connections.models["e"]
            cfg = cfg.model_copy(update={"endpoints": [cfg.endpoints[0].model_copy(update={"model": served})]})
            why = why.format(served=served)
        elif change:
            cfg = config(srv.base_url, **change)
        second = Engine(cfg, run_id="r1", run_dir=str(run_dir), resumed=state)
        seen = await run(second, run_dir)
    assert second.agents["long"].status == "completed"
    sent = [e.turn for e in seen if isinstance(e, ev.AgentStarted)]
    notices = [e.message for e in seen if isinstance(e, ev.RunNotice) and e.message.startswith("long:")]
    if not why:
        assert sent == [3]
        assert notices == ["long: turns 1-2 answered before, taken from the journal; it goes on at turn 3"]
    else:
        assert sent == [1, 2, 3]  # nothing answered under other settings is reused
        assert notices == [f"long: turns 1-2 answered before not reused ({why}); it runs again from turn 1"]
