"""The gateway against real servers serving a real model (SmolLM2-135M-Instruct on vLLM and llama-server), driven
by clients no one here wrote: openai-python (sync and async, chat and responses, streamed and not), the anthropic
SDK (messages); a kill and a client's disconnect seen on vLLM as the abort of the request by our X-Request-Id.
The harnesses (litellm, mini-swe-agent, Claude Code, Codex CLI) are in test_gateway_harnesses.py."""

from __future__ import annotations

import anthropic
import anyio
import httpx
import openai
import pytest

from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from tests.conftest import until
from tests.gateway.conftest import gateway_config, served
from tests.integration import servers
from tests.integration.servers import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.anyio, pytest.mark.timeout(900)]


def box(server: ServerProcess) -> list[dict]:
    return [{"name": "box", "base_url": server.base_url, "kind": "local", "model": servers.SMOLLM2}]


def config_for(server: ServerProcess, **stall):
    return gateway_config(endpoints=box(server), gateway={"keepalive_s": 2.0},
                          stall={"first_byte_timeout_s": 300.0, "idle_timeout_s": 120.0, **stall})


QUESTION = [{"role": "user", "content": "Name three colours."}]


async def every_api(s, base: str) -> None:
    """openai-python sync and async, streamed and not, chat and responses; the anthropic SDK, both ways."""
    async with openai.AsyncOpenAI(base_url=base, api_key="client-key", max_retries=0,
                                  default_headers={"X-Session-ID": "oa-async"}) as client:
        whole = await client.chat.completions.create(model="claude-sonnet-4", messages=QUESTION, max_tokens=40)
        assert whole.choices[0].message.content and whole.usage.prompt_tokens > 0
        stream = await client.chat.completions.create(model="claude-sonnet-4", messages=QUESTION, max_tokens=40,
                                                      stream=True, stream_options={"include_usage": True})
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text
        response = await client.responses.create(model="gpt-5-codex", input="Name three colours.",
                                                 max_output_tokens=40)
        assert response.output_text
        events = await client.responses.create(model="gpt-5-codex", input="Name three colours.",
                                               max_output_tokens=40, stream=True)
        kinds = [e.type async for e in events]
        assert "response.output_text.delta" in kinds and kinds[-1] in ("response.completed", "response.incomplete")

    def sync_calls() -> str:
        with openai.OpenAI(base_url=base, api_key="client-key", max_retries=0,
                           default_headers={"X-Session-ID": "oa-sync"}) as c:
            chunks = c.chat.completions.create(model="x", messages=QUESTION, max_tokens=30, stream=True)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    assert await anyio.to_thread.run_sync(sync_calls)
    async with anthropic.AsyncAnthropic(base_url=base.removesuffix("/v1"), api_key="client-key",
                                        max_retries=0) as client:
        message = await client.messages.create(model="claude-haiku-4", max_tokens=40, messages=QUESTION,
                                               metadata={"user_id": "cc-1"})
        assert message.content[0].text and message.usage.output_tokens > 0
        async with client.messages.stream(model="claude-haiku-4", max_tokens=40, messages=QUESTION,
                                          metadata={"user_id": "cc-1"}) as stream:
            assert "".join([t async for t in stream.text_stream])
    sessions = {o.agent: o for o in s.of(ev.SessionOpened)}
    assert set(sessions) == {"oa-async", "oa-sync", "cc-1"}
    assert sessions["cc-1"].api == "messages" and sessions["oa-async"].harness.startswith("openai-python")
    started = s.of(ev.AgentStarted)
    assert {a.model_sent for a in started} == {servers.SMOLLM2}  # every harness's model name mapped
    assert {"claude-sonnet-4", "gpt-5-codex", "claude-haiku-4"} <= {a.model_asked for a in started}
    finished = s.of(ev.TurnFinished)
    assert len(finished) == 7 and all(t.completion_tokens > 0 for t in finished)


async def test_vllm_every_api_through_the_gateway(smol_vllm: ServerProcess):
    async with served(config_for(smol_vllm), model=servers.SMOLLM2) as s:
        await every_api(s, s.url)


async def test_llama_server_every_api_through_the_gateway(smol_llama: ServerProcess):
    async with served(config_for(smol_llama), model=servers.SMOLLM2) as s:
        await every_api(s, s.url)


def aborted(server: ServerProcess, request_id: str) -> bool:
    """vLLM (--enable-log-requests) logged the abort of the request that carried `request_id`."""
    return any(request_id in line and "abort" in line.lower() for line in server.log_text().splitlines())


LONG = [{"role": "user", "content": "Write a very long story about a lighthouse keeper, with many chapters."}]


async def test_a_kill_and_a_client_gone_are_aborts_on_vllm(smol_vllm: ServerProcess):
    async with served(config_for(smol_vllm), model=servers.SMOLLM2) as s, httpx.AsyncClient(timeout=300) as http:
        # the operator's kill, mid-stream
        body = {"model": "m", "messages": LONG, "max_tokens": 4000, "stream": True, "ignore_eos": True}
        async with http.stream("POST", s.url + "/chat/completions", json=body, headers={"X-Session-ID": "k"}) as r:
            lines = r.aiter_lines()
            async for line in lines:
                if '"content"' in line:
                    break
            [started] = s.of(ev.AgentStarted, "k")
            assert s.engine.handle(cmd.Kill(agent="k")) is True
            rest = [line async for line in lines]
        assert any('"error"' in line and "killed by operator" in line for line in rest), rest[-3:]
        await until(lambda: aborted(smol_vllm, started.request_id),
                    lambda: f"vLLM to log the abort of {started.request_id}:\n{smol_vllm.log_tail()}", timeout=60)
        # a client that goes away mid-stream
        async with http.stream("POST", s.url + "/chat/completions", json=body, headers={"X-Session-ID": "gone"}) as r:
            async for line in r.aiter_lines():
                if '"content"' in line:
                    break
        [started] = s.of(ev.AgentStarted, "gone")
        await until(lambda: aborted(smol_vllm, started.request_id),
                    lambda: f"vLLM to log the abort of {started.request_id}:\n{smol_vllm.log_tail()}", timeout=60)
        # and one that goes away before its first byte (a long prompt prefills for a while), not streamed
        long_prompt = [{"role": "user", "content": "lighthouse " * 3000 + "Summarize."}]

        async def impatient() -> None:
            with anyio.move_on_after(3):
                await http.post(s.url + "/chat/completions", headers={"X-Session-ID": "early"},
                                json={"model": "m", "messages": long_prompt, "max_tokens": 20})

        await impatient()
        [started] = s.of(ev.AgentStarted, "early")
        assert not s.of(ev.FirstToken, "early")
        await until(lambda: aborted(smol_vllm, started.request_id),
                    lambda: f"vLLM to log the abort of {started.request_id}:\n{smol_vllm.log_tail()}", timeout=60)
