"""The three APIs through the gateway, as clients no one here wrote speak them: openai-python (chat and
responses, streamed and not) and the anthropic SDK (messages), against the simulator on loopback. And the
gateway's own words on the wire (keep-alive comments, a deadline's error event) read by those same SDKs."""

from __future__ import annotations

import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import SDK, LazyModule
from .conftest import FAST_SIM, gateway_config, served

anthropic, openai = LazyModule("anthropic"), LazyModule("openai")

pytestmark = pytest.mark.anyio
SIM = [{"name": "sim", "kind": "simulated", "model": "sim-model", "sim": {**FAST_SIM}}]


def oai(url: str, session: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="client-secret-never-forwarded", max_retries=0,
                              default_headers={"X-Session-ID": session})


def claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url.removesuffix("/v1"), api_key="client-secret-never-forwarded",
                                    max_retries=0)


@SDK
async def test_openai_chat_and_responses_streamed_and_not():
    async with served() as s:
        client = oai(s.url, "oa")
        whole = await client.chat.completions.create(model="sim-model", max_tokens=6,
                                                     messages=[{"role": "user", "content": "hi"}])
        stream = await client.chat.completions.create(model="sim-model", max_tokens=6, stream=True,
                                                      messages=[{"role": "user", "content": "hi"}])
        chunks = [c async for c in stream]
        streamed = "".join([c.choices[0].delta.content or "" for c in chunks if c.choices])
        assert whole.choices[0].message.content == streamed != ""
        # the gateway asks the usage of a streamed chat for its meters; a client that did not ask never sees it
        assert all(c.choices and c.usage is None for c in chunks)
        response = await client.responses.create(model="sim-model", input="hi", max_output_tokens=6)
        events = await client.responses.create(model="sim-model", input="hi", max_output_tokens=6, stream=True)
        text = "".join([e.delta async for e in events if e.type == "response.output_text.delta"])
        assert response.output_text == text == streamed  # one conversation, one text, in every API
        await client.close()
        [opened] = s.of(ev.SessionOpened)
        assert (opened.agent, opened.api, opened.harness.split()[0]) == ("oa", "chat", "openai-python")
        turns = s.of(ev.TurnFinished, "oa")
        assert [t.completion_tokens for t in turns] == [6, 6, 6, 6]
        # usage read from each API's own shape (a streamed chat's asked by the gateway)
        assert [t.prompt_tokens > 0 for t in turns] == [True, True, True, True]
        started = s.of(ev.AgentStarted, "oa")
        assert [a.attempt for a in started] == [1, 2, 3, 4] and started[0].request_id.endswith(".oa.r1")


@SDK
async def test_anthropic_messages_streamed_and_not_with_the_session_from_metadata():
    async with served() as s:
        client = claude(s.url)
        metadata = {"user_id": "user_abc_account_def_session_7f3e9a1c-0000-4000-8000-000000000001"}
        whole = await client.messages.create(model="sim-model", max_tokens=6, metadata=metadata,
                                             messages=[{"role": "user", "content": "hi"}])
        async with client.messages.stream(model="sim-model", max_tokens=6, metadata=metadata,
                                          messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        assert whole.content[0].text == text != ""
        assert final.usage.output_tokens == whole.usage.output_tokens
        await client.close()
        [opened] = s.of(ev.SessionOpened)
        assert opened.agent == "7f3e9a1c-0000-4000-8000-000000000001" and opened.source == "metadata.user_id"
        assert opened.api == "messages" and opened.harness.startswith("anthropic-python")
        turns = s.of(ev.TurnFinished, opened.agent)
        assert len(turns) == 2 and turns[0].completion_tokens == turns[1].completion_tokens > 0


@SDK
async def test_keepalives_while_queued_are_comments_the_sdks_skip():
    # one slot (sequential); a session that holds it for 0.4 s after its request: the next session waits, kept alive
    # every 0.05 s (five sessions wait in turn: the test's time is theirs)
    config = gateway_config(run={"mode": "sequential"}, gateway={"keepalive_s": 0.05, "release_after_s": 0.4})
    async with served(config) as s, httpx.AsyncClient(timeout=30) as raw:
        first = oai(s.url, "holder")
        await first.chat.completions.create(model="sim-model", max_tokens=2, messages=[{"role": "user", "content": "a"}])
        body = {"model": "sim-model", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "b"}]}
        async with raw.stream("POST", s.url + "/chat/completions", json=body, headers={"X-Session-ID": "waiter"}) as r:
            data = b"".join([chunk async for chunk in r.aiter_raw()])
        assert r.status_code == 200
        head, _, rest = data.partition(b"data: ")
        assert head.count(b": keep-alive\n\n") >= 2 and head.replace(b": keep-alive\n\n", b"") == b""
        assert rest.endswith(b"data: [DONE]\n\n")
        [queued] = [a for a in s.of(ev.AgentStarted, "waiter")]
        assert queued.queued_s > 0.2  # its wait in the gateway is told apart from model silence
        # the SDKs read a stream that begins with comments as if they were not there
        async with anthropic.AsyncAnthropic(base_url=s.url.removesuffix("/v1"), api_key="k", max_retries=0) as c3:
            await first.chat.completions.create(model="sim-model", max_tokens=2,
                                                messages=[{"role": "user", "content": "a"}])
            async with c3.messages.stream(model="sim-model", max_tokens=4, metadata={"user_id": "late"},
                                          messages=[{"role": "user", "content": "c"}]) as stream:
                assert "".join([t async for t in stream.text_stream])
        second = oai(s.url, "waiter2")
        await first.chat.completions.create(model="sim-model", max_tokens=2, messages=[{"role": "user", "content": "a"}])
        stream = await second.chat.completions.create(model="sim-model", max_tokens=4, stream=True,
                                                      messages=[{"role": "user", "content": "d"}])
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert s.of(ev.AgentStarted, "waiter2")[0].queued_s > 0.2
        await first.close()
        await second.close()


@SDK
async def test_a_deadline_after_keepalives_is_the_apis_error_event_and_the_sdks_raise_it():
    # the server answers nothing for 100 s; the first-byte deadline is 0.4 s; keep-alives went out before it
    slow = [{"name": "sim", "kind": "simulated", "model": "sim-model", "sim": {"ttft_s": 100.0, "seed": 1}}]
    config = gateway_config(endpoints=slow, gateway={"keepalive_s": 0.1},
                            stall={"first_byte_timeout_s": 0.4, "extend_when_server_busy": False})
    async with served(config) as s:
        client = oai(s.url, "chat-one")
        with pytest.raises(openai.APIError, match="first_byte deadline"):
            stream = await client.chat.completions.create(model="sim-model", max_tokens=4, stream=True,
                                                          messages=[{"role": "user", "content": "x"}])
            async for _ in stream:
                pass
        # the Responses API's error event is an event of the stream, as OpenAI's own is: the SDK hands it over
        events = await client.responses.create(model="sim-model", input="x", max_output_tokens=4, stream=True)
        got = [e async for e in events]
        assert got[-1].type == "error" and "first_byte deadline" in got[-1].message
        async with anthropic.AsyncAnthropic(base_url=s.url.removesuffix("/v1"), api_key="k", max_retries=0) as c:
            with pytest.raises(anthropic.APIStatusError, match="first_byte deadline"):
                async with c.messages.stream(model="sim-model", max_tokens=4, metadata={"user_id": "m1"},
                                             messages=[{"role": "user", "content": "x"}]) as stream:
                    async for _ in stream.text_stream:
                        pass
        await client.close()
        kills = s.of(ev.AgentKilled)
        assert [k.deadline for k in kills] == ["first_byte"] * 3
        assert all(k.reason.startswith("no first token after 0.4") for k in kills)


@SDK
async def test_a_deadline_before_any_byte_is_a_504_in_the_apis_shape():
    slow = [{"name": "sim", "kind": "simulated", "model": "sim-model", "sim": {"ttft_s": 100.0, "seed": 1}}]
    config = gateway_config(endpoints=slow, gateway={"keepalive_s": 60},
                            stall={"first_byte_timeout_s": 0.5, "extend_when_server_busy": False})
    async with served(config) as s:
        client = oai(s.url, "plain")
        with pytest.raises(openai.APIStatusError) as caught:
            await client.chat.completions.create(model="sim-model", max_tokens=4,
                                                 messages=[{"role": "user", "content": "x"}])
        assert caught.value.status_code == 504
        assert "first_byte deadline (no first token after" in caught.value.message
        async with anthropic.AsyncAnthropic(base_url=s.url.removesuffix("/v1"), api_key="k", max_retries=0) as c:
            with pytest.raises(anthropic.APIStatusError) as got:
                await c.messages.create(model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "x"}])
        assert got.value.status_code == 504 and got.value.body["error"]["type"] == "timeout_error"
        await client.close()
