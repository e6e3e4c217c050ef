"""`cerevisor-tui` (the console command): config lookup, the demo fallback, and one-line errors with exit 2."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cerevisor_tui.commands import console
from cerevisor_tui.config import ConfigError
from cerevisor_tui.config.paths import user_config_file


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg-state"))
    monkeypatch.delenv("CEREVISOR_TUI_CONFIG", raising=False)


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(config=kw.get("config"), theme=kw.get("theme"), command=None)


def test_no_config_runs_the_packaged_demo_on_the_simulator():
    setup = console.resolve_config(None)
    assert setup.demo and setup.simulated and setup.config_path is None
    assert [ep.kind for ep in setup.config.endpoints] == ["simulated"]
    assert len(setup.config.agents) == 5
    assert setup.save_path == user_config_file() and setup.save_template == console.demo_text()


def test_a_config_without_endpoints_keeps_its_settings_and_runs_the_demo(tmp_path):
    (tmp_path / "cerevisor.toml").write_text('[ui]\ntheme = "cerevisor-contrast"\n[run]\nmax_concurrency = 2\n')
    setup = console.resolve_config(None)
    assert setup.demo and setup.config_path == tmp_path / "cerevisor.toml"
    assert setup.config.ui.theme == "cerevisor-contrast" and setup.config.run.max_concurrency == 2
    assert setup.config.endpoints[0].kind == "simulated"


def test_a_config_with_endpoints_but_no_agents_is_an_error(tmp_path):
    (tmp_path / "c.toml").write_text('[[endpoints]]\nname = "x"\nbase_url = "http://127.0.0.1:1/v1"\n')
    with pytest.raises(ConfigError, match="no \\[\\[agents\\]\\]"):
        console.resolve_config(str(tmp_path / "c.toml"))


@pytest.mark.parametrize("text, expected", [
    ("[run]\nmode = \"fast\"\n", "run.mode"),
    ("[run]\nmode = \n", "invalid TOML"),
    ("[ui]\nthme = \"x\"\n", "ui.thme: unknown key"),
])
def test_bad_config_is_one_line_on_stderr_and_exit_2(tmp_path, capsys, text, expected):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    assert console.main(args(config=str(path))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and str(path) in err


def test_missing_config_file_and_unknown_theme_are_exit_2(tmp_path, capsys):
    assert console.main(args(config=str(tmp_path / "nope.toml"))) == 2
    assert "file not found" in capsys.readouterr().err
    assert console.main(args(theme="no-such-theme")) == 2
    err = capsys.readouterr().err
    assert "--theme: unknown theme 'no-such-theme'" in err and "cerevisor-dark" in err


def test_unknown_key_binding_id_is_exit_2(tmp_path, capsys):
    (tmp_path / "c.toml").write_text(console.demo_text().replace("# toggle_mode = \"M\"", "toggle_mod = \"M\""))
    assert console.main(args(config=str(tmp_path / "c.toml"))) == 2
    err = capsys.readouterr().err
    assert "ui.keys.toggle_mod: unknown binding id" in err and "toggle_mode" in err


def test_missing_api_key_variable_is_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CEREVISOR_NOPE_KEY", raising=False)
    text = console.demo_text().replace('api_key_env = ""', 'api_key_env = "CEREVISOR_NOPE_KEY"', 1)
    (tmp_path / "c.toml").write_text(text)
    assert console.main(args(config=str(tmp_path / "c.toml"))) == 2
    assert "CEREVISOR_NOPE_KEY is not set" in capsys.readouterr().err


def test_user_theme_files_are_read_and_a_broken_one_is_reported_not_fatal(tmp_path):
    from cerevisor_tui.ui.theme_files import load_themes

    folder = tmp_path / "themes"
    folder.mkdir()
    (folder / "mine.toml").write_text('name = "mine"\nprimary = "#112233"\n[variables]\nstall-warn = "#ABCDEF"\n')
    (folder / "broken.toml").write_text('name = "broken"\nprimary = "not-a-colour"\n')
    found = load_themes(folder)
    assert {"cerevisor-dark", "cerevisor-light", "cerevisor-contrast", "mine"} <= set(found.themes)
    assert found.themes["mine"].variables["stall-warn"] == "#ABCDEF"
    assert len(found.problems) == 1 and "broken.toml" in found.problems[0]


def test_cli_bad_config_prints_no_traceback(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[[agents]]\nname = \"a\"\n")
    env = {k: v for k, v in os.environ.items() if k != "CEREVISOR_TUI_CONFIG"}
    proc = subprocess.run([sys.executable, "-m", "cerevisor_tui", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, env=env, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("cerevisor-tui: ") and "agents[0] (a).prompt: required key is missing" in proc.stderr


def test_each_console_run_records_its_config_and_the_last_partly_done_run_of_it_is_offered(tmp_path):
    from cerevisor_tui.contract import events as ev
    from cerevisor_tui.engine.sinks.journal import Journal
    from cerevisor_tui.engine.sinks.report import Report

    path = tmp_path / "team.toml"
    path.write_text(console.demo_text())
    setup = console.resolve_config(str(path))
    runs_dir = tmp_path / "runs"
    key = console.config_key(setup)
    runs = console.ConsoleRuns(setup.config, runs_dir, key)
    engine = runs.open_fresh()
    runs.close()
    info = json.loads((runs_dir / engine.run_id / console.RUN_FILE).read_text())
    assert info["run_id"] == engine.run_id and info["config"] == str(path.resolve())
    # it completed nothing: resuming it would be a fresh run, so it is not offered
    assert console.last_run_dir(runs_dir, key) == runs_dir / engine.run_id
    assert console.incomplete_last_run(runs_dir, key, setup.config) is None

    def run(run_id: str, started_at: str, completed: list[str], config: str = key) -> None:
        journal = Journal(runs_dir / run_id, Report())
        journal.open()
        journal(ev.RunStarted(1.0, run_id, "parallel", 4, [], []))
        for name in completed:
            journal(ev.AgentFinished(2.0, name, "completed", "", f"answer of {name}"))
        journal.close()
        (runs_dir / run_id / console.RUN_FILE).write_text(json.dumps(
            {"run_id": run_id, "config": config, "started_at": started_at}))

    names = [a.name for a in setup.config.agents]
    run("r1", "2030-01-01T00:00:01+00:00", names[:2])
    run("r2", "2030-01-01T00:00:02+00:00", names[:1], config="/elsewhere/other.toml")  # another config
    last = console.incomplete_last_run(runs_dir, key, setup.config)
    assert last is not None and last.run_id == "r1" and (last.done, last.total) == (2, len(names))
    assert last.completed == {n: f"answer of {n}" for n in names[:2]}
    run("r3", "2030-01-01T00:00:03+00:00", names)  # the latest run of this config completed everything
    assert console.incomplete_last_run(runs_dir, key, setup.config) is None
