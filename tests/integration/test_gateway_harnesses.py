"""Harnesses no one here wrote, through `cerevisor-tui gateway --headless` (the product as an operator runs it) in
front of llama-server serving SmolLM2: litellm's completion(), mini-swe-agent on a multi-turn task, Claude Code
(`claude -p`), Codex CLI (`codex exec`), opencode (`opencode run`) and aider (`aider --message`). Each session must show up in the run's journal as a row with its
harness and API, and each harness must end by itself with the model's answer.

The Python harnesses live in venvs of their own ($PEERS_DIR/harness: mini-swe-agent, which brings litellm;
$PEERS_DIR/aider: aider-chat, which pins its own) and
the node ones under $PEERS_DIR/npm (`@anthropic-ai/claude-code`, `@openai/codex`, `opencode-ai`), both made by
.ci/integration.sh."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.ui.mirror import RunMirror
from cerevisor_tui.ui.widgets.agent_table import agent_row
from tests.conftest import wait_until
from tests.gateway.conftest import Headless
from tests.integration import servers
from tests.integration.servers import PEERS_DIR, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
HARNESS_PYTHON = PEERS_DIR / "harness" / "bin" / "python"
AIDER = PEERS_DIR / "aider" / "bin" / "aider"
NODE_BIN = PEERS_DIR / "npm" / "node_modules" / ".bin"


def need(path: Path, what: str) -> None:
    if not path.exists():
        pytest.fail(f"{what} is not installed ({path} is missing): run .ci/integration.sh", pytrace=False)


class Gateway:
    def __init__(self, headless: Headless, run_dir: Path) -> None:
        self.headless, self.run_dir = headless, run_dir
        self.url = headless.url()

    def events(self, kind: str) -> list[dict]:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e.get("event") == kind]

    def wait_ended(self, name: str, within_s: float = 60.0) -> None:
        """Until each request of session `name` has its end in the journal: a harness may exit with a side request
        still in flight (its connection closes with it), and the gateway tells that end ("client gone") only once it
        sees the disconnect, a moment after the harness's exit."""
        def ended() -> bool:
            started = {e["attempt"] for e in self.events("AgentStarted") if e["agent"] == name}
            return started <= {e["attempt"] for e in self.events("TurnFinished") + self.events("AgentKilled")
                               if e["agent"] == name}

        wait_until(ended, f"each request of {name} ended in the journal", timeout=within_s, interval=0.2)

    def session(self, name: str) -> dict:
        found = [e for e in self.events("SessionOpened") if e["agent"] == name]
        assert found, [e["agent"] for e in self.events("SessionOpened")]
        return found[0]


def headless_gateway(upstream: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    run_dir = tmp_path_factory.mktemp("gw") / "run"
    headless = Headless("--upstream", upstream.base_url, "--model", servers.SMOLLM2, "--listen", "127.0.0.1:0",
                        "--run-dir", str(run_dir))
    try:
        yield Gateway(headless, run_dir)
    finally:
        code, err = headless.end()
        assert code == 0, err


@pytest.fixture(scope="module")
def gateway(smol_llama: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    yield from headless_gateway(smol_llama, tmp_path_factory)


@pytest.fixture(scope="module")
def claude_gateway(smol_llama_greedy: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """In front of SmolLM2 answering greedily: Claude Code sends no temperature (CLAUDE_QUESTION below says why)."""
    yield from headless_gateway(smol_llama_greedy, tmp_path_factory)


def harness_python(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    need(HARNESS_PYTHON, "the Python harnesses' venv (mini-swe-agent, litellm)")
    env = {**os.environ, "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "MSWEA_SILENT_STARTUP": "1"}
    return subprocess.run([str(HARNESS_PYTHON), "-c", textwrap.dedent(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_litellm_completion_through_the_gateway(gateway: Gateway):
    proc = harness_python("""
        import sys, litellm
        r = litellm.completion(model="openai/whatever", api_base=sys.argv[1], api_key="unused",
                               messages=[{"role": "user", "content": "Name three colours."}], max_tokens=40,
                               extra_headers={"X-Session-ID": "litellm-1"})
        print(r.choices[0].message.content)
        """, gateway.url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert gateway.session("litellm-1")["api"] == "chat"
    done = [e for e in gateway.events("TurnFinished") if e["agent"] == "litellm-1"]
    assert len(done) == 1 and done[0]["completion_tokens"] > 0



def test_mini_swe_agent_runs_a_multi_turn_task_through_the_gateway(gateway: Gateway, tmp_path: Path):
    proc = harness_python("""
        import sys, yaml
        from pathlib import Path
        import minisweagent
        from minisweagent.agents.default import DefaultAgent
        from minisweagent.environments.local import LocalEnvironment
        from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel
        config = yaml.safe_load((Path(minisweagent.__file__).parent / "config" / "mini_textbased.yaml").read_text())
        model = LitellmTextbasedModel(model_name="openai/smollm2", cost_tracking="ignore_errors",
                                      model_kwargs={"api_base": sys.argv[1], "api_key": "unused", "max_tokens": 120,
                                                    "extra_headers": {"X-Session-ID": "mini-1"}})
        agent_config = {**config["agent"], "step_limit": 3, "cost_limit": 0}
        agent = DefaultAgent(model, LocalEnvironment(cwd=sys.argv[2]), **agent_config)
        result = agent.run("Create a file named hello.txt that contains the word hello, then submit.")
        print("EXIT", result.get("exit_status"), "CALLS", agent.n_calls)
        """, gateway.url, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    exit_line = next(line for line in proc.stdout.splitlines() if line.startswith("EXIT"))
    calls = int(exit_line.split()[-1])
    assert calls >= 2, proc.stdout[-2000:]  # more than one turn: the conversation grew through the gateway
    session = gateway.session("mini-1")
    assert session["harness"].startswith("openai-python") or session["harness"].startswith("litellm")
    done = [e for e in gateway.events("TurnFinished") if e["agent"] == "mini-1"]
    assert len(done) == calls
    transcript = [json.loads(x) for x in (gateway.run_dir / "transcripts" / "mini-1.jsonl").read_text().splitlines()]
    # each request's new messages only: the system prompt and the task once, however many turns
    assert sum(1 for m in transcript if m.get("role") == "system") == 1


def node_harness(name: str, args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600):
    binary = NODE_BIN / name
    need(binary, f"{name} (npm)")
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, "HOME": str(cwd), **env}, stdin=subprocess.DEVNULL)


# Claude Code resumes an answer that ends at its output cap, the answer in the prompt, and fails the turn after three
# ("response exceeded the N output token maximum"): the cap keeps a rambling answer's resumes within SmolLM2's 8,192
# tokens and the failure quick. Its prompt carries today's date and a hash of the prompt, so a greedy answer is the
# same all day but not from day to day: this question ended within 13 tokens for each of 200 dates and hashes tried
# with --bare, and within 9 for 12 of 12 dates and working directories with Claude Code's full system prompt
# (SmolLM2 sampled hot ran past 300 tokens on 10-45% of the prompts tried, whatever the prompt).
CLAUDE_ENV = {"ANTHROPIC_API_KEY": "unused-client-key", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
              "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256"}
CLAUDE_QUESTION = "What colour is grass? Answer with one word."


def test_claude_code_through_the_gateway(claude_gateway: Gateway, tmp_path: Path):
    """Its row is named by its path label (README: ANTHROPIC_BASE_URL=…/a/NAME), its own session id kept beside it;
    a side request it sends while its turn streams is a request of that one row, shown apart from the turn."""
    gateway = claude_gateway
    root = gateway.url.removesuffix("/v1")
    proc = node_harness("claude", ["-p", CLAUDE_QUESTION, "--bare", "--tools", "", "--system-prompt",
                                   "Answer with one word.", "--model", "claude-sonnet-4-5"],
                        {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": root + "/a/claude-1",
                         "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert proc.stdout.strip()
    opened = gateway.session("claude-1")
    assert opened["source"] == "path" and opened["harness"].startswith("claude-code") and opened["api"] == "messages"
    assert opened["own_id"], opened  # Claude Code's own session id, beside the row
    assert "What colour is grass" in opened["topic"], opened
    started = [e for e in gateway.events("AgentStarted") if e["agent"] == "claude-1"]
    assert started and {e["model_sent"] for e in started} == {servers.SMOLLM2}
    assert_requests_apart(gateway, "claude-1")


def assert_requests_apart(gateway: Gateway, name: str) -> int:
    """Each request of the session is an attempt of its own, ended on its own; where two overlapped (a side request
    while the turn streamed), the console's mirror, fed the run's journal, kept its row on the older one and counted
    both."""
    gateway.wait_ended(name)
    lines = (gateway.run_dir / "events.jsonl").read_bytes().splitlines()
    mirror, overlapped = RunMirror(), 0
    for line in lines:
        event = ev.decode_event(line)
        mirror(event)
        agent = mirror.agents.get(name)
        if agent is not None and len(agent.in_flight) > 1:
            overlapped += 1
            assert agent.attempt is next(iter(agent.in_flight.values()))  # the row describes the oldest
            assert agent_row(agent, (), "", event.t).status.endswith(f"×{len(agent.in_flight)}")
    started = [e["attempt"] for e in gateway.events("AgentStarted") if e["agent"] == name]
    ended = [e["attempt"] for e in gateway.events("TurnFinished") + gateway.events("AgentKilled") if e["agent"] == name]
    assert sorted(started) == sorted(set(ended)) == list(range(1, len(started) + 1)), (started, ended)
    how = [e.get("finish_reason") or f"killed at {e['deadline']}" for e in gateway.events("TurnFinished")
           + gateway.events("AgentKilled") if e["agent"] == name]
    print(f"{name}: {len(started)} request(s) ({', '.join(how)}), {overlapped} event(s) with two or more in flight")
    return overlapped


def test_claude_codes_side_request_shows_apart_from_its_turn(claude_gateway: Gateway, tmp_path: Path):
    """Without --bare, Claude Code (2.1) asks for its session's title in a side request while its turn goes: two
    requests of one row in flight, the row counting both (`×2`) and each ended on its own."""
    gateway = claude_gateway
    root = gateway.url.removesuffix("/v1")
    proc = node_harness("claude", ["-p", CLAUDE_QUESTION, "--tools", "", "--model", "claude-sonnet-4-5"],
                        {**CLAUDE_ENV, "ANTHROPIC_BASE_URL": root + "/a/claude-2"}, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    assert gateway.session("claude-2")["source"] == "path"
    assert assert_requests_apart(gateway, "claude-2") > 0  # the side request overlapped the turn


def test_codex_cli_through_the_gateway(gateway: Gateway, tmp_path: Path):
    (tmp_path / ".codex").mkdir()
    labelled = gateway.url.replace("/v1", "/a/codex-1/v1")
    provider = f'{{name="cerevisor gateway", base_url="{labelled}", wire_api="responses", env_key="GW_KEY"}}'
    proc = node_harness("codex", ["exec", "--skip-git-repo-check", "-c", 'model_provider="cerevisor"',
                                  "-c", f"model_providers.cerevisor={provider}", "-c", 'model="gpt-5-codex"',
                                  "Name three colours."],
                        {"GW_KEY": "unused-client-key", "CODEX_HOME": str(tmp_path / ".codex")}, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    opened = gateway.session("codex-1")  # named by its path label, not its own session id
    assert opened["source"] == "path" and opened["harness"].startswith("codex") and opened["api"] == "responses"
    assert_requests_apart(gateway, "codex-1")
    # it hangs up at response.completed, before the upstream's stream ends: still an answered request
    done = [e for e in gateway.events("TurnFinished") if e["agent"] == "codex-1"]
    assert done and "client gone" not in {e["finish_reason"] for e in done}, done


def test_opencode_through_the_gateway(gateway: Gateway, tmp_path: Path):
    config = {"$schema": "https://opencode.ai/config.json", "model": "cerevisor/qwen3-coder",
              "provider": {"cerevisor": {"npm": "@ai-sdk/openai-compatible", "name": "cerevisor gateway",
                                         "options": {"baseURL": gateway.url.replace("/v1", "/a/opencode-1/v1")},
                                         "models": {"qwen3-coder": {"limit": {"context": 8192, "output": 512}}}}}}
    # limit.output is the max_tokens it sends (32,000 without it, past llama-server's --n-predict): SmolLM2 sampled hot
    # once ran on to its slot's end, 5,979 tokens in 509 s of a 600 s timeout
    (tmp_path / "opencode.json").write_text(json.dumps(config))
    # named outright: run from pytest's temp dir, opencode read no opencode.json from its working directory
    proc = node_harness("opencode", ["run", "Name three colours."],
                        {"OPENCODE_CONFIG": str(tmp_path / "opencode.json")}, tmp_path)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    opened = gateway.session("opencode-1")  # its path label wins over the x-session-id it sends, kept beside it
    assert opened["source"] == "path" and opened["harness"].startswith("opencode") and opened["api"] == "chat"
    assert opened["own_id"].startswith("ses_"), opened
    done = [e for e in gateway.events("TurnFinished") if e["agent"] == "opencode-1"]
    assert done and all(e["completion_tokens"] > 0 for e in done)  # its title request and its answer, one row
    assert_requests_apart(gateway, "opencode-1")


def test_aider_one_shot_through_the_gateway(gateway: Gateway, tmp_path: Path):
    need(AIDER, "aider (pip install aider-chat)")
    (tmp_path / "calc.py").write_text("def add(a, b):\n    pass\n")
    proc = subprocess.run([str(AIDER), "--openai-api-base", gateway.url.replace("/v1", "/a/aider-1/v1"),
                           "--model", "openai/qwen3-coder", "--message", "Name three colours.", "--yes-always",
                           "--no-git", "--no-check-update", "--no-show-model-warnings", "--no-analytics",
                           "--map-tokens", "0"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          stdin=subprocess.DEVNULL,
                          env={**os.environ, "HOME": str(tmp_path), "OPENAI_API_KEY": "unused-client-key",
                               "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    opened = gateway.session("aider-1")
    assert opened["source"] == "path" and opened["harness"] == "aider"  # its label named its row; its words, it
    done = [e for e in gateway.events("TurnFinished") if e["agent"] == "aider-1"]
    assert done and done[0]["completion_tokens"] > 0
