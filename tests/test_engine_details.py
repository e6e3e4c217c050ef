"""Engine details: reasoning and tool-call deltas, Retry-After, a kill seen by the simulator,
and the config lookup order."""

from __future__ import annotations

import functools
import json
import time

import anyio
import pytest

from cerevisor_tui.config import SimSettings, validate
from cerevisor_tui.config.paths import CONFIG_ENV, find_config
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.engine.engine import Engine
from cerevisor_tui.sim import SimServer
from cerevisor_tui.ui.mirror import RunMirror
from tests.conftest import RawServer, chunk, http_head, until


def data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def delta(**fields) -> bytes:
    return data({"choices": [{"index": 0, "delta": fields, "finish_reason": None}]})


def one_agent(url: str, **stall) -> Engine:
    return Engine(validate({"stall": {"idle_timeout_s": 0.6, **stall},
                            "endpoints": [{"name": "e", "base_url": url, "model": "m"}],
                            "agents": [{"name": "a", "prompt": "p", "retries": 1}]}))


async def run_one(handler, seen: list | None = None) -> tuple[Engine, list]:
    """One agent against a raw server that answers with `handler`: the engine and every event (into `seen`, which
    the handler may watch); the run completes."""
    async with RawServer(handler) as srv:
        engine = one_agent(srv.base_url)
        seen = [] if seen is None else seen
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    return engine, seen


@pytest.mark.anyio
async def test_reasoning_and_tool_call_deltas_are_signs_of_life_and_are_shown():
    async def thinker(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        parts = [delta(role="assistant", content=""), delta(reasoning_content="think "), delta(reasoning="more "),
                 delta(tool_calls=[{"index": 0, "function": {"name": "search", "arguments": ""}}]),
                 delta(tool_calls=[{"index": 0, "function": {"arguments": '{"q": 1}'}}]), delta(content="answer")]
        for part in parts:
            writer.write(chunk(part))
            await writer.drain()
            await anyio.sleep(0.4)  # 0.4 s apart, idle deadline 0.6 s: only tokens of every kind keep it alive
        writer.write(chunk(data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    engine, seen = await run_one(thinker)
    deltas = [e for e in seen if e.kind == "TokenDelta"]
    assert [d.reasoning for d in deltas][:2] == ["think ", "more "]
    assert deltas[2].tool == "search" and deltas[3].tool == '{"q": 1}'
    assert engine.agents["a"].output == "answer"
    first = next(e for e in seen if e.kind == "FirstToken")
    assert first.ttft_s < 1.0  # reasoning counted as the first token
    assert not any(e.kind == "AgentKilled" for e in seen)
    transcript = next(e for e in seen if e.kind == "MessageRecorded" and e.role == "assistant")
    assert transcript.reasoning == "think more " and transcript.content == "answer"


@pytest.mark.anyio
async def test_the_chunks_of_one_read_become_one_event_per_run_of_a_field():
    """A server that packs many chunks into one write (a busy vLLM for a client that fell behind): the
    consecutive content chunks of a read make one TokenDelta that counts them, a change of field starts
    another, and nothing is lost or reordered."""
    def usage(completion: int) -> bytes:
        return data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion}})

    async def packer(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        first = [delta(content="a"), delta(content="b"), delta(content="c"), delta(reasoning_content="r"),
                 delta(content="d")]
        writer.write(chunk(b"".join(first)))
        await writer.drain()
        await until(lambda: any(e.kind == "TokenDelta" and e.text == "d" for e in seen),
                    "the client to read the first write")  # so that the next write is another read
        finish = data({"choices": [{"index": 0, "delta": {"content": "f"}, "finish_reason": "stop"}]})
        writer.write(chunk(delta(content="e") + finish + usage(7) + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    seen: list = []
    engine, seen = await run_one(packer, seen)
    deltas = [(e.text, e.reasoning, e.tokens) for e in seen if e.kind == "TokenDelta"]
    assert deltas == [("abc", "", 3), ("", "r", 1), ("d", "", 1), ("ef", "", 2)]
    assert engine.agents["a"].output == "abcdef" and engine.agents["a"].tokens == 7  # every chunk, reasoning too
    turn = next(e for e in seen if e.kind == "TurnFinished")
    assert turn.completion_tokens == 7


@pytest.mark.anyio
async def test_tokens_that_came_several_to_a_chunk_count_as_the_server_counted_them():
    """vLLM with speculative decoding (and a hosted API's deltas) sends several tokens in one chunk: the deltas
    count chunks, the usage counts tokens. At the answer's end the agent's count is the server's, since Auto's
    throughput windows read it (they measured chunks a second, and each cap's acceptance rate differs)."""
    async def speculative(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        writer.write(chunk(b"".join(delta(content=words) for words in ("one two three ", "four five six ")) +
                           data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) +
                           data({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 6}}) +
                           b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    engine, seen = await run_one(speculative)
    deltas = [e for e in seen if e.kind == "TokenDelta"]
    assert [e.tokens for e in deltas] == [2, 4]  # the two chunks (one read), then the rest the usage said, textless
    assert "".join(e.text for e in deltas) == "one two three four five six " and not deltas[-1].text
    assert engine.agents["a"].tokens == 6 and engine.agents["a"].completion_tokens == 6
    mirror = RunMirror()  # what a console shows: the server's count
    for event in seen:
        mirror(event)
    assert mirror.agents["a"].tokens == 6


@pytest.mark.anyio
async def test_retry_after_is_honoured():
    calls: list[float] = []

    async def limited(reader, writer):
        calls.append(time.monotonic())
        if len(calls) == 1:
            body = b'{"error": {"message": "slow down"}}'
            writer.write(http_head(429, "application/json", "retry-after: 1\r\n", len(body)) + body)
        else:
            writer.write(http_head(200, "text/event-stream") + chunk(delta(content="ok") + b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    engine, seen = await run_one(limited)
    retry = next(e for e in seen if e.kind == "AgentRetrying")
    assert "HTTP 429" in retry.cause and retry.delay_s >= 1.0
    assert calls[1] - calls[0] >= 0.95


async def _killed_run_frees_the_server(settings: SimSettings, stall: dict, within_s: float,
                                      stream_process: bool = False) -> None:
    """Run one agent the watchdog kills; the simulated server must have aborted it within `within_s`."""
    async with SimServer(settings) as srv:
        engine = Engine(validate({"stall": stall, "endpoints": [{"name": "e", "base_url": srv.base_url}],
                                  "agents": [{"name": "a", "prompt": "p", "retries": 0}]}),
                        stream_process=stream_process)
        killed_at: list[float] = []
        engine.subscribe(lambda e: killed_at.append(e.t) if e.kind == "AgentKilled" else None)
        assert await engine.run() == 1
        assert killed_at
        while srv.state.running and time.monotonic() - killed_at[0] < within_s:
            await anyio.sleep(0.02)
        assert srv.state.running == 0 and srv.state.aborted_total == 1
        assert time.monotonic() - killed_at[0] < within_s


@pytest.mark.anyio
async def test_a_killed_attempt_frees_the_simulated_server_within_a_second():
    await _killed_run_frees_the_server(SimSettings(stall_after_tokens=3, keepalive_s=0.1, tokens_per_s=100),
                                       {"idle_timeout_s": 0.6}, 1.0)


@pytest.mark.anyio
async def test_an_attempt_killed_before_its_first_token_frees_the_server_too(stream_process):
    """A kill during the server's time to first token (a long prefill): the server must see the client go
    at once, not when it would have written its first token (a half-closed connection did not tell it)."""
    await _killed_run_frees_the_server(SimSettings(ttft_s=30.0, tokens_per_s=100),
                                       {"first_byte_timeout_s": 0.8, "extend_when_server_busy": False}, 2.0,
                                       stream_process)


def test_config_lookup_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert find_config(None) is None
    user = tmp_path / "xdg" / "cerevisor-tui" / "config.toml"
    user.parent.mkdir(parents=True)
    user.write_text("")
    assert find_config(None) == user
    (tmp_path / "cerevisor.toml").write_text("")
    assert find_config(None) == tmp_path / "cerevisor.toml"
    monkeypatch.setenv(CONFIG_ENV, str(tmp_path / "env.toml"))
    assert find_config(None) == tmp_path / "env.toml"
    assert find_config("flag.toml").name == "flag.toml"


@pytest.mark.anyio
async def test_the_engine_probes_one_of_its_endpoints_for_the_console(monkeypatch):
    import cerevisor_tui.endpoints.probe as probe

    # levels of 0.5 s, not the command's 2 s: enough here (64-token answers at 1,600 tokens/s) to find the knee
    monkeypatch.setattr(probe, "ProbeSettings", functools.partial(probe.ProbeSettings, level_s=0.5))
    async with SimServer(SimSettings(max_num_seqs=2, tokens_per_s=400, ttft_s=0.01, speed=4)) as srv, \
            SimServer(SimSettings(tokens_per_s=5)) as busy:
        engine = Engine(validate({"endpoints": [{"name": "e", "base_url": srv.base_url, "max_concurrency": 8},
                                                {"name": "other", "base_url": busy.base_url}],
                                  "agents": [{"name": "a", "endpoint": "other", "prompt": "p", "max_tokens": 1000}]}))
        results = []

        async def probe_when_open(event):
            results.append(await engine.probes.probe("e", max_concurrency=8))
            engine.handle(cmd.Stop(reason="probe done"))

        async with anyio.create_task_group() as tg:
            engine.subscribe(lambda e: tg.start_soon(probe_when_open, e) if e.kind == "RunStarted" else None)
            assert await engine.run() == 1
    (result,) = results
    assert result.server_kind == "vllm" and result.recommended_concurrency in (2, 4)


@pytest.mark.anyio
@pytest.mark.parametrize("stream_process", [False, True], ids=["in-process", "stream-worker"])
async def test_each_attempt_names_itself_to_the_server_by_request_id(stream_process):
    """X-Request-Id carries the run, agent, turn and attempt: what vLLM logs, so its log lines match ours."""
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0, fail_first=1, fail_status=503)) as srv:
        engine = Engine(validate({"endpoints": [{"name": "e", "base_url": srv.base_url}],
                                  "agents": [{"name": "ä b", "prompt": "p", "turns": ["q"], "max_tokens": 4,
                                              "retries": 1}]}), stream_process=stream_process)
        assert await engine.run() == 0
        ids = [r["request_id"] for r in srv.state.requests]
    agent = "%C3%A4%20b"  # a header value is ASCII: the name as the X-Cerevisor-Agent header has it
    assert ids == [f"{engine.run_id}.{agent}.t1.a1", f"{engine.run_id}.{agent}.t1.a2", f"{engine.run_id}.{agent}.t2.a1"]


@pytest.mark.anyio
@pytest.mark.parametrize("stream_process", [False, True], ids=["in-process", "stream-worker"])
async def test_extra_body_carries_a_servers_own_parameters_the_agents_over_its_endpoints(stream_process):
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0)) as srv:
        engine = Engine(validate({
            "endpoints": [{"name": "e", "base_url": srv.base_url,
                           "extra_body": {"top_k": 20, "chat_template_kwargs": {"enable_thinking": False}}}],
            "agents": [{"name": "plain", "prompt": "p", "max_tokens": 4},
                       {"name": "eos", "prompt": "p", "max_tokens": 4, "extra_body": {"ignore_eos": True, "top_k": 5}}],
        }), stream_process=stream_process)
        assert await engine.run() == 0
        bodies = {r["agent"]: r["body"] for r in srv.state.requests}
    assert bodies["plain"]["top_k"] == 20 and bodies["plain"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert "ignore_eos" not in bodies["plain"] and bodies["plain"]["max_tokens"] == 4
    assert bodies["eos"]["top_k"] == 5 and bodies["eos"]["ignore_eos"] is True  # the agent's keys win
    assert bodies["eos"]["chat_template_kwargs"] == {"enable_thinking": False} and bodies["eos"]["stream"] is True


@pytest.mark.anyio
async def test_a_run_stopped_by_the_event_that_queues_an_agent_still_ends():
    """The journal's on_error stops the run from inside `emit`: an agent stopped by its own AgentQueued (the
    write that found the disk full) had no scope to cancel yet; it used to wait forever on a paused scheduler."""
    async with SimServer(SimSettings(tokens_per_s=2000, ttft_s=0.0)) as srv:
        engine = Engine(validate({"run": {"mode": "parallel", "max_concurrency": 2},
                                  "endpoints": [{"name": "e", "base_url": srv.base_url}],
                                  "agents": [{"name": f"a{i}", "prompt": "p", "max_tokens": 4} for i in range(3)]}))

        def stop_on_queue(event) -> None:
            if type(event).__name__ == "AgentQueued" and event.agent == "a1":
                engine.stop("cannot write events.jsonl: No space left on device")

        engine.subscribe(stop_on_queue)
        with anyio.fail_after(60):  # a hang guard, not a timing bound: the run ends at once
            assert await engine.run() == 1
    assert {name: st.status for name, st in engine.agents.items()}["a1"] == "cancelled"
    assert all(st.status in ("cancelled", "completed") for st in engine.agents.values())
