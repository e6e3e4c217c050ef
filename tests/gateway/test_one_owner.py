"""A gateway session's request lives the same life as a workflow agent's attempt (engine/attempt.py): what the
run promises for its agents holds for the harnesses too. Each test here failed while the gateway had a copy of
that life of its own: the budget, the scrubbing of live token events, the figures and the outcomes."""

from __future__ import annotations

import io
import json

import httpx
import msgspec
import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.ui.mirror import RunMirror
from tests.conftest import RawServer, chunk, http_head, sse_chunk, until
from tests.gateway.conftest import chat, post, served, sim_endpoint
from tests.secret_echo import EchoServer, leaks, outputs

pytestmark = pytest.mark.anyio


def messages_body(text: str = "hi", *, max_tokens: int = 6) -> dict:
    return {"model": "sim-model", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": text}]}


async def test_a_sessions_spending_counts_against_the_budget_with_the_notice_the_pause_and_the_refusal():
    # $1 a completion token, 6 tokens a request: the first request spends 6 of 7 (86%: the notice), the second
    # reaches the budget (admissions pause), the third is refused in its API's shape, naming the budget
    async with served(sim={}, run={"budget_usd": 7.0}) as s:
        ep = s.engine.endpoints["sim"]
        ep.price_out_per_mtok = 1_000_000.0
        async with httpx.AsyncClient(timeout=30) as client:
            first = await post(client, s.url + "/chat/completions", chat("one"), headers={"X-Session-ID": "a"})
            assert first.status == 200
            await until(lambda: any(n.title == "Budget" for n in s.of(ev.RunNotice)))
            second = await post(client, s.url + "/messages", messages_body("two"), headers={"X-Session-ID": "b"})
            assert second.status == 200
            await until(lambda: any(n.title == "Budget reached" for n in s.of(ev.RunNotice)))
            assert s.engine.scheduler.paused
            chat_refused = await post(client, s.url + "/chat/completions", chat("three"),
                                      headers={"X-Session-ID": "a"})
            messages_refused = await post(client, s.url + "/messages", messages_body("four"),
                                          headers={"X-Session-ID": "c"})
        assert chat_refused.status == messages_refused.status == 402
        assert "budget" in chat_refused.json()["error"]["message"]
        assert messages_refused.json()["type"] == "error"
        assert "budget_usd" in messages_refused.json()["error"]["message"]
        assert s.engine.budget.spent_usd == pytest.approx(12.0)
        assert s.sim.requests_total == 2  # the two answered: nothing refused went upstream


async def test_a_key_the_model_echoes_through_the_gateway_reaches_no_live_event_journal_or_transcript(
        tmp_path, monkeypatch):
    key = "sk-gatewaykey-0123456789abcdefghijklmnop"
    monkeypatch.setenv("ECHO_UPSTREAM_KEY", key)
    run_dir = tmp_path / "run"
    with EchoServer(loading=False, list_models=True) as echo:
        endpoints = [sim_endpoint(echo.base_url, name=model, model=model, api_key_env="ECHO_UPSTREAM_KEY")
                     for model in ("split", "split3", "reasoning")]
        async with served(endpoints=endpoints, run_dir=run_dir, run={"warmup": "off"}) as s:
            async with httpx.AsyncClient(timeout=30) as client:
                for model in ("split", "split3", "reasoning"):
                    body = {**chat("say the header"), "model": model}
                    answer = await post(client, s.url + "/chat/completions", body, headers={"X-Session-ID": model})
                    assert answer.status == 200
            deltas = s.of(ev.TokenDelta)
        assert f"Bearer {key}" in echo.seen  # the run's key went upstream, and came back in every answer
    live = "".join(d.text + d.reasoning + d.tool for d in deltas)
    assert "the header was" in live and "[redacted]" in live
    assert not leaks(live, key)
    assert not leaks(json.dumps([msgspec.to_builtins(e) for e in s.events]), key)
    assert not leaks(outputs(run_dir), key)


async def test_gateway_traffic_fills_the_figures_a_workflow_fills():
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        for text in ("first", "second question, a little longer"):
            answer = await post(client, s.url + "/chat/completions", chat(text), headers={"X-Session-ID": "f"})
            assert answer.status == 200
        figures = s.engine.figures["sim"]
        # prompt tokens read from a streamed chat (usage asked for the meters), counted per character, and the
        # endpoint's prefill rate measured: what the watchdog's estimate and auto's projections need
        turns = s.of(ev.TurnFinished, "f")
        assert [t.prompt_tokens > 0 for t in turns] == [True, True]
        assert figures.answers == 2 and figures.prompt_chars > 0 and figures.prefill_rate() is not None
        assert s.session("f").st.prompt_tokens == sum(t.prompt_tokens for t in turns)


async def test_an_answer_that_came_in_one_piece_gives_no_ttft_nor_decode_rate_to_the_figures():
    """An unstreamed request's first byte is its answer's last (litellm's completion() and the openai SDK ask so by
    default): read as a time to first token and a decode rate, it gave Auto a TTFT as long as the whole answer and
    a rate of tens of thousands of tokens a second, the prefill rate a prefill that lasted the whole answer, and the
    row and the report such a rate. Only the streamed request's figures count."""
    from cerevisor_tui.ui.mirror import RunMirror

    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        whole = await post(client, s.url + "/chat/completions", chat("in one piece", stream=False, max_tokens=20),
                           headers={"X-Session-ID": "w"})
        assert whole.status == 200 and whole.json()["usage"]["completion_tokens"] == 20
        figures = s.engine.figures["sim"]
        await until(lambda: figures.answers == 1, "the answer's figures")
        assert not figures.rates and not figures.ttfts and figures.prefill_s == 0.0
        # its tokens still count where tokens are counted: Auto's throughput windows read them (a gateway whose
        # harnesses never stream would otherwise never close one, and Auto never move)
        assert s.session("w").st.tokens == 20 and s.engine.auto_feed.signals("sim").tokens == 20
        streamed = await post(client, s.url + "/chat/completions", chat("streamed", max_tokens=20),
                              headers={"X-Session-ID": "w"})
        assert streamed.status == 200
        await until(lambda: figures.answers == 2, "the streamed answer's figures")
        assert len(figures.rates) == 1 and len(figures.ttfts) == 1 and figures.prefill_s > 0
        report = next(x for x in s.engine.report.to_dict()["sessions"] if x["name"] == "w")
    first, second = s.of(ev.TurnFinished, "w")
    assert first.ttft_s is None and second.ttft_s is not None and second.completion_tokens == 20
    rate = second.completion_tokens / (second.duration_s - second.ttft_s)
    assert report["ttft_s"] == round(second.ttft_s, 4) and report["output_tokens_per_s"] == round(rate, 2)
    mirror = RunMirror()
    for event in s.events:
        mirror(event)
    assert mirror.agents["w"].output_tokens_per_s == pytest.approx(rate)


async def test_a_session_whose_request_was_killed_ends_killed_and_a_clean_one_carries_no_error():
    # the simulator stops after two tokens: a request for six stalls past its idle deadline, one for two completes
    # At $1 a prompt token and $2 a completion token, the killed request costs as an agent's would: its prompt, at
    # the tokens per character measured on nothing yet (0.25), and the two tokens it streamed
    async with served(sim={"stall_after_tokens": 2}, stall={"idle_timeout_s": 0.5,
                                                          "extend_when_server_busy": False}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        ep = s.engine.endpoints["sim"]
        ep.price_in_per_mtok, ep.price_out_per_mtok = 1_000_000.0, 2_000_000.0
        killed = await post(client, s.url + "/chat/completions", chat("stalls", max_tokens=6),
                            headers={"X-Session-ID": "k"})
        assert killed.status == 200 and b"idle deadline" in killed.raw  # an error event after its first tokens
        clean = await post(client, s.url + "/chat/completions", chat("fine", max_tokens=2),
                           headers={"X-Session-ID": "ok"})
        assert clean.status == 200 and b"error" not in clean.raw
    await until(lambda: s.exit_code is not None)
    finished = {f.agent: f for f in s.of(ev.AgentFinished)}
    assert finished["k"].status == "killed" and "idle deadline" in finished["k"].error
    assert finished["ok"].status == "completed" and finished["ok"].error == ""
    totals = s.engine.report.totals()
    assert totals.killed == 1 and totals.completed == 1
    sessions = {entry["name"]: entry for entry in s.engine.report.to_dict()["sessions"]}
    assert sessions["k"]["status"] == "killed" and sessions["k"]["kills"][0]["deadline"] == "idle"
    assert sessions["ok"]["status"] == "ended" and sessions["ok"]["error"] == ""
    [kill] = s.of(ev.AgentKilled, "k")
    [meter] = s.of(ev.AgentMeters, "k")
    assert kill.tokens == 2 and meter.cost_usd == round(len("stalls") * 0.25) + 2 * 2
    assert sessions["k"]["cost_usd"] == pytest.approx(meter.cost_usd)


@pytest.mark.parametrize("path", ["/messages", "/responses"])
async def test_a_messages_or_responses_prefill_is_estimated_from_the_endpoints_measured_rate(path):
    # neither API streams llama-server's prompt_progress: the watchdog projects the prefill from the endpoint's
    # measured rate (the first request measures it), as it does for a workflow agent on vLLM
    long_text = " ".join(f"w{i:05d}" for i in range(1400))

    def body(text: str) -> dict:
        if path == "/messages":
            return messages_body(text, max_tokens=2)
        return {"model": "sim-model", "input": text, "max_output_tokens": 2, "stream": True}

    async with served(sim={"prefill_tokens_per_s": 4000.0, "speed": 1.0, "ttft_s": 0.0, "tokens_per_s": 200.0}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for text in ("a short first question", long_text):
            answer = await post(client, s.url + path, body(text), headers={"X-Session-ID": "est"})
            assert answer.status == 200
    first, second = s.of(ev.TurnFinished, "est")
    [estimate] = s.of(ev.PrefillProgress, "est")
    assert estimate.estimated and estimate.attempt == second.attempt
    assert estimate.rate_tok_s == pytest.approx(first.prompt_tokens / first.ttft_s, rel=0.01)
    # its size from its characters, at the tokens per character measured on a short first prompt: near, not exact
    assert 0.5 < estimate.total / second.prompt_tokens < 2


async def llama_answer(reader, writer) -> None:
    """A streamed chat answer as llama-server gives one to a client that asked no usage: its last chunk carries
    `timings` (prompt tokens computed and from its cache, and their milliseconds) and no usage."""
    writer.write(http_head(200, "text/event-stream"))
    for word in ("one", " two"):
        writer.write(chunk(sse_chunk(word)))
    last = {"id": "x", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "timings": {"prompt_n": 300, "cache_n": 900, "prompt_ms": 150.0, "predicted_n": 2,
                        "predicted_per_token_ms": 20.0}}
    writer.write(chunk(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n") + chunk(b""))
    await writer.drain()


async def test_a_llama_servers_timings_give_the_sessions_prompt_tokens_and_fill_the_latency_panel():
    async with RawServer(llama_answer) as upstream, \
            served(endpoints=[sim_endpoint(upstream.base_url, name="llama")],
                   run={"warmup": "off", "metrics_interval_s": 0.05}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat("hi"), headers={"X-Session-ID": "ll"})
        assert answer.status == 200 and answer.text == "one two"
        panel = await until(lambda: [e for e in s.of(ev.LatencySample) if e.source == "timings" and e.prefill])
    [turn] = s.of(ev.TurnFinished, "ll")
    assert turn.prompt_tokens == 1200  # computed and cached, as the server counted them
    assert panel[-1].endpoint == "llama" and panel[-1].prefill.count == 1


async def test_an_answer_that_came_whole_shows_and_prints_no_time_to_first_token():
    """A client that did not ask to stream gets its answer whole: its first bytes are the whole answer's, no first
    token. The headless line says so, and the row's TTFT stays empty; a streamed request's shows as before."""
    lines = io.StringIO()
    async with served(sim={}) as s, httpx.AsyncClient(timeout=30) as client:
        s.engine.subscribe(Printer(lines))
        mirror = RunMirror()
        s.engine.subscribe(mirror)
        whole = await post(client, s.url + "/chat/completions", chat("one", stream=False), headers={"X-Session-ID": "w"})
        streamed = await post(client, s.url + "/chat/completions", chat("two"), headers={"X-Session-ID": "s"})
        assert whole.status == 200 and streamed.status == 200
        await until(lambda: len(s.of(ev.TurnFinished)) == 2, "both answers counted")
    assert [(e.agent, e.streamed) for e in s.of(ev.FirstToken)] == [("w", False), ("s", True)]
    assert mirror.agents["w"].ttft_s is None and mirror.agents["s"].ttft_s is not None
    printed = lines.getvalue()
    assert "w: answer coming after" in printed and "not streamed: no first-token time" in printed
    assert "w: first token after" not in printed and "s: first token after" in printed
