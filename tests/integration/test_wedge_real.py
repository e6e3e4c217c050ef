"""A wedged vLLM, for real: SmolLM2 on vLLM with its engine-core process SIGSTOPped while the API process still
answers /health with 200 (vllm-project/vllm #39863's shape). The product, run as a user runs it, catches the
request as wedged long before its first-byte deadline; the engine core is sent SIGCONT whatever happens."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration import servers
from tests.integration.conftest import cerevisor, jsonl, write_config
from tests.integration.servers import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def engine_core_pid(server: ServerProcess) -> int:
    """The server's EngineCore process: in its session (the server was started in a new one), its title set
    by vLLM ("VLLM::EngineCore")."""
    assert server.proc is not None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        session = int(stat.rsplit(")", 1)[1].split()[3])  # after "(comm)": state ppid pgrp session
        if session == server.proc.pid and "EngineCore" in cmdline:
            found.append(int(entry.name))
    assert len(found) == 1, f"one EngineCore process in {server.name}'s session, found {found}"
    return found[0]


@pytest.fixture
def stopped_engine_core(smol_vllm: ServerProcess) -> Iterator[int]:
    """vLLM's engine core SIGSTOPped for the test, and sent SIGCONT after it whatever happens."""
    pid = engine_core_pid(smol_vllm)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def test_vllm_with_its_engine_core_stopped_is_caught_as_wedged_long_before_the_first_byte_deadline(
    smol_vllm: ServerProcess, stopped_engine_core: int, tmp_path: Path
):
    # the API process still says all is well
    assert httpx.get(f"{smol_vllm.root_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{smol_vllm.root_url}/metrics", timeout=10).status_code == 200
    first_byte_s, wedge_s = 600.0, 15.0
    config = write_config(
        tmp_path / "wedged.toml",
        {
            "run": {"warmup": "off", "mode": "parallel", "max_concurrency": 1, "metrics_interval_s": 1.0},
            "stall": {"first_byte_timeout_s": first_byte_s, "warn_at": [0.5], "wedge_timeout_s": wedge_s},
            "endpoints": [
                {"name": "box", "base_url": smol_vllm.base_url, "kind": "local", "model": servers.SMOLLM2}
            ],
            "agents": [{"name": "a", "prompt": "Say hello.", "max_tokens": 8, "retries": 0}],
        },
    )
    proc = cerevisor(
        "run",
        str(config),
        "--jsonl",
        "--report",
        str(tmp_path / "report.json"),
        "--run-dir",
        str(tmp_path / "run"),
        timeout=first_byte_s,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = jsonl(proc.stdout)
    wedged = [e for e in events if e["event"] == "ServerWedged"]
    assert [(w["rule"], w["agents"]) for w in wedged] == [("frozen", ["a"])], proc.stdout[-3000:]
    assert wedged[0]["reason"].startswith("server wedged: no progress on any request for ")
    started = next(e for e in events if e["event"] == "AgentStarted")
    killed = next(e for e in events if e["event"] == "AgentKilled")
    assert (killed["deadline"], killed["reason"]) == ("wedge", wedged[0]["reason"])
    # judged on its own rule: no sooner than it, and nowhere near the first-byte deadline (no warning at half)
    assert wedge_s <= killed["t"] - started["t"] < first_byte_s / 2
    assert not [e for e in events if e["event"] in ("StallWarning", "FirstToken")]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["agents"][0]["status"] == "killed" and report["agents"][0]["error"] == wedged[0]["reason"]
    assert [w["rule"] for w in report["endpoints"][0]["wedges"]] == ["frozen"]
    journal = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"event":"ServerWedged"' in journal


def test_vllm_serves_again_once_its_engine_core_goes_on(smol_vllm: ServerProcess):
    """After the test above sent SIGCONT: the same server answers (the wedge was the stop, nothing else)."""
    r = httpx.post(
        f"{smol_vllm.base_url}/chat/completions",
        timeout=300,
        json={
            "model": servers.SMOLLM2,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
