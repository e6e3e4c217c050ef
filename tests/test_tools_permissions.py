"""Who may call what, and how long a call may take: a server's allow/ask/deny rules, the operator's approve
(once, for the run) and deny through the run's commands, the headless policies, the tool deadline with its
warnings, and the operator's kill and extend acting on a running call. Each waits on the run's own events."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.contract.commands import command_of
from tests.test_tools import kinds, run, workflow


def waiter(engine: Any, seen: list, predicate: Callable[[ev.Event], bool]) -> anyio.Event:
    """An anyio.Event set by the first event (already seen, or to come) that `predicate` holds for."""
    found = anyio.Event()
    if any(predicate(e) for e in seen):
        found.set()

    def look(event: ev.Event) -> None:
        if predicate(event):
            found.set()

    engine.subscribe(look)
    return found


def asking(**server: Any) -> dict[str, Any]:
    return {"allow": [], "ask": ["echo"], **server}


@pytest.mark.anyio
async def test_an_ask_call_waits_for_the_operator_who_approves_once_then_denies_the_next():
    answers = iter([("approve", {"scope": "once"}), ("deny", {})])
    statuses: list[str] = []

    async def operator(engine, seen):
        while True:
            requested = [e for e in seen if e.kind == "ApprovalRequested"]
            decided = len(kinds(seen, "ApprovalDecided"))
            if len(requested) > decided:
                e = requested[decided]
                statuses.append(engine.agents[e.agent].status)
                command, args = next(answers)
                engine.handle(command_of({"name": command, "agent": e.agent, "call_id": e.call_id, **args}))
                continue
            asked = len(requested)
            await waiter(engine, seen, lambda e: e.kind == "ApprovalRequested"
                         and len(kinds(seen, "ApprovalRequested")) > asked).wait()  # noqa: B023 - awaited here

    engine, seen, code = await run(workflow({"echo": {"text": "hi"}}, server=asking(), tool_steps=2),
                                   ask="operator", during=operator)
    assert code == 0
    assert statuses == ["approval", "approval"]
    requested = kinds(seen, "ApprovalRequested")
    assert [(e.server, e.tool, json.loads(e.arguments)) for e in requested] == [("fake", "echo", {"text": "hi"})] * 2
    assert [(e.decision, e.by) for e in kinds(seen, "ApprovalDecided")] == [("once", "operator"), ("deny", "operator")]
    assert [e.outcome for e in kinds(seen, "ToolCallFinished")] == ["ok", "denied"]
    tool_messages = [m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool"]
    assert tool_messages[0] == "echo: hi" and "denied by the operator" in tool_messages[1]


@pytest.mark.anyio
async def test_approved_for_the_run_the_tool_is_not_asked_about_again():
    async def operator(engine, seen):
        await waiter(engine, seen, lambda e: e.kind == "ApprovalRequested").wait()
        e = kinds(seen, "ApprovalRequested")[0]
        assert engine.handle(command_of({"name": "approve", "agent": e.agent, "call_id": e.call_id, "scope": "run"})) == "run"

    engine, seen, code = await run(workflow({"echo": {"text": "hi"}}, server=asking(), tool_steps=3),
                                   ask="operator", during=operator)
    assert code == 0
    assert len(kinds(seen, "ApprovalRequested")) == 1
    assert [(e.decision, e.by) for e in kinds(seen, "ApprovalDecided")] == [("run", "operator")]
    assert [e.outcome for e in kinds(seen, "ToolCallFinished")] == ["ok", "ok", "ok"]


@pytest.mark.anyio
async def test_headless_an_ask_call_is_denied_and_the_model_told_unless_approve_all():
    engine, seen, code = await run(workflow({"echo": {"text": "hi"}}, server=asking()), ask="deny")
    assert code == 0  # the model answered after hearing the call was denied
    assert [(e.decision, e.by) for e in kinds(seen, "ApprovalDecided")] == [("deny", "headless")]
    assert [e.outcome for e in kinds(seen, "ToolCallFinished")] == ["denied"]
    assert "--approve-all" in next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    engine, seen, code = await run(workflow({"echo": {"text": "hi"}}, server=asking()), ask="approve")
    assert [(e.decision, e.by) for e in kinds(seen, "ApprovalDecided")] == [("once", "headless")]
    assert [(e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("ok", "echo: hi")]


@pytest.mark.anyio
async def test_a_tool_in_no_list_asks_and_deny_wins_over_ask_and_allow():
    from cerevisor_tui.config.models import McpServerConfig
    from cerevisor_tui.tools.permissions import rule_for

    server = McpServerConfig(name="s", command="x", allow=["read_*", "git_*"], ask=["git_*"], deny=["git_push"])
    assert [rule_for(server, t) for t in ("read_file", "git_log", "git_push", "write_file")] == [
        "allow", "ask", "deny", "ask"]


@pytest.mark.anyio
async def test_approve_or_deny_of_a_call_that_is_not_waiting_is_one_clear_error():
    engine, _, _ = await run(workflow({"echo": {"text": "hi"}}))
    with pytest.raises(ValueError, match="no such tool call 'nope' waiting for approval on a0"):
        engine.handle(command_of({"name": "approve", "agent": "a0", "call_id": "nope"}))
    with pytest.raises(ValueError, match="Invalid enum value 'forever' - at `scope`"):
        engine.handle(command_of({"name": "approve", "agent": "a0", "call_id": "nope", "scope": "forever"}))
    with pytest.raises(ValueError, match="no such tool call"):
        engine.handle(command_of({"name": "deny", "agent": "a0", "call_id": "nope"}))


@pytest.mark.anyio
async def test_a_hung_call_is_warned_about_then_cancelled_at_its_tool_deadline_and_the_model_told():
    data = workflow({"hang": {"seconds": 60}}, server={"tool_timeout_s": 0.5, "warn_at": [0.5, 0.8]})
    engine, seen, code = await run(data)
    assert code == 0
    warnings = kinds(seen, "ToolCallWarning")
    assert [w.fraction for w in warnings] == [0.5, 0.8]
    assert all(0 < w.remaining_s <= 0.25 + 0.05 for w in warnings)
    finished = kinds(seen, "ToolCallFinished")[0]
    assert finished.outcome == "timeout" and "tool_timeout_s" in finished.result and finished.elapsed_s >= 0.5
    result = next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    assert result.startswith("error: the tool call was cancelled: no result after")


@pytest.mark.anyio
async def test_time_in_a_tool_is_not_model_silence_the_idle_deadline_does_not_run():
    data = workflow({"hang": {"seconds": 1.0}}, server={"tool_timeout_s": 10})  # 2.5 idle windows in the tool
    data["stall"] = {"idle_timeout_s": 0.4, "first_byte_timeout_s": 5}
    engine, seen, code = await run(data)
    assert code == 0, kinds(seen, "AgentFinished")
    assert [(e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("ok", "woke up")]
    assert not kinds(seen, "AgentKilled") and not kinds(seen, "StallWarning")


@pytest.mark.anyio
async def test_kill_acts_on_the_running_tool_call_and_the_agent_goes_on():
    async def operator(engine, seen):
        await waiter(engine, seen, lambda e: e.kind == "ToolCallStarted").wait()
        assert engine.agents["a0"].status == "tool"
        assert engine.handle(command_of({"name": "kill", "agent": "a0"})) is True

    engine, seen, code = await run(workflow({"hang": {"seconds": 60}}), during=operator)
    assert code == 0
    finished = kinds(seen, "ToolCallFinished")[0]
    assert finished.outcome == "killed" and finished.elapsed_s < 30
    assert "cancelled by the operator" in next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")


@pytest.mark.anyio
async def test_extend_moves_the_running_tool_calls_deadline():
    async def operator(engine, seen):
        await waiter(engine, seen, lambda e: e.kind == "ToolCallStarted").wait()
        assert engine.handle(command_of({"name": "extend", "agent": "a0", "seconds": 5.0})) is True

    data = workflow({"hang": {"seconds": 1.5}}, server={"tool_timeout_s": 1.0})
    engine, seen, code = await run(data, during=operator)
    assert code == 0
    started = kinds(seen, "ToolCallStarted")[0]
    extended = [e for e in kinds(seen, "StallExtended") if e.deadline == "tool"]
    assert len(extended) == 1 and extended[0].by_operator
    assert extended[0].deadline_at == pytest.approx(started.deadline + 5.0)
    assert [(e.outcome, e.result) for e in kinds(seen, "ToolCallFinished")] == [("ok", "woke up")]
