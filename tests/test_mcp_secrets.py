"""What an MCP server gives the run, held to the run's rules on secrets and size: a key in a tool result is
scrubbed before the result is cut, a server's stderr reaches `mcp-<name>.log` scrubbed and bounded, and a
message over the bound is one call's clear error, not a run that stops."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.test_tools import kinds, run, workflow

KEY_ENV = "CEREVISOR_CANARY"


def canary() -> str:
    return "sk" + os.urandom(12).hex()  # no fixed start: any 8 characters of it are its own


def all_text(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())


@pytest.mark.anyio
async def test_a_key_that_the_result_cut_splits_is_scrubbed_whole_before_the_cut(tmp_path, monkeypatch):
    key = canary()
    monkeypatch.setenv(KEY_ENV, key)
    # "echo: " + 84 characters, then the key: the cut at 100 falls 10 characters into it
    data = workflow({"echo": {"text": "a" * 84 + key + " and more"}}, server={"max_result_chars": 100})
    data["endpoints"][0]["api_key_env"] = KEY_ENV
    engine, seen, code = await run(data, tmp_path)
    assert code == 0, kinds(seen, "AgentFinished")
    tool = next(m["content"] for m in engine.agents["a0"].messages if m["role"] == "tool")
    assert tool.startswith("echo: " + "a" * 84 + "[redac") and "[result cut:" in tool
    start = key[:8]  # the shortest start of a key the scrubber takes out
    assert start not in tool  # what the model is sent
    for event in seen:
        assert start not in json.dumps(event.to_dict(), default=str), event.kind
    files = all_text(tmp_path)
    assert "[result cut:" in files and start not in files  # transcripts and the journal
