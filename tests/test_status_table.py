"""One rule, one owner: an agent's status changes only through the transition table (engine/status.py), and a
running attempt's counters only in its owner (engine/attempt.py). The table is checked as a state machine, and
the package is read (as tests/ui/test_layers.py reads imports) for any other writer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cerevisor_tui.config.models import AgentConfig
from cerevisor_tui.engine.state import AgentState
from cerevisor_tui.engine.status import HAPPENINGS, TRANSITIONS, move
from cerevisor_tui.kinds import FINAL, STATUSES

PACKAGE = Path(__file__).resolve().parent.parent / "cerevisor_tui"
# what a running attempt counts, on the agent or the attempt: written by engine/attempt.py alone
COUNTERS = frozenset({"tokens", "prompt_tokens", "completion_tokens", "first_token_at", "cost_usd", "cached_tokens",
                      "context_tokens", "decode_s", "ttft_s", "last_prompt_tokens", "last_completion_tokens"})
AGENT_NAMES = frozenset({"st", "att", "attempt", "agent", "state"})


def agent(status: str = "pending") -> tuple[AgentState, list[str]]:
    told: list[str] = []
    st = AgentState(AgentConfig(name="a", prompt="p"), "ep", 0, on_status=lambda s: told.append(s.status))
    st._status = status  # type: ignore[assignment]  # the test's starting point
    return st, told


def test_every_move_goes_to_a_known_status_and_every_status_is_reached():
    assert set(TRANSITIONS.values()) <= set(STATUSES)
    reached = set(TRANSITIONS.values()) | {"pending"}
    assert reached == set(STATUSES)
    assert {happening for _, happening in TRANSITIONS} == set(HAPPENINGS)


def test_an_ended_agent_stays_ended_but_for_an_end_or_the_operators_rerun():
    for final in FINAL:
        for happening in HAPPENINGS:
            st, _ = agent(final)
            now = move(st, happening)
            if happening == "reset":
                assert now == "pending"
            elif happening in FINAL:
                assert now == happening
            else:
                assert now == final, (final, happening)


@pytest.mark.parametrize(("status", "happening", "expected"), [
    ("stalling", "calm_streaming", "streaming"),
    ("prefill", "calm_streaming", "prefill"),  # extended while not stalling: it stays as it was
    ("wedged", "unwedged_prefill", "prefill"),
    ("streaming", "unwedged_prefill", "streaming"),
    ("waiting", "request_gone", "idle"),
    ("streaming", "request_gone", "streaming"),
    ("released", "queued", "queued"),
])
def test_conditional_moves_apply_only_from_their_status(status, happening, expected):
    st, told = agent(status)
    assert move(st, happening) == expected
    assert told == ([expected] if expected != status else [])  # AgentStatus told once per change, never for none


def test_an_agents_status_has_no_setter():
    st, _ = agent()
    with pytest.raises(AttributeError):
        st.status = "streaming"  # type: ignore[misc]


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of each assignment to an agent's or an attempt's status or counters in `tree`."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        flat: list[ast.expr] = []
        for target in targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        for target in flat:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if target.attr in ("status", "_status") and name != "self":
                found.append((node.lineno, target.attr))
            elif target.attr in COUNTERS and name in AGENT_NAMES:
                found.append((node.lineno, target.attr))
    return found


def test_no_module_but_the_owners_sets_an_agents_status_or_an_attempts_counters():
    owners = {PACKAGE / "engine" / "status.py", PACKAGE / "engine" / "attempt.py"}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in owners or "ui" in path.relative_to(PACKAGE).parts[:1]:
            continue  # the console keeps its own mirror of what the run told it (ui/mirror.py)
        for line, attr in _writes(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE)}:{line} sets .{attr}")
    assert offenders == []


def test_the_reader_finds_the_writes_it_looks_for():
    # the check above is only as good as its reader: each form it must catch
    source = "st.status = 'x'\nst._status = 'x'\natt.tokens += 1\nsession.st.prompt_tokens += 2\n" \
             "st.status, st.error = 'x', ''\nself.status = 200\nreading.prompt_tokens = 3\n"
    assert [attr for _, attr in _writes(ast.parse(source))] == ["status", "_status", "tokens", "prompt_tokens",
                                                                "status"]
