"""Prefill progress against a real llama-server with the real SmolLM2 model: a ~5,000-token prompt outlives an
8 s first-byte deadline on the progress the server streams (`return_progress`, asked because /props says it is
llama.cpp), and the same server SIGSTOPped mid-prefill is killed with a reason that names no progress."""

from __future__ import annotations

import re
import uuid

import httpx
import pytest

from cerevisor_tui.contract import events as ev
from tests.conftest import until
from tests.gateway.conftest import gateway_config, post, served
from tests.integration import servers
from tests.integration.checks import engine_for, run_engine
from tests.integration.conftest import LLAMA_ARGS, Pool
from tests.integration.servers import SMOLLM2, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

WORDS = ("harbour lantern copper meadow signal quartz orchard ember tundra violet canyon marble thistle "
         "beacon saffron glacier willow falcon cobalt prairie").split()


def long_prompt() -> str:
    """About 5,000 SmolLM2 tokens, unlike any earlier prompt (llama-server's prompt cache has none of it)."""
    salt = uuid.uuid4().hex
    words = [f"{WORDS[(i * 7) % len(WORDS)]}{i % 97}" for i in range(1700)]
    return f"{salt}\n" + " ".join(words) + "\nSay one word."


@pytest.fixture(scope="module")
def progress_llama(pool: Pool) -> ServerProcess:
    """llama-server serving SmolLM2 in one slot, its batches 256 tokens (`-b`/`-ub`): a progress chunk every 256
    prompt tokens, as smollm2.sh says (its default 2,048-token batches take minutes each on a loaded 2-core box)."""
    return pool.get("smol-llama-progress",
                    lambda port: servers.smollm2_llama(port, pool.log_dir, 1, [*LLAMA_ARGS, "-b", "256", "-ub", "256"]),
                    servers.LLAMA_READY_S)


def config(server: ServerProcess, idle_s: float) -> dict:
    return {
        "run": {"warmup": "off", "mode": "parallel", "max_concurrency": 1, "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 8.0, "idle_timeout_s": idle_s, "extend_when_server_busy": False},
        "endpoints": [{"name": "llama", "base_url": server.base_url, "model": SMOLLM2}],  # prompt_progress "auto"
        "agents": [{"name": "long", "prompt": long_prompt(), "max_tokens": 4, "retries": 0}],
    }


@pytest.mark.anyio
async def test_a_long_prompt_outlives_its_first_byte_deadline_on_llamas_progress(progress_llama: ServerProcess):
    # at SmolLM2's ~150 tok/s half a minute; on a loaded 2-core box several minutes
    code, seen = await run_engine(engine_for(config(progress_llama, 60.0)), timeout_s=560)
    killed = [e.reason for e in seen if e.kind == "AgentKilled"]
    assert code == 0, killed
    progress = [e for e in seen if e.kind == "PrefillProgress"]
    assert progress and progress[-1].total >= 4000, progress[-1:]
    extended = [e.reason for e in seen if e.kind == "StallExtended"]
    assert extended and any(re.fullmatch(r"prefill \d+%, [\d,]+ tok/s, about [\d.]+ s left", r) for r in extended)
    (done,) = [e for e in seen if e.kind == "TurnFinished"]
    assert done.ttft_s > 8.0, f"the prefill took {done.ttft_s:.1f} s: not past the deadline, nothing tested"


@pytest.mark.anyio
async def test_the_server_stopped_mid_prefill_is_killed_naming_no_progress(progress_llama: ServerProcess, thawed):
    engine = engine_for(config(progress_llama, 6.0))

    def on_event(e) -> None:
        # stopped once its prefill has measurably begun: progress with a rate
        if e.kind == "PrefillProgress" and e.rate_tok_s and not progress_llama.frozen:
            thawed.append(progress_llama)
            progress_llama.freeze()

    try:
        code, seen = await run_engine(engine, on_event, timeout_s=560)
    finally:
        if progress_llama.frozen:
            progress_llama.thaw()
    assert code == 1
    (killed,) = [e for e in seen if e.kind == "AgentKilled"]
    assert killed.deadline == "first_byte"
    assert re.fullmatch(r"no prefill progress for [\d.]+ s \(prefill \d+% of [\d,]+ prompt tokens\)", killed.reason), \
        killed.reason
    await until(lambda: progress_llama.metric("llamacpp:requests_processing") == 0, "the killed request let go",
                timeout=60, interval=0.5)


@pytest.mark.anyio
async def test_vllm_shows_an_estimate_from_its_measured_prefill_rate(smol_vllm: ServerProcess):
    """vLLM tells no progress of a prefill: the first agent's answer measures the rate, and the second's longer
    prompt is shown as an estimate from it."""
    salt = uuid.uuid4().hex
    code, seen = await run_engine(engine_for({
        "run": {"warmup": "off", "mode": "sequential", "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 300.0},
        "endpoints": [{"name": "vllm", "base_url": smol_vllm.base_url, "model": SMOLLM2}],
        "agents": [{"name": "first", "prompt": f"{salt} " + " ".join(WORDS * 20), "max_tokens": 2},
                   {"name": "second", "prompt": f"{salt}x " + " ".join(WORDS * 60), "max_tokens": 2,
                    "depends_on": ["first"]}],
    }), timeout_s=560)
    assert code == 0
    estimates = [e for e in seen if e.kind == "PrefillProgress" and e.agent == "second"]
    assert len(estimates) == 1 and estimates[0].estimated, estimates
    (first,) = [e for e in seen if e.kind == "TurnFinished" and e.agent == "first"]
    assert estimates[0].rate_tok_s == pytest.approx(first.prompt_tokens / first.ttft_s, rel=0.05)
    assert estimates[0].total > first.prompt_tokens


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["messages", "responses"])
async def test_a_gateway_request_in_an_api_without_progress_outlives_its_deadline_on_the_estimate(
        progress_llama: ServerProcess, api: str):
    # llama-server streams prompt_progress in its chat API only: a harness's /v1/messages (Claude Code) or
    # /v1/responses (Codex) request is projected from the endpoint's measured prefill rate, and extended while the
    # server shows life (its decode counter moves with each prompt batch), as a workflow agent's on vLLM is
    config = gateway_config(
        endpoints=[{"name": "llama", "kind": "local", "base_url": progress_llama.base_url, "model": SMOLLM2}],
        run={"warmup": "off", "metrics_interval_s": 0.5},
        stall={"first_byte_timeout_s": 8.0, "idle_timeout_s": 60.0, "extend_when_server_busy": True})

    def body(text: str) -> dict:
        if api == "messages":
            return {"model": SMOLLM2, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": text}]}
        return {"model": SMOLLM2, "max_output_tokens": 16, "stream": True, "input": text}

    async with served(config) as s, httpx.AsyncClient(timeout=600) as client:
        for text in ("Say one word.", long_prompt()):  # the first measures the endpoint's prefill rate
            answer = await post(client, s.url + f"/{api}", body(text), headers={"X-Session-ID": api})
            assert answer.status == 200 and b"deadline" not in answer.raw, answer.raw[-400:]
    assert not s.of(ev.AgentKilled)
    estimates = [e for e in s.of(ev.PrefillProgress, api) if e.estimated]
    assert estimates and estimates[0].total > 3000
    extended = [e.reason for e in s.of(ev.StallExtended, api)]
    assert extended and all("(est.)" in reason for reason in extended), extended
    done = s.of(ev.TurnFinished, api)[-1]
    assert done.ttft_s > 8.0, f"the prefill took {done.ttft_s:.1f} s: not past the deadline, nothing tested"
