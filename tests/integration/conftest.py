"""Session-wide real servers (each started once and shared, since vLLM takes 25-50 s to load) and helpers.

Nothing here skips: a server that is not set up fails the tests that need it, with the command that
sets it up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w

from tests.integration import servers
from tests.integration.servers import ServerProcess

PRESSURE_ARGS = ["--num-gpu-blocks-override", "32", "--max-num-seqs", "4"]


class Pool:
    """The servers of this session by role; each started on first use and stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: dict[str, ServerProcess] = {}

    def start_early(self, role: str, make: Callable[[int], ServerProcess]) -> None:
        """Start a server that later tests will need, without waiting for it (it loads meanwhile)."""
        if role not in self.servers:
            try:
                self.servers[role] = make(servers.free_port()).start()
            except servers.SetupMissing:
                pass  # the test that needs it fails with the reason

    def get(self, role: str, make: Callable[[int], ServerProcess], ready_s: float) -> ServerProcess:
        server = self.servers.get(role)
        if server is None or server.proc is None or server.proc.poll() is not None:
            try:
                server = make(servers.free_port())
            except servers.SetupMissing as exc:
                pytest.fail(str(exc), pytrace=False)
            self.servers[role] = server.start()
        if server.frozen:
            server.thaw()
        if server.ready_after_s is None:
            try:
                server.wait_ready(ready_s)
            except RuntimeError as exc:
                server.stop()
                del self.servers[role]
                pytest.fail(str(exc), pytrace=False)
        return server

    def adopt(self, role: str, server: ServerProcess) -> None:
        """Keep a server a test started itself for the rest of the session."""
        if role in self.servers:
            server.stop()
        else:
            self.servers[role] = server

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        servers.stop_all()


# vLLM 0.32 answers a named tool_choice (structured output, test_mcp_real.py) only with a tool parser set, which
# it takes only with auto tool choice: "pythonic" needs no special tokens, so the tiny model's tokenizer passes.
# A request without tools is not touched by either.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]


def _default_vllm(log_dir: Path) -> Callable[[int], ServerProcess]:
    """vLLM as the peers script starts it, plus --enable-log-requests so aborts show in its log, and TOOL_ARGS."""
    return lambda port: servers.vllm(port, log_dir, ["--enable-log-requests", *TOOL_ARGS])


@pytest.fixture(scope="session")
def pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    log_dir = Path(os.environ.get("CEREVISOR_INTEGRATION_LOGS") or tmp_path_factory.mktemp("server-logs"))
    p = Pool(log_dir)
    # vLLM takes 25-50 s to load: when a selected test needs the default instance, let it load while
    # the tests before it run.
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    if "vllm_server" in wanted:
        p.start_early("vllm", _default_vllm(log_dir))
    if "smol_vllm" in wanted:
        p.start_early("smol-vllm", lambda port: servers.smollm2_vllm(port, log_dir, ["--enable-log-requests"]))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="session")
def vllm_server(pool: Pool) -> ServerProcess:
    return pool.get("vllm", _default_vllm(pool.log_dir), servers.VLLM_READY_S)


@pytest.fixture(scope="session")
def vllm_pressure(pool: Pool) -> ServerProcess:
    """vLLM with a 4096-token KV cache (32 blocks of 128) and 4 sequences at once."""
    return pool.get("vllm-pressure", lambda port: servers.vllm(port, pool.log_dir, PRESSURE_ARGS, "vllm-pressure"),
                    servers.VLLM_READY_S)


# llama-server answers HTTP with max(np + 2, cores - 1) threads by default, and every open request, a
# deferred one too, holds one: with more requests open than that, /health and /metrics wait until a
# stream ends, and the watchdog cannot see the queue. docs/servers.md (llama.cpp) says to raise it; so do we.
LLAMA_ARGS = ["--threads-http", "32"]


@pytest.fixture(scope="session")
def llama(pool: Pool) -> ServerProcess:
    return pool.get("llama", lambda port: servers.llama_server(port, pool.log_dir, LLAMA_ARGS), servers.LLAMA_READY_S)


@pytest.fixture(scope="session")
def smol_vllm(pool: Pool) -> ServerProcess:
    """vLLM serving SmolLM2 (a real model), logging each request's id and its abort."""
    return pool.get("smol-vllm", lambda port: servers.smollm2_vllm(port, pool.log_dir, ["--enable-log-requests"]),
                    servers.VLLM_READY_S)


@pytest.fixture(scope="session")
def smol_llama(pool: Pool) -> ServerProcess:
    """llama-server serving SmolLM2, 2 slots."""
    # --n-predict: a harness that sends no max_tokens is answered in at most 1,024 tokens; SmolLM2 sampled hot sometimes
    # runs on to its context's end (2 slots x 2,700+ tokens at 12 tokens/s in one CI run). A request's own max_tokens
    # overrides it: opencode and Claude Code send 32,000, so their tests set their own cap
    return pool.get("smol-llama", lambda port: servers.smollm2_llama(port, pool.log_dir, 2,
                                                                     [*LLAMA_ARGS, "--n-predict", "1024"]),
                    servers.LLAMA_READY_S)


@pytest.fixture(scope="session")
def smol_llama_greedy(pool: Pool) -> ServerProcess:
    """llama-server serving SmolLM2 greedily to a client that sends no temperature (Claude Code, thinking on).

    SmolLM2 sampled hot ran on to its slot's end on 10-45% of Claude Code's short prompts (whatever the prompt
    tried); Claude Code then resumes with the whole answer in the prompt, past the slot's 8,192 tokens (HTTP 400, in
    CI). Greedy, a given prompt is answered the same each time: the Claude Code tests pick prompts measured to end
    (tests/integration/test_gateway_harnesses.py)."""
    return pool.get("smol-llama-greedy", lambda port: servers.smollm2_llama(port, pool.log_dir, 2,
                                                                            [*LLAMA_ARGS, "--temp", "0"]),
                    servers.LLAMA_READY_S)


@pytest.fixture
def thawed(request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    """Servers a test freezes; thawed again whatever happens."""
    frozen: list[ServerProcess] = []
    yield frozen
    for server in frozen:
        if server.frozen:
            server.thaw()


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(tomli_w.dumps(data))
    return path


def cerevisor(*args: str, timeout: float = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
    """The installed product, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "cerevisor_tui", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def workflow(base_url: str, *, endpoint: str = "box") -> dict[str, Any]:
    """Two waves, multi-turn: three scouts in parallel, then a judge and a writer that use their answers."""
    agents = [
        {"name": "scout_a", "system": "You are terse.", "prompt": "List three risks of the plan.",
         "turns": ["Expand the first risk.", "Summarize in one line."], "max_tokens": 24},
        {"name": "scout_b", "prompt": "List three strengths of the plan.", "turns": ["Which matters most?"],
         "max_tokens": 20},
        {"name": "scout_c", "prompt": "Name one open question.", "max_tokens": 16},
        {"name": "judge", "depends_on": ["scout_a", "scout_b"], "max_tokens": 24,
         "prompt": "Risks: {{ scout_a.output }}\nStrengths: {{ scout_b.output }}\nWeigh them.",
         "turns": ["Decide: go or no-go?"]},
        {"name": "writer", "depends_on": ["scout_c"], "max_tokens": 16,
         "prompt": "Rewrite as a question for the team: {{ scout_c.output }}"},
    ]
    for agent in agents:
        agent["retries"] = 0
    return {
        "run": {"warmup": "off", "mode": "parallel", "max_concurrency": 3, "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 120.0, "idle_timeout_s": 60.0},
        "endpoints": [{"name": endpoint, "base_url": base_url, "kind": "local", "model": servers.MODEL}],
        "agents": agents,
    }
