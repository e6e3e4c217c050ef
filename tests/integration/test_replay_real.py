"""`replay run` against real servers with a real model (SmolLM2-135M on vLLM and llama-server): a small agentic
trace, scaled to their 8K context, completes closed loop, and the report's prefix-hit rate is the server's own
counters over the replay, which see the trace's sharing (each turn a prefix of the next)."""

from __future__ import annotations

import httpx
import pytest

from cerevisor_tui.endpoints.metrics import prefix_hit_rate, read_server
from cerevisor_tui.replay.run import ReplaySettings, replay
from cerevisor_tui.replay.trace import BLOCK_TOKENS, TraceTurn
from tests.integration.servers import SMOLLM2, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.timeout(900)]


def small_agentic_trace() -> list[TraceTurn]:
    """Two sessions of four turns, each turn its session's prompt so far plus one new 512-token block, the first
    block shared by both (a harness's tools and system prompt): at most 4 x 512 tokens of the file's words, which
    SmolLM2's tokenizer makes about twice as many tokens, inside its 8K context."""
    turns = []
    for session, own in (("s1", 100), ("s2", 200)):
        blocks = [1]
        for number in range(1, 5):
            turns.append(TraceTurn(session_id=session, turn=number, input_length=BLOCK_TOKENS, output_length=8,
                                   hash_ids=list(blocks), delay_ms=0.0, parent=None))
            blocks.append(own + number)
    return turns


@pytest.mark.parametrize("which", ["smol_vllm", "smol_llama"])
async def test_a_small_agentic_replay_completes_and_reports_the_servers_own_prefix_hits(
        which: str, request: pytest.FixtureRequest):
    server: ServerProcess = request.getfixturevalue(which)
    turns = small_agentic_trace()
    async with httpx.AsyncClient(timeout=60) as client:
        before = (await read_server(client, server.base_url)).metrics
        report = await replay(turns, server.base_url, ReplaySettings(concurrency=2, model=SMOLLM2))
        after = (await read_server(client, server.base_url)).metrics
    assert report.turns_completed == report.turns == 8, report.first_error
    assert report.sessions_completed == 2 and report.output_tokens > 0
    # the report's rate is the server's own counters over the replay (nothing else was sent meanwhile)
    assert before is not None and after is not None
    assert report.prefix_hit_rate == pytest.approx(prefix_hit_rate(before, after), abs=1e-9)
    # each turn extends the one before: most of the prompt tokens after the first are the cache's
    assert report.prefix_hit_rate is not None and report.prefix_hit_rate > 0.3
    assert report.ttft["p50_s"] is not None and report.interactivity["p50_tokens_per_s"]
