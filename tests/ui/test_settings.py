"""The settings screen against a real config file: inline refusals, save round-trip, live apply."""

from __future__ import annotations

import tomllib

import pytest

from cerevisor_tui.commands.console import resolve_config
from cerevisor_tui.config import load_config
from cerevisor_tui.ui.screens.confirm import ConfirmScreen
from cerevisor_tui.ui.screens.main import MainScreen
from cerevisor_tui.ui.screens.settings import SettingsScreen
from tests.ui.conftest import EventLog, console, engine_of, kind

SECRET = "sk-test-5f3a9c1e-do-not-write"

CONFIG = """\
# team config: the comments here cannot survive a tomli-w save
[run]
mode = "parallel"
max_concurrency = 2
run_dir = "{run_dir}"

[stall]
idle_timeout_s = 600.0  # ten minutes

[ui]
theme = "cerevisor-light"

[ui.keys]
toggle_mode = "M"

[[endpoints]]
name = "box"
kind = "simulated"
api_key_env = "CEREVISOR_TEST_KEY"
max_concurrency = 8

[endpoints.sim]
seed = 3
tokens_per_s = 400.0
ttft_s = 0.02

[[agents]]
name = "alpha"
prompt = "Say something."
max_tokens = 20

[[agents]]
name = "beta"
depends_on = ["alpha"]
prompt = "Summarise: {{{{ alpha.output }}}}"
"""


async def type_into(pilot, screen: SettingsScreen, section: str, key: str, text: str, index: int = 0) -> None:
    """Clear the field and type `text` into it, as the operator would."""
    field = screen.field(section, key, index)
    field.control.focus()
    field.control.value = ""
    await pilot.press(*text)


async def paste_into(pilot, screen: SettingsScreen, section: str, key: str, text: str, index: int = 0) -> None:
    """Replace the field's text at once (the same Input.Changed as typing, without a key press per character)."""
    screen.field(section, key, index).control.value = text
    await pilot.pause()


@pytest.mark.anyio
async def test_settings_refuse_bad_values_inline_then_save_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("CEREVISOR_TEST_KEY", SECRET)
    path = tmp_path / "team.toml"
    path.write_text(CONFIG.format(run_dir=tmp_path / "runs"))
    original = path.read_text()
    setup = resolve_config(str(path))
    app = console(setup.config, config_path=setup.config_path, save_path=setup.save_path)
    log = EventLog(engine_of(app))
    async with app.run_test(size=(100, 40)) as pilot:
        await log.wait(kind("RunFinished"))  # a quiet app: typing is not slowed by a busy stream
        await pilot.press("s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        assert screen.field("run", "max_concurrency").control.value == "2"

        # refused inline, with pydantic's reason, and nothing is written
        await type_into(pilot, screen, "run", "max_concurrency", "0")
        field = screen.field("run", "max_concurrency")
        assert field.has_class("-invalid")
        assert "greater than or equal to 1" in field.error
        assert "greater than or equal to 1" in str(field.query_one(".field-note").render())
        await paste_into(pilot, screen, "stall", "warn_at", "0.5, 1.5")
        assert "between 0 and 1" in screen.field("stall", "warn_at").error
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        assert path.read_text() == original

        # valid values: save asks first because the file's comments will be lost
        await type_into(pilot, screen, "run", "max_concurrency", "7")
        await paste_into(pilot, screen, "stall", "warn_at", "0.6, 0.9")
        await paste_into(pilot, screen, "stall", "idle_timeout_s", "42")
        await paste_into(pilot, screen, "endpoint", "model", "m2")
        assert not [f for f in screen.fields if f.has_class("-invalid")]
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        assert isinstance(app.screen, MainScreen)

        # mode, cap and the stall deadlines apply to the running engine at once
        assert engine_of(app).scheduler.max_concurrency == 7
        policy = engine_of(app).policies[engine_of(app).config.endpoints[0].name]
        assert policy.idle_timeout_s == 42.0 and policy.warn_at == (0.6, 0.9)

    text = path.read_text()
    saved = tomllib.loads(text)
    assert saved["run"]["max_concurrency"] == 7
    assert saved["stall"]["idle_timeout_s"] == 42.0
    assert saved["stall"]["warn_at"] == [0.6, 0.9]
    assert saved["endpoints"][0]["model"] == "m2"
    assert saved["endpoints"][0]["api_key_env"] == "CEREVISOR_TEST_KEY"
    assert saved["endpoints"][0]["sim"] == {"seed": 3, "tokens_per_s": 400.0, "ttft_s": 0.02}
    assert [a["name"] for a in saved["agents"]] == ["alpha", "beta"]
    assert saved["agents"][1]["prompt"] == "Summarise: {{ alpha.output }}"
    assert saved["ui"] == {"theme": "cerevisor-light", "keys": {"toggle_mode": "M"}}
    assert SECRET not in text
    assert not any(SECRET in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert (tmp_path / "team.toml.bak").read_text() == original
    assert load_config(path).run.max_concurrency == 7
    assert not list(tmp_path.glob(".team.toml.*"))  # no temp file left behind


@pytest.mark.anyio
async def test_settings_esc_with_unsaved_changes_asks_and_keeps_the_file(tmp_path):
    path = tmp_path / "plain.toml"
    path.write_text(CONFIG.format(run_dir=tmp_path / "runs").replace('api_key_env = "CEREVISOR_TEST_KEY"\n', ""))
    before = path.read_text()
    setup = resolve_config(str(path))
    app = console(setup.config, config_path=setup.config_path, save_path=setup.save_path, start_engine=False)
    async with app.run_test(size=(100, 40)) as pilot:
        await pilot.press("s")
        screen = app.screen
        await type_into(pilot, screen, "run", "metrics_interval_s", "5")
        await pilot.press("escape")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert app.screen is screen
        await pilot.press("escape", "y")
        assert isinstance(app.screen, MainScreen)
    assert path.read_text() == before


@pytest.mark.anyio
async def test_a_gateways_settings_without_a_config_file_ask_where_to_save_and_apply_at_once(tmp_path):
    from cerevisor_tui.config import validate
    from cerevisor_tui.ui.screens.save_to import SaveToScreen

    config = validate({
        "run": {"mode": "sequential", "run_dir": str(tmp_path / "runs"), "warmup": "off"},
        "endpoints": [{"name": "sim", "kind": "simulated", "model": "sim-model", "sim": {"seed": 3}}],
        "gateway": {"listen": "127.0.0.1:0", "upstream": "sim", "model_map": {"claude-*": "sim-model"}},
    })
    app = console(config)  # as `gateway` started from the command line: no config file
    engine = engine_of(app)
    log = EventLog(engine)
    target = tmp_path / "conf" / "gw.toml"
    async with app.run_test(size=(100, 40)) as pilot:
        await log.wait(kind("RunStarted"))
        await pilot.press("s")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        assert "nowhere" in str(screen.query_one("#settings-target").render())
        field = screen.field("gateway", "release_after_s")
        assert field.control.value == "60" and "Applies at once" in field.spec.help
        assert "From the next run" in screen.field("gateway", "max_body_mib").spec.help
        await paste_into(pilot, screen, "gateway", "release_after_s", "-1")
        assert "greater than or equal to 0" in screen.field("gateway", "release_after_s").error
        await paste_into(pilot, screen, "gateway", "release_after_s", "2.5")
        await paste_into(pilot, screen, "gateway", "down_after_s", "9")
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SaveToScreen)
        app.screen.query_one("#save-to-path").value = str(tmp_path)  # a folder is refused, nothing written
        await pilot.press("enter")
        assert isinstance(app.screen, SaveToScreen) and "is a folder" in str(
            app.screen.query_one("#save-to-problem").render())
        app.screen.query_one("#save-to-path").value = str(target)
        await pilot.press("enter")
        await log.wait(lambda e: kind("RunNotice")(e) and "gateway settings applied" in e.message)
        assert isinstance(app.screen, MainScreen)
        assert engine.sessions.release_after_s == 2.5 and engine.endpoint_states.down_after_s == 9.0
        assert engine.config.gateway.release_after_s == 2.5
        assert app.save_path == target

    saved = tomllib.loads(target.read_text())
    assert saved["gateway"]["release_after_s"] == 2.5 and saved["gateway"]["down_after_s"] == 9.0
    assert saved["gateway"]["upstream"] == "sim" and saved["gateway"]["model_map"] == {"claude-*": "sim-model"}
    reread = load_config(target)
    assert reread.gateway is not None and reread.gateway.listen == "127.0.0.1:0" and reread.run.mode == "sequential"


@pytest.mark.anyio
async def test_settings_applied_without_saving_write_nothing(tmp_path):
    from cerevisor_tui.config import validate

    config = validate({
        "run": {"run_dir": str(tmp_path / "runs"), "warmup": "off"},
        "endpoints": [{"name": "sim", "kind": "simulated", "model": "sim-model", "sim": {"seed": 3}}],
        "gateway": {"listen": "127.0.0.1:0"},
    })
    app = console(config)
    engine = engine_of(app)
    log = EventLog(engine)
    async with app.run_test(size=(100, 40)) as pilot:
        await log.wait(kind("RunStarted"))
        await pilot.press("s")
        await paste_into(pilot, app.screen, "gateway", "max_sessions_per_key", "3")
        await pilot.press("ctrl+s")
        await pilot.click("#apply")
        await log.wait(lambda e: kind("RunNotice")(e) and "max_sessions_per_key 3" in e.message)
        assert isinstance(app.screen, MainScreen) and engine.sessions.max_per_key == 3 and app.save_path is None
    assert not [p for p in tmp_path.rglob("*.toml")]
