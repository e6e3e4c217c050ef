"""Prefill progress against a real llama-server with the real SmolLM2 model: a ~5,000-token prompt outlives an
8 s first-byte deadline on the progress the server streams (`return_progress`, asked because /props says it is
llama.cpp), and the same server SIGSTOPped mid-prefill is killed with a reason that names no progress."""

from __future__ import annotations

import re
import uuid

import pytest

from tests.conftest import until
from tests.integration.checks import engine_for, run_engine
from tests.integration.servers import SMOLLM2, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORDS = ("harbour lantern copper meadow signal quartz orchard ember tundra violet canyon marble thistle "
         "beacon saffron glacier willow falcon cobalt prairie").split()


def long_prompt() -> str:
    """About 5,000 SmolLM2 tokens, unlike any earlier prompt (llama-server's prompt cache has none of it)."""
    salt = uuid.uuid4().hex
    words = [f"{WORDS[(i * 7) % len(WORDS)]}{i % 97}" for i in range(2400)]
    return f"{salt}\n" + " ".join(words) + "\nSay one word."


def config(server: ServerProcess, idle_s: float) -> dict:
    return {
        "run": {"mode": "parallel", "max_concurrency": 1, "metrics_interval_s": 0.5},
        "stall": {"first_byte_timeout_s": 8.0, "idle_timeout_s": idle_s, "extend_when_server_busy": False},
        "endpoints": [{"name": "llama", "base_url": server.base_url, "model": SMOLLM2}],  # prompt_progress "auto"
        "agents": [{"name": "long", "prompt": long_prompt(), "max_tokens": 4, "retries": 0}],
    }


@pytest.mark.anyio
async def test_a_long_prompt_outlives_its_first_byte_deadline_on_llamas_progress(smol_llama: ServerProcess):
    code, seen = await run_engine(engine_for(config(smol_llama, 60.0)))
    killed = [e.reason for e in seen if e.kind == "AgentKilled"]
    assert code == 0, killed
    progress = [e for e in seen if e.kind == "PrefillProgress"]
    assert progress and progress[-1].total >= 4000, progress[-1:]
    extended = [e.reason for e in seen if e.kind == "StallExtended"]
    assert extended and any(re.fullmatch(r"prefill \d+%, [\d,]+ tok/s, about [\d.]+ s left", r) for r in extended)
    (done,) = [e for e in seen if e.kind == "TurnFinished"]
    assert done.ttft_s > 8.0, f"the prefill took {done.ttft_s:.1f} s: not past the deadline, nothing tested"


@pytest.mark.anyio
async def test_the_server_stopped_mid_prefill_is_killed_naming_no_progress(smol_llama: ServerProcess, thawed):
    engine = engine_for(config(smol_llama, 6.0))

    def on_event(e) -> None:
        # stopped once its prefill has measurably begun: progress with a rate
        if e.kind == "PrefillProgress" and e.rate_tok_s and not smol_llama.frozen:
            thawed.append(smol_llama)
            smol_llama.freeze()

    try:
        code, seen = await run_engine(engine, on_event)
    finally:
        if smol_llama.frozen:
            smol_llama.thaw()
    assert code == 1
    (killed,) = [e for e in seen if e.kind == "AgentKilled"]
    assert killed.deadline == "first_byte"
    assert re.fullmatch(r"no prefill progress for [\d.]+ s \(prefill \d+% of [\d,]+ prompt tokens\)", killed.reason), \
        killed.reason
    await until(lambda: smol_llama.metric("llamacpp:requests_processing") == 0, "the killed request let go",
                timeout=60, interval=0.5)
