"""`cerevisor-tui replay` through subprocesses: the files it writes, what it prints, and its errors (one line,
exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cerevisor_tui import cli
from cerevisor_tui.replay.generate import PRESETS, generate
from cerevisor_tui.replay.importers import FORMATS
from cerevisor_tui.replay.trace import read_trace

FIXTURES = Path(__file__).parent / "fixtures" / "replay"


def replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", "replay", *args], capture_output=True,
                          text=True, timeout=120)


def test_generate_writes_the_presets_file_and_prints_its_figures(tmp_path):
    out = tmp_path / "day.jsonl"
    done = replay("generate", "--preset", "aiperf-inference-day", "--sessions", "30", "--seed", "4", "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert read_trace(out) == generate("aiperf-inference-day", sessions=30, seed=4)
    first, second = done.stdout.splitlines()[:2]
    assert first.startswith("preset aiperf-inference-day: AIPerf") and second.startswith("wrote ")
    assert "turns a session" in done.stdout and "prefix share" in done.stdout


def test_generate_json_is_one_object_of_the_files_figures(tmp_path):
    out = tmp_path / "agentx.jsonl"
    done = replay("generate", "--preset", "agentx", "--sessions", "5", "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout)
    turns = read_trace(out)
    assert figures["file"] == str(out) and figures["turns"] == len(turns) and figures["sessions"] == 5
    assert {"turns_per_session", "prompt_tokens", "prefix_share", "subagent_spawn_share"} <= figures.keys()


def test_import_writes_a_replay_file(tmp_path):
    out = tmp_path / "weka.jsonl"
    done = replay("import", str(FIXTURES / "weka.json"), "--format", "weka", "-o", str(out), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["subagent_sessions"] == 1
    assert [t.session_id for t in read_trace(out)][-1] == "w1~2"


@pytest.mark.parametrize(("args", "says"), [
    (("generate", "--preset", "nope", "-o", "x"), "invalid choice"),
    (("generate", "--preset", "agentx", "--sessions", "0", "-o", "x"), "sessions must be 1 to 5,000"),
    (("generate", "--preset", "agentx", "--sessions", "999999999", "-o", "x"), "several files"),
    (("generate", "--preset", "agentx", "-o", "/no/such/dir/x.jsonl"), "cannot write"),
    (("import", "/no/such/trace", "--format", "mooncake", "-o", "x"), "cannot read"),
    (("import", str(FIXTURES / "weka.json"), "--format", "mooncake", "-o", "x"), ":1: not JSON"),
    (("import", str(FIXTURES / "weka.json"), "--format", "csv", "-o", "x"), "invalid choice"),
    ((), "required: ACTION"),
])
def test_errors_are_one_line_and_exit_2(tmp_path, args, says):
    done = subprocess.run([sys.executable, "-m", "cerevisor_tui", "replay", *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert says in done.stderr and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "x").exists()


def test_help_teaches_with_an_example():
    for args in (("--help",), ("generate", "--help"), ("import", "--help")):
        done = replay(*args)
        assert done.returncode == 0 and "cerevisor-tui replay " in done.stdout and "-o " in done.stdout


def test_the_command_lines_names_are_the_packages():
    assert set(cli.REPLAY_PRESETS) == set(PRESETS)
    assert set(cli.REPLAY_FORMATS) == set(FORMATS)
