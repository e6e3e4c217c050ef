"""config.example.toml documents every config key (README and ARCHITECTURE.md): a new key without its line there fails here."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cerevisor_tui.config import models as config_models
from cerevisor_tui.config import validate
from cerevisor_tui.config.models import (
    AgentConfig,
    AutoConfig,
    CapacitySettings,
    EndpointConfig,
    GatewayConfig,
    RunConfig,
    SimSettings,
    StallConfig,
    StallPolicy,
    UiConfig,
    field_doc,
)

EXAMPLE = Path(__file__).resolve().parents[1] / "config.example.toml"
HEADER = re.compile(r"^\[\[?([\w.]+)\]\]?\s*$", re.MULTILINE)


def table_texts(text: str) -> dict[str, str]:
    """Each table header's text up to the next header (commented lines included); repeated tables joined."""
    out: dict[str, str] = {}
    marks = list(HEADER.finditer(text))
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out[m.group(1)] = out.get(m.group(1), "") + text[m.end():end]
    return out


def commented(text: str, key: str) -> bool:
    return re.search(rf"^#\s*{re.escape(key)}\s*=", text, re.MULTILINE) is not None


def undocumented(model: type[BaseModel], table: dict[str, Any], text: str, *, defaults: bool,
                 skip: frozenset[str] = frozenset()) -> list[str]:
    """Keys of `model` neither set in `table` nor shown commented out in `text`; with `defaults`, also a key
    set to something other than its default (the example says what you get when you leave it out)."""
    missing = []
    for key, info in model.model_fields.items():
        if key in skip:
            continue
        if key in table:
            if defaults and not isinstance(table[key], dict) and table[key] != info.default:
                missing.append(f"{key} = {table[key]!r} (default {info.default!r})")
        elif not commented(text, key):
            missing.append(key)
    return missing


def test_example_config_documents_every_key_with_its_default():
    text = EXAMPLE.read_text(encoding="utf-8")
    data = tomllib.loads(text)
    validate(data, file=str(EXAMPLE))
    texts = table_texts(text)
    endpoints_text = text[text.index("[[endpoints]]"):text.index("[[agents]]")]
    endpoint = data["endpoints"][0]
    agent_keys = {key: value for agent in data["agents"] for key, value in agent.items()}
    problems = {
        "[run]": undocumented(RunConfig, data["run"], texts["run"], defaults=True),
        "[run.auto]": undocumented(AutoConfig, data["run"]["auto"], texts["run.auto"], defaults=True),
        "[stall]": undocumented(StallConfig, data["stall"], texts["stall"], defaults=True),
        "[ui]": undocumented(UiConfig, data["ui"], texts["ui"] + texts["ui.keys"], defaults=True),
        # an endpoint may override any [stall] key: those are documented under [stall]
        "[[endpoints]]": undocumented(EndpointConfig, endpoint, endpoints_text, defaults=False,
                                      skip=frozenset(StallPolicy.model_fields)),
        "[endpoints.sim]": undocumented(SimSettings, endpoint["sim"], texts["endpoints.sim"], defaults=True),
        "[endpoints.capacity]": undocumented(CapacitySettings, endpoint["capacity"], texts["endpoints.capacity"],
                                             defaults=False),
        "[[agents]]": undocumented(AgentConfig, agent_keys, texts["agents"], defaults=False),
        # commented out: a [gateway] table would make the example serve one
        "[gateway]": undocumented(GatewayConfig, {}, text[text.index("# [gateway]"):text.index("# ---- Agents")],
                                  defaults=False),
    }
    assert {table: keys for table, keys in problems.items() if keys} == {}


def test_example_run_auto_keys_say_what_they_do():
    """The [run.auto] lines carry the model's own one-line description of each key."""
    auto_text = table_texts(EXAMPLE.read_text(encoding="utf-8"))["run.auto"]
    flat = " ".join(line.lstrip("# ").strip() for line in auto_text.splitlines())
    for key in AutoConfig.model_fields:
        doc = field_doc(AutoConfig, key)
        assert doc
        first_clause = re.split(r"[;:(]", doc)[0].strip()
        assert first_clause in flat, (key, first_clause)


def test_example_gateway_block_shows_each_default():
    """Each commented [gateway] line says the key's default value."""
    text = EXAMPLE.read_text(encoding="utf-8")
    block = text[text.index("# [gateway]"):text.index("# ---- Agents")]
    for key, info in GatewayConfig.model_fields.items():
        line = re.search(rf"^#\s*{key}\s*=\s*(.+?)\s+#", block, re.MULTILINE)
        assert line, key
        assert tomllib.loads(f"v = {line.group(1)}")["v"] == info.default, key


def test_every_config_key_has_the_docstring_the_settings_screen_shows():
    """Each field of each config model carries a one-line docstring, read from the source when it is shown
    (field_doc), inherited fields included: EndpointConfig's stall keys are StallPolicy's."""
    models = [value for value in vars(config_models).values()
              if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == config_models.__name__]
    assert len(models) >= 12
    for model in models:
        for key in model.model_fields:
            assert field_doc(model, key).strip(), f"{model.__name__}.{key} has no docstring"
    assert field_doc(EndpointConfig, "idle_timeout_s") == field_doc(StallPolicy, "idle_timeout_s") != ""
    assert field_doc(AutoConfig, "min_cap") == "Auto never sets an endpoint's cap below this."
    assert field_doc(AutoConfig, "no_such_key") == ""
