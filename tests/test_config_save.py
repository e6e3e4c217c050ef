"""Saving settings back into a TOML file: managed keys only, atomically, no secrets, comments guarded."""

from __future__ import annotations

import os
import stat
import tomllib

import pytest

from cerevisor_tui.config import load_config, validate
from cerevisor_tui.config.save import (
    CommentsWouldBeLost,
    SaveError,
    has_comments,
    merge_settings,
    save_settings,
)

FILE = """\
[run]
mode = "parallel"
max_concurrency = 4

[stall]
first_byte_timeout_s = 900.0
idle_timeout_s = 600.0

[ui]
theme = "cerevisor-light"

[ui.keys]
toggle_mode = "M"

[[endpoints]]
name = "vllm"
base_url = "http://127.0.0.1:8000/v1"
kind = "local"
api_key_env = "CEREVISOR_SAVE_KEY"
idle_timeout_s = 120.0
allow_insecure_http = false

[[agents]]
name = "a"
prompt = "multi\\nline \\"quoted\\" {{ b.output }}"
depends_on = ["b"]

[[agents]]
name = "b"
prompt = "first"
temperature = 0.2
"""


def edited(path, **run):
    config = load_config(path)
    data = config.model_dump()
    data["run"].update(run)
    data["stall"]["first_byte_timeout_s"] = None  # back to the default: the key goes away
    data["endpoints"][0]["model"] = "qwen"
    data["endpoints"][0]["idle_timeout_s"] = None
    return validate(data)


def test_has_comments_sees_comments_not_hashes_inside_strings():
    assert has_comments("# top\na = 1")
    assert has_comments("a = 1  # trailing")
    assert not has_comments('a = "#not"\nb = \'#no\'\nc = """\n# in a string\n"""\nd = \'\'\'#\'\'\'')
    assert not has_comments('a = "esc \\" # still string"')
    assert has_comments('a = """x""" # after')


def test_save_replaces_managed_keys_and_keeps_everything_else(tmp_path, monkeypatch):
    monkeypatch.setenv("CEREVISOR_SAVE_KEY", "sk-live-abcdef123456")
    path = tmp_path / "c.toml"
    path.write_text(FILE)
    os.chmod(path, 0o640)
    result = save_settings(path, edited(path, max_concurrency=9, mode="sequential"))
    assert result.backup is None and not result.created
    text = path.read_text()
    data = tomllib.loads(text)
    assert data["run"]["max_concurrency"] == 9 and data["run"]["mode"] == "sequential"
    assert "first_byte_timeout_s" not in data["stall"]
    ep = data["endpoints"][0]
    assert ep["model"] == "qwen" and "idle_timeout_s" not in ep
    assert ep["api_key_env"] == "CEREVISOR_SAVE_KEY" and ep["allow_insecure_http"] is False
    assert "sim" not in ep  # defaults the file never had are not added
    assert data["ui"] == {"theme": "cerevisor-light", "keys": {"toggle_mode": "M"}}
    assert data["agents"] == tomllib.loads(FILE)["agents"]
    assert "sk-live-abcdef123456" not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]  # no temp file left
    assert load_config(path).run.max_concurrency == 9


def test_a_file_with_comments_is_kept_unless_the_caller_allows_losing_them(tmp_path):
    path = tmp_path / "c.toml"
    original = "# my notes\n" + FILE
    path.write_text(original)
    config = load_config(path)
    with pytest.raises(CommentsWouldBeLost):
        save_settings(path, config)
    assert path.read_text() == original
    result = save_settings(path, config, allow_comment_loss=True)
    assert result.backup == tmp_path / "c.toml.bak" and result.backup.read_text() == original
    assert "# my notes" not in path.read_text()


def test_a_secret_value_is_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("CEREVISOR_SAVE_KEY", "sk-live-abcdef123456")
    path = tmp_path / "c.toml"
    path.write_text(FILE)
    data = load_config(path).model_dump()
    data["endpoints"][0]["model"] = "sk-live-abcdef123456"  # pasted into the wrong field
    with pytest.raises(SaveError, match="CEREVISOR_SAVE_KEY"):
        save_settings(path, validate(data))
    assert path.read_text() == FILE


def test_a_new_file_starts_from_the_template_and_an_unparsable_file_is_not_overwritten(tmp_path):
    template = FILE.replace('api_key_env = "CEREVISOR_SAVE_KEY"\n', "")
    config = validate(tomllib.loads(template))
    new = tmp_path / "sub" / "config.toml"
    result = save_settings(new, config, template=template)
    assert result.created and load_config(new).agents[0].name == "a"

    broken = tmp_path / "broken.toml"
    broken.write_text("[run\nmode = ")
    with pytest.raises(SaveError, match="invalid TOML"):
        save_settings(broken, config)
    assert broken.read_text() == "[run\nmode = "


def test_merge_adds_missing_endpoints_and_agents_for_a_saved_demo():
    config = validate(tomllib.loads(FILE.replace('api_key_env = "CEREVISOR_SAVE_KEY"\n', "")))
    doc = merge_settings({"ui": {"theme": "cerevisor-contrast"}}, config)
    assert doc["ui"] == {"theme": "cerevisor-contrast"}
    assert doc["endpoints"][0]["name"] == "vllm" and doc["endpoints"][0]["base_url"].startswith("http://")
    assert [a["name"] for a in doc["agents"]] == ["a", "b"]


def test_gateway_numbers_are_saved_and_a_new_file_gets_the_whole_gateway_table(tmp_path):
    gateway = {"listen": "127.0.0.1:8101", "upstream": "box", "model_map": {"claude-*": "m"}}
    config = validate({"endpoints": [{"name": "box", "kind": "local", "base_url": "http://127.0.0.1:8000/v1"}],
                       "gateway": {**gateway, "release_after_s": 5.0}})
    new = tmp_path / "gw.toml"
    assert save_settings(new, config).created
    assert tomllib.loads(new.read_text())["gateway"] == {**gateway, "release_after_s": 5.0}
    # a file that has a [gateway] table keeps what the screen does not edit; a default never added is not added
    kept = tmp_path / "kept.toml"
    kept.write_text('[gateway]\nlisten = "127.0.0.1:8100"\nmodel_map = { "gpt-*" = "m" }\n\n'
                    '[[endpoints]]\nname = "box"\nkind = "local"\nbase_url = "http://127.0.0.1:8000/v1"\n')
    save_settings(kept, config)
    assert tomllib.loads(kept.read_text())["gateway"] == {"listen": "127.0.0.1:8100", "model_map": {"gpt-*": "m"},
                                                          "release_after_s": 5.0}


def test_a_config_without_a_gateway_never_gets_one(tmp_path):
    config = validate({"endpoints": [{"name": "box", "kind": "local", "base_url": "http://127.0.0.1:8000/v1"}]})
    path = tmp_path / "plain.toml"
    save_settings(path, config)
    assert "gateway" not in tomllib.loads(path.read_text())
