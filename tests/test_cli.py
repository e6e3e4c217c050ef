"""The CLI through subprocesses: headless runs against `cerevisor-tui sim`, exit codes, and config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import cli_here, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config.example.toml"


def cli(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


@pytest.fixture
def sim_process():
    procs = []

    def start(*flags: str) -> str:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "cerevisor_tui", "sim", "--port", str(port), *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "the sim to start", timeout=15)
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(10)


def check_report(report: dict) -> None:
    assert report["schema_version"] == 1
    for key in ("run_id", "mode", "started_at", "finished_at", "endpoints", "agents", "totals"):
        assert key in report
    for agent in report["agents"]:
        assert set(agent) >= {"name", "wave", "status", "attempts", "turns", "prompt_tokens", "completion_tokens",
                              "ttft_s", "duration_s", "output_tokens_per_s", "stall_warnings", "error"}
    assert set(report["totals"]) >= {"agents", "completed", "failed", "killed", "skipped", "output_tokens", "wall_s",
                                     "output_tokens_per_s", "max_running"}


def test_example_workflow_against_sim_exits_0_with_a_valid_report(sim_process, tmp_path):
    url = sim_process("--speed", "16")
    out = tmp_path / "out.json"
    proc = cli("run", str(EXAMPLE), "--endpoint", url, "--report", str(out), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(out.read_text())
    check_report(report)
    assert report["totals"]["completed"] == 5 and report["totals"]["agents"] == 5
    assert {a["name"]: a["wave"] for a in report["agents"]}["writer"] == 1
    assert all(a["completion_tokens"] > 0 and a["ttft_s"] is not None for a in report["agents"])
    writer = next(a for a in report["agents"] if a["name"] == "writer")
    assert writer["turns"] == 2
    # the run directory holds the same report, the events and one transcript per agent
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "report.json").read_text())["run_id"] == report["run_id"]
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["event"] == "RunStarted" and json.loads(lines[-1])["event"] == "RunFinished"
    transcript = [json.loads(line) for line in (run_dir / "transcripts" / "writer.jsonl").read_text().splitlines()]
    assert [m["role"] for m in transcript] == ["user", "assistant", "user", "assistant"]
    assert "researcher" not in proc.stderr
    assert "writer: COMPLETED" in proc.stdout


def test_an_injected_stall_exits_1_and_the_report_names_the_agent_and_deadline(sim_process, tmp_path):
    url = sim_process("--stall-after-tokens", "3", "--keepalive-s", "0.2", "--tokens-per-s", "100")
    config = tmp_path / "stall.toml"
    config.write_text(f'''
[stall]
idle_timeout_s = 1.0
[[endpoints]]
name = "box"
base_url = "{url}"
[[agents]]
name = "stuck"
prompt = "hello"
retries = 0
''')
    out = tmp_path / "report.json"
    proc = cli("run", str(config), "--report", str(out), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1, proc.stderr
    report = json.loads(out.read_text())
    check_report(report)
    (agent,) = report["agents"]
    assert agent["name"] == "stuck" and agent["status"] == "killed"
    assert agent["error"].startswith("idle deadline: no output for 1") and "after 3 tokens" in agent["error"]
    assert agent["stall_warnings"] == 3
    assert report["totals"]["killed"] == 1
    assert "stuck: KILLED (idle deadline)" in proc.stdout


def test_jsonl_prints_one_event_object_per_line(sim_process, tmp_path):
    url = sim_process("--speed", "8")
    config = tmp_path / "one.toml"
    config.write_text(f'[[endpoints]]\nname = "e"\nbase_url = "{url}"\n[[agents]]\nname = "x"\nprompt = "p"\nmax_tokens = 4\n')
    proc = cli("run", str(config), "--jsonl", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[0] == "RunStarted" and kinds[-1] == "RunFinished"
    assert "TokenDelta" in kinds and "FirstToken" in kinds and "TurnFinished" in kinds


BAD_CONFIGS = {
    "unknown key": ('[run]\nmodee = "parallel"\n', "run.modee: unknown key"),
    "bad type": ('[run]\nmax_concurrency = "lots"\n', "run.max_concurrency:"),
    "bad mode": ('[run]\nmode = "turbo"\n', "run.mode:"),
    "invalid toml": ("[run\n", "invalid TOML"),
    "cycle": ('[[endpoints]]\nname="e"\nbase_url="http://127.0.0.1:1/v1"\n[[agents]]\nname="a"\nprompt="x"\ndepends_on=["b"]\n'
              '[[agents]]\nname="b"\nprompt="x"\ndepends_on=["a"]\n', "cycle: a -> b -> a"),
    "unknown dependency": ('[[endpoints]]\nname="e"\nbase_url="http://127.0.0.1:1/v1"\n[[agents]]\nname="a"\nprompt="x"\n'
                           'depends_on=["ghost"]\n', "agents[0] (a).depends_on: unknown agent 'ghost'"),
    "duplicate agent": ('[[endpoints]]\nname="e"\nbase_url="http://127.0.0.1:1/v1"\n[[agents]]\nname="a"\nprompt="x"\n'
                        '[[agents]]\nname="a"\nprompt="y"\n', "duplicate agent name 'a'"),
    "unknown endpoint": ('[[endpoints]]\nname="e"\nbase_url="http://127.0.0.1:1/v1"\n[[agents]]\nname="a"\nprompt="x"\n'
                         'endpoint="f"\n', "agents[0] (a).endpoint: unknown endpoint 'f'"),
    "missing url": ('[[endpoints]]\nname="e"\n[[agents]]\nname="a"\nprompt="x"\n', "base_url is required"),
    "missing key var": ('[[endpoints]]\nname="e"\nbase_url="https://api.example.com/v1"\napi_key_env="CEREVISOR_TEST_UNSET_KEY"\n'
                        '[[agents]]\nname="a"\nprompt="x"\n', "CEREVISOR_TEST_UNSET_KEY is not set"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_errors_exit_2_with_one_clear_line(tmp_path, capsys, case):
    text, expected = BAD_CONFIGS[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    proc = cli_here(capsys, "run", str(path))
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert str(path) in proc.stderr and expected in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_missing_file_and_bad_flags_exit_2(tmp_path, capsys):
    proc = cli_here(capsys, "run", str(tmp_path / "nope.toml"))
    assert proc.returncode == 2 and "file not found" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli_here(capsys, "run", str(EXAMPLE), "--concurrency", "0")
    assert proc.returncode == 2 and "max_concurrency" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli_here(capsys, "run")
    assert proc.returncode == 2 and "see cerevisor-tui run --help" in proc.stderr


def test_help_teaches_with_examples():
    for args in ([], ["run"], ["sim"], ["probe"], ["estimate"]):
        proc = cli(*args, "--help")
        assert proc.returncode == 0 and "example" in proc.stdout


def test_sim_tool_args_take_the_inline_table_its_help_shows_and_refuse_anything_else():
    from cerevisor_tui.cli import build_parser

    args = build_parser(sim_options=True).parse_args(
        ["sim", "--tool-args", '{ get_current_time = { timezone = "UTC" } }'])
    assert args.tool_args == {"get_current_time": {"timezone": "UTC"}}
    bad = subprocess.run([sys.executable, "-m", "cerevisor_tui", "sim", "--tool-args", "[1, 2]"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert "--tool-args: not a TOML inline table" in bad.stderr and "Traceback" not in bad.stderr
