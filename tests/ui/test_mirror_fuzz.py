"""One bad event never stops the console: every single-field mutation of a real journal's records that passes the
contract's type check is taken by the mirror without a handler failing, and an event a handler does fail on is
caught, counted and said once, while the events after it are still taken."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.journal import read_events
from cerevisor_tui.ui.mirror import RunMirror

ROOT = Path(__file__).resolve().parents[2]
FAKE_MCP = ROOT / "tests" / "fixtures" / "mcp_fake.py"
OLDER_JOURNAL = ROOT / "tests" / "fixtures" / "journals" / "events.jsonl"

VALUES: tuple[Any, ...] = (-1, 0, 2**63 - 1, 1e308, float("nan"), float("inf"), "", "ghost", [], {}, None, True)
"""What a field is set to: bounds, non-finite numbers, an empty or unknown name, empty containers, null."""

WORKFLOW = f"""
[run]
mode = "parallel"
max_concurrency = 4
[stall]
idle_timeout_s = 0.3
[[endpoints]]
name = "sim"
kind = "simulated"
price_in_per_mtok = 3
price_out_per_mtok = 5
[endpoints.sim]
speed = 20
seed = 3
tool_steps = 1
tool_args = {{echo = {{text = "hi"}}}}
[[endpoints]]
name = "stally"
kind = "simulated"
[endpoints.sim]
speed = 20
stall_after_tokens = 3
[[mcp_servers]]
name = "fake"
command = {json.dumps(sys.executable)}
args = [{json.dumps(str(FAKE_MCP))}]
allow = ["*"]
[[agents]]
name = "tooly"
endpoint = "sim"
prompt = "use the tool"
tools = ["fake.echo"]
max_tokens = 8
[[agents]]
name = "staller"
endpoint = "stally"
prompt = "go"
max_tokens = 20
retries = 1
[[agents]]
name = "after"
endpoint = "sim"
prompt = "then {{{{ tooly.output }}}}"
turns = ["more"]
max_tokens = 8
depends_on = ["tooly"]
"""
"""Two waves on two simulated endpoints: a tool call, meters with a price, stall warnings, a kill, a retry, a
dependency's answer inserted, a second turn."""


@pytest.fixture(scope="module")
def sim_journal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real journal: a run of WORKFLOW on the built-in simulator."""
    where = tmp_path_factory.mktemp("fuzz")
    (where / "w.toml").write_text(WORKFLOW)
    done = subprocess.run([sys.executable, "-m", "cerevisor_tui", "run", str(where / "w.toml"), "--run-dir",
                           str(where / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # staller is killed by its idle deadline, twice
    return where / "run"


def mutations(record: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each record with one field changed: a top-level field, or one field of an object (or of the first object of
    a list) it holds."""
    for key, value in record.items():
        if key == "event":
            continue
        for v in VALUES:
            yield f"{key}={v!r}", {**record, key: v}
        if isinstance(value, dict):
            for inner in value:
                for v in VALUES:
                    yield f"{key}.{inner}={v!r}", {**record, key: {**value, inner: v}}
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for inner in value[0]:
                for v in VALUES:
                    yield f"{key}[0].{inner}={v!r}", {**record, key: [{**value[0], inner: v}, *value[1:]]}


def look(mirror: RunMirror) -> None:
    """What the widgets ask of a mirror."""
    mirror.cap_warning()
    mirror.fit_below_cap()
    for a in mirror.agents.values():
        mirror.meter_note(a.name)
        if a.attempt is not None:
            _ = a.attempt.deadline_at, a.attempt.phase


@pytest.mark.parametrize("which", ["simulator run", "older version's"])
def test_no_single_field_mutation_of_a_real_journal_makes_a_mirror_handler_fail(request, which):
    # the older journal is a file: its case runs no workflow (on another xdist worker, it would run its own)
    path = request.getfixturevalue("sim_journal") / "events.jsonl" if which == "simulator run" else OLDER_JOURNAL
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    events = [ev.event_of(r) for r in records]
    tried, failed = 0, []
    for i, record in enumerate(records):
        for what, mutated in mutations(record):
            try:
                event = ev.event_of(mutated)
            except ev.EventError:
                continue  # refused by its type: skipped and counted as unreadable, never seen by a handler
            if event == events[i]:
                continue  # (a field set to what it was, or to a value its type reads as the same)
            tried += 1
            mirror = RunMirror()
            for e in (*events[:i], event, *events[i + 1:]):
                mirror(e)  # never raises: a handler's failure is caught per event (and counted)
            look(mirror)
            if mirror.events_not_taken:
                failed.append(f"line {i + 1} {record['event']} {what}: {mirror.notices[-1].message}")
    assert tried > 500  # the mutations that pass the type check: the ones a handler sees
    assert not failed, "\n".join(failed[:20])


def test_an_event_a_handler_fails_on_is_counted_said_once_and_the_journal_after_it_is_still_taken(sim_journal, tmp_path):
    """A hand-edited journal: two token deltas with a time no clock reaches (1e400 reads as infinity), in the
    middle. A read-only attach reads it as the console does; it opens on the whole run, the run's end included."""
    lines = (sim_journal / "events.jsonl").read_text().splitlines()
    bad = json.dumps({"event": "TokenDelta", "t": 0.0, "agent": "tooly", "attempt": 1, "text": "x", "tokens": 1})
    bad = bad.replace('"t": 0.0', '"t": 1e400')
    edited = tmp_path / "run"
    edited.mkdir()
    (edited / "events.jsonl").write_text("\n".join([*lines[:10], bad, bad, *lines[10:]]) + "\n")
    events, unreadable = read_events(edited)
    assert unreadable == 2  # a number past a float's range is no event of this version: counted, never read
    mirror = RunMirror()
    for event in events:
        mirror(event)
    assert mirror.finished is not None and mirror.finished.exit_code == 1 and not mirror.events_not_taken
    # the same lines parsed by json (which reads 1e400 as infinity) fit the contract's types: only a handler
    # finds them wrong, and the mirror catches that per event
    mirror = RunMirror()
    assert mirror.feed_records(json.loads(line) for line in (edited / "events.jsonl").read_text().splitlines()) == 0
    assert mirror.events_not_taken == 2
    said = [n for n in mirror.notices if n.title == "Console"]
    assert len(said) == 1 and "could not take a TokenDelta event (OverflowError" in said[0].message
    assert mirror.finished is not None and mirror.finished.exit_code == 1  # what came after was taken
    assert {a.name: a.status for a in mirror.agents.values()} == {"tooly": "completed", "staller": "killed",
                                                                   "after": "completed"}
