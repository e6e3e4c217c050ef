"""A run always ends, and says how in numbers that add up: a foreground run held by its spent budget ends once
what runs has finished (unless a console is attached to resume it), a stopped chain counts its cancelled agents,
and report.json is strict JSON whatever a figure comes to."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.journal import Journal
from cerevisor_tui.engine.sinks.report import Report
from cerevisor_tui.supervisor.client import ControlClient
from tests.conftest import cli_here, until, wait_until

CLI = [sys.executable, "-m", "cerevisor_tui"]
SPENT = re.compile(r"budget reached \(\$\d+\.\d{4} of \$0\.0001\)")


def priced_workflow(path: Path, *, tokens_per_s: float = 40.0, later_tokens: int = 10) -> Path:
    """Three agents, one at a time (a2 after a1), at $10,000 a million prompt tokens: the first turn spends the
    budget of $0.0001. a0 answers 10 tokens, a1 and a2 `later_tokens`."""
    path.write_text(f"""
[run]
mode = "sequential"
budget_usd = 0.0001
[[endpoints]]
name = "box"
kind = "simulated"
price_in_per_mtok = 10000
[endpoints.sim]
tokens_per_s = {tokens_per_s}
[[agents]]
name = "a0"
prompt = "first"
max_tokens = 10
[[agents]]
name = "a1"
prompt = "second"
max_tokens = {later_tokens}
[[agents]]
name = "a2"
prompt = "third"
max_tokens = {later_tokens}
depends_on = ["a1"]
""")
    return path


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def strict_json(path: Path) -> dict:
    """The file parsed as strict JSON: `Infinity` or `NaN` in it fails."""
    def refuse(name: str) -> None:
        raise AssertionError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def final_line_adds_up(text: str) -> re.Match:
    found = re.search(r"finished: (\d+)/(\d+) completed, (\d+) failed, (\d+) killed, (\d+) skipped, (\d+) cancelled"
                      r"(?:, (\d+) not started)?", text)
    assert found, text
    completed, total, *rest = (int(n or 0) for n in found.groups())
    assert completed + sum(rest) == total, found.group(0)
    return found


def test_a_foreground_run_whose_budget_is_spent_ends_and_skips_what_it_never_admitted(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "r1"
    # in this process: the command's own entry, its output read as a process's (nothing attaches or signals it)
    proc = cli_here(capsys, "run", str(priced_workflow(tmp_path / "w.toml")), "--run-dir", str(run_dir))
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    report = strict_json(run_dir / "report.json")
    statuses = {a["name"]: (a["status"], a["error"]) for a in report["agents"]}
    assert statuses["a0"] == ("completed", "")
    for name in ("a1", "a2"):  # never admitted: skipped, the budget its reason (a2's too, not "dependency a1")
        assert statuses[name][0] == "skipped" and SPENT.fullmatch(statuses[name][1]), statuses
    assert re.search(r"a1: SKIPPED: budget reached \(\$\d+\.\d{4} of \$0\.0001\)", proc.stdout)
    assert "With no console attached by the time they have, the run ends there" in proc.stdout
    assert final_line_adds_up(proc.stdout).group(0).startswith("finished: 1/3 completed")
    assert records(run_dir)[-1]["event"] == "RunFinished"


@pytest.mark.anyio
@pytest.mark.end_to_end  # a real run that waits on the wall clock for a console to attach over its socket
@pytest.mark.parametrize("then", ["resume", "detach"])
async def test_with_a_console_attached_a_spent_budget_waits_for_it_to_resume_or_leave(tmp_path, then):
    """Resumed (`p`), the run goes on past its budget; left without a word, it has no one left to wait for."""
    run_dir = tmp_path / "runs" / "r1"
    # a0's answer takes seconds (10 tokens at 4 a second, from the moment its control socket is there): the
    # console is attached before it spends the budget; a1's and a2's, once resumed, a quarter of a second each
    run = subprocess.Popen([*CLI, "run", str(priced_workflow(tmp_path / "w.toml", tokens_per_s=4, later_tokens=1)),
                            "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        await until(lambda: (run_dir / "supervisor.json").exists(), "the run's control socket")
        client = await ControlClient.connect(run_dir)
        seen: list[ev.Event] = []
        reader = asyncio.ensure_future(client.run(seen.append))
        await until(lambda: any(isinstance(e, ev.AgentFinished) and e.agent == "a0" for e in seen), "a0's end",
                    timeout=120)
        await until(lambda: any(isinstance(e, ev.RunNotice) and e.title == "Budget reached" for e in seen),
                    "the budget's notice")
        # the run ends an agent's wait in the same step that finished a0 when it ends for its budget: it has not
        assert not [e for e in seen if isinstance(e, ev.AgentFinished) and e.agent != "a0"]
        assert run.poll() is None
        if then == "resume":
            await client.command(cmd.Resume())
        else:
            await client.close()
        out, err = await asyncio.to_thread(run.communicate, timeout=120)
        await asyncio.wait_for(reader, 30)
        await client.close()
    finally:
        if run.poll() is None:
            run.kill()
    if then == "resume":
        assert run.returncode == 0, err
        assert final_line_adds_up(out).group(0).startswith("finished: 3/3 completed")
    else:
        assert run.returncode == 1, err
        assert final_line_adds_up(out).group(0).startswith("finished: 1/3 completed, 0 failed, 0 killed, 2 skipped")
        assert re.search(r"a1: SKIPPED: budget reached", out)


def test_a_stopped_chain_counts_its_cancelled_agents_in_the_final_line(tmp_path):
    cfg = tmp_path / "w.toml"
    cfg.write_text('[run]\nmode = "parallel"\n[[endpoints]]\nname = "box"\nkind = "simulated"\n'
                   '[endpoints.sim]\ntokens_per_s = 2\n'  # a0's 50 tokens take 25 s: it is cut off
                   + "".join(f'[[agents]]\nname = "a{i}"\nprompt = "p"\nmax_tokens = 50\n'
                             + (f'depends_on = ["a{i - 1}"]\n' if i else "") for i in range(5)))
    run_dir = tmp_path / "runs" / "r1"
    run = subprocess.Popen([*CLI, "run", str(cfg), "--run-dir", str(run_dir)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (run_dir / "events.jsonl").exists() and b'"FirstToken"' in
                   (run_dir / "events.jsonl").read_bytes(), "a0's first token")
        run.send_signal(signal.SIGTERM)
        out, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 143, err
    assert "finished: 0/5 completed, 0 failed, 0 killed, 0 skipped, 5 cancelled," in out
    final_line_adds_up(out)


def test_report_json_holds_null_for_a_figure_that_is_not_a_finite_number(tmp_path, capsys):
    """Whatever a figure comes to (a cost past what a float holds), report.json stays strict JSON: null there."""
    source = tmp_path / "runs" / "r1"
    cli_here(capsys, "run", str(priced_workflow(tmp_path / "w.toml")), "--run-dir", str(source))  # a real run's events
    report = Report()
    for record in records(source):  # the real run's events, a0's cost made infinite
        event = ev.event_of(record)
        if isinstance(event, ev.AgentMeters):
            event = msgspec.structs.replace(event, cost_usd=float("inf"), run_cost_usd=float("inf"))
        report(event)
    journal = Journal(tmp_path / "copy", report)
    journal.open()
    try:
        assert journal.write_report()
    finally:
        journal.close()
    written = strict_json(tmp_path / "copy" / "report.json")
    assert written["totals"]["cost_usd"] is None
    assert {a["name"]: a.get("cost_usd", "unpriced") for a in written["agents"]}["a0"] is None


def test_a_price_past_a_thousand_dollars_a_token_is_a_config_error(tmp_path, capsys):
    cfg = priced_workflow(tmp_path / "w.toml")
    cfg.write_text(cfg.read_text().replace("price_in_per_mtok = 10000", "price_in_per_mtok = 1.7e308"))
    proc = cli_here(capsys, "run", str(cfg), "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert "price_in_per_mtok: Input should be less than or equal to 1000000000" in proc.stderr
    assert "Traceback" not in proc.stderr
