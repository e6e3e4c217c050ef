"""The simulator's OpenAI Responses and Anthropic Messages APIs over real loopback HTTP: their wire shapes, the
real SDKs reading them, and the one server model under all three APIs (faults, prefix reuse, aborts, counters)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import SimServer, start_in_thread
from tests.conftest import SDK, LazyModule, until
from tests.test_sim import FAST, metric

anthropic, openai = LazyModule("anthropic"), LazyModule("openai")
pytestmark = pytest.mark.anyio

TOOLS_OPENAI = [{"type": "function", "name": "get_time", "description": "The time in a timezone.",
                 "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}]
TOOLS_ANTHROPIC = [{"name": "get_time", "description": "The time in a timezone.",
                    "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}]
LONG = "Read the build log and say which step failed first, and why. " * 8  # several 64-character blocks


def body_for(api: str, content: str = "hello there", *, max_tokens: int | None = 8, stream: bool = False,
             **extra: Any) -> tuple[str, dict[str, Any]]:
    """The path and body of a one-message request in `api`'s shape."""
    if api == "chat":
        body = {"model": "sim-model", "messages": [{"role": "user", "content": content}], "stream": stream}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return "/v1/chat/completions", {**body, **extra}
    if api == "responses":
        body = {"model": "sim-model", "input": content, "stream": stream}
        if max_tokens is not None:
            body["max_output_tokens"] = max_tokens
        return "/v1/responses", {**body, **extra}
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}], "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return "/v1/messages", {**body, **extra}


DELTAS = ("response.output_text.delta", "response.function_call_arguments.delta", "content_block_delta")


def parse_sse(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each whole SSE event in `raw`; comments (keep-alives) are left out."""
    out = []
    for block in raw.split("\n\n")[:-1]:
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        event = next((line[7:] for line in lines if line.startswith("event: ")), None)
        data = "\n".join(line[6:] for line in lines if line.startswith("data: "))
        out.append((event, data))
    return out


async def stream_events(client: httpx.AsyncClient, root: str, api: str, **kw: Any) -> list[tuple[str | None, Any]]:
    path, body = body_for(api, stream=True, **kw)
    async with client.stream("POST", root + path, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    return [(event, json.loads(data)) for event, data in parse_sse(raw)]


def count_deltas(raw: str) -> int:
    return sum(event in DELTAS for event, _ in parse_sse(raw))


def check_named(events: list[tuple[str | None, Any]]) -> None:
    """Every event has an `event:` line naming the type its data says."""
    for event, data in events:
        assert event == data["type"], (event, data)


# ---- OpenAI Responses ----------------------------------------------------------------------------------------

async def test_responses_plain_and_streamed_shapes_agree():
    async with SimServer(SimSettings(**FAST, seed=7)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("responses", max_tokens=None, instructions="Be brief.")
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 200
        whole = r.json()
        assert whole["id"].startswith("resp_") and whole["object"] == "response"
        assert whole["status"] == "completed" and whole["model"] == "sim-model"
        [item] = whole["output"]
        assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
        assert item["id"].startswith("msg_")
        [part] = item["content"]
        assert part["type"] == "output_text" and part["annotations"] == []
        assert len(part["text"].split()) == 128  # the default length, ended on its own
        usage = whole["usage"]
        assert usage["output_tokens"] == 128
        assert usage["total_tokens"] == usage["input_tokens"] + 128
        assert usage["input_tokens_details"] == {"cached_tokens": 0}
        assert usage["output_tokens_details"] == {"reasoning_tokens": 0}

        events = await stream_events(c, srv.root_url, "responses", max_tokens=None, instructions="Be brief.")
        check_named(events)
        kinds = [data["type"] for _, data in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[4:-4] == ["response.output_text.delta"] * 128
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.completed"]
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
        deltas = [data for _, data in events if data["type"] == "response.output_text.delta"]
        item_id = events[2][1]["item"]["id"]
        assert {(d["item_id"], d["output_index"], d["content_index"]) for d in deltas} == {(item_id, 0, 0)}
        text = "".join(d["delta"] for d in deltas)
        assert text == part["text"]  # same prompt, same seed: same text
        assert events[-4][1]["text"] == text
        done = events[-1][1]["response"]
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == text
        assert done["usage"]["output_tokens"] == 128 and done["usage"]["input_tokens"] == usage["input_tokens"]


async def test_responses_max_output_tokens_ends_incomplete():
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("responses", max_tokens=5)
        whole = (await c.post(srv.root_url + path, json=body)).json()
        assert whole["status"] == "incomplete"
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
        assert whole["usage"]["output_tokens"] == 5
        events = await stream_events(c, srv.root_url, "responses", max_tokens=5)
        assert events[-1][1]["type"] == "response.incomplete"
        assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_responses_input_items_and_function_call_stream():
    settings = SimSettings(**FAST, tool_args={"get_time": {"tz": "UTC"}})
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        events = await stream_events(c, srv.root_url, "responses", content="what time is it?", tools=TOOLS_OPENAI)
        check_named(events)
        kinds = [data["type"] for _, data in events]
        added = events[2][1]["item"]
        assert added["type"] == "function_call" and added["name"] == "get_time" and added["arguments"] == ""
        assert added["call_id"].startswith("call_") and added["id"].startswith("fc_")
        assert "response.content_part.added" not in kinds
        pieces = [d["delta"] for _, d in events if d["type"] == "response.function_call_arguments.delta"]
        assert json.loads("".join(pieces)) == {"tz": "UTC"}
        assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                              "response.completed"]
        call = events[-1][1]["response"]["output"][0]
        assert call["arguments"] == "".join(pieces) and call["status"] == "completed"

        # The next turn sends the call and its output back as items: this turn is answered in text.
        path, body = body_for("responses", tools=TOOLS_OPENAI, instructions="You tell the time.")
        body["input"] = [{"role": "user", "content": [{"type": "input_text", "text": "what time is it?"}]},
                         {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
                          "arguments": call["arguments"]},
                         {"type": "function_call_output", "call_id": call["call_id"], "output": "12:00"},
                         {"type": "reasoning", "id": "rs_1", "summary": []}]
        whole = (await c.post(srv.root_url + path, json=body)).json()
        assert whole["output"][0]["type"] == "message"
        logged = srv.state.requests[-1]
        assert logged["api"] == "responses"
        assert [m["role"] for m in logged["messages"]] == ["system", "user", "assistant", "tool"]

        body["input"] = [{"type": "item_reference", "id": "msg_1"}]
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"


@SDK
def test_openai_sdk_reads_responses():
    settings = SimSettings(**FAST, seed=5, tool_args={"get_time": {"tz": "UTC"}})
    with start_in_thread(settings) as sim:
        client = openai.OpenAI(base_url=sim.base_url, api_key="sk-sim", max_retries=0)
        plain = client.responses.create(model="sim-model", input="plan the release", max_output_tokens=12)
        assert plain.status == "incomplete" and len(plain.output_text.split()) == 12
        assert plain.usage is not None and plain.usage.output_tokens == 12

        stream = client.responses.create(model="sim-model", input="plan the release", max_output_tokens=12,
                                         stream=True)
        events = list(stream)
        assert isinstance(events[0], openai.types.responses.ResponseCreatedEvent)
        deltas = [e.delta for e in events if isinstance(e, openai.types.responses.ResponseTextDeltaEvent)]
        assert "".join(deltas) == plain.output_text
        assert events[-1].type == "response.incomplete"

        with client.responses.stream(model="sim-model", input="plan the release") as helper:
            for _ in helper:
                pass
            final = helper.get_final_response()
        assert final.status == "completed" and len(final.output_text.split()) == 128

        with client.responses.stream(model="sim-model", input="what time?", tools=TOOLS_OPENAI) as helper:
            for _ in helper:
                pass
            [call] = helper.get_final_response().output
        assert call.type == "function_call" and json.loads(call.arguments) == {"tz": "UTC"}
        answer = client.responses.create(model="sim-model", tools=TOOLS_OPENAI, input=[
            {"role": "user", "content": "what time?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
        assert answer.output[0].type == "message" and answer.output_text

        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="nope", input="x")


# ---- Anthropic Messages --------------------------------------------------------------------------------------

async def test_messages_plain_and_streamed_shapes_agree():
    async with SimServer(SimSettings(**FAST, seed=7, max_tokens_default=20)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("messages", max_tokens=1024, system=[{"type": "text", "text": "Be brief."}])
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 200
        whole = r.json()
        assert whole["id"].startswith("msg_") and whole["type"] == "message" and whole["role"] == "assistant"
        assert whole["model"] == "sim-model" and whole["stop_sequence"] is None
        assert whole["stop_reason"] == "end_turn"  # ended on its own, well below max_tokens
        [block] = whole["content"]
        assert block["type"] == "text" and len(block["text"].split()) == 20
        assert whole["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 20,
                                  "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}

        events = await stream_events(c, srv.root_url, "messages", max_tokens=1024,
                                     system=[{"type": "text", "text": "Be brief."}])
        check_named(events)
        kinds = [data["type"] for _, data in events]
        assert kinds[:3] == ["message_start", "content_block_start", "ping"]
        assert kinds[3:-3] == ["content_block_delta"] * 20
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        start = events[0][1]["message"]
        assert start["content"] == [] and start["stop_reason"] is None
        assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
        assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
        text = "".join(d["delta"]["text"] for _, d in events if d["type"] == "content_block_delta")
        assert text == block["text"]
        assert {d["delta"]["type"] for _, d in events if d["type"] == "content_block_delta"} == {"text_delta"}
        delta = events[-2][1]
        assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == 20

        path, body = body_for("messages", max_tokens=3)
        short = (await c.post(srv.root_url + path, json=body)).json()
        assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 3


async def test_a_schema_type_or_tool_choice_that_is_not_a_name_is_answered_not_a_server_error():
    odd = {"type": "object", "properties": {"tz": {"type": {"not": "a name"}}, "n": {"type": [["x"]]}},
           "required": ["tz", "n"]}
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("chat", tool_choice="required",
                              tools=[{"type": "function", "function": {"name": "get_time", "parameters": odd}}])
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 200
        [call] = r.json()["choices"][0]["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"tz": "sim", "n": "sim"}  # a plain value, as unnamed

        path, body = body_for("messages", tools=[{"name": "get_time", "input_schema": odd}],
                              tool_choice={"type": {"not": "a name"}})
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 200 and r.json()["type"] == "message"


async def test_messages_errors_in_anthropics_shape():
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("messages", max_tokens=None)
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 400
        assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "max_tokens: Field required"}}
        r = await c.post(srv.root_url + path, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        path, body = body_for("messages", model="claude-nope")
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 404
        assert r.json() == {"type": "error", "error": {"type": "not_found_error", "message": "model: claude-nope"}}
        assert srv.state.requests_total == 0 and srv.state.rejected_total == 3


async def test_messages_take_a_system_message_among_the_turns():
    # Claude Code 2.1 sends ['user', 'system']: the README's `claude` against the simulator got a 400
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for("messages")
        body["messages"] = [{"role": "user", "content": "hi"},
                            {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]}]
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0]["text"]
        body["messages"] = [{"role": "tool", "content": "x"}]
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 400 and "got 'tool'" in r.json()["error"]["message"]


@SDK
def test_anthropic_sdk_reads_messages():
    settings = SimSettings(**FAST, seed=5, max_tokens_default=16, tool_args={"get_time": {"tz": "UTC"}})
    with start_in_thread(settings) as sim:
        client = anthropic.Anthropic(base_url=sim.root_url, api_key="sk-ant-sim", max_retries=0)
        ask = [{"role": "user", "content": "plan the release"}]
        plain = client.messages.create(model="sim-model", max_tokens=1024, system="Be brief.", messages=ask)
        assert plain.stop_reason == "end_turn" and plain.content[0].type == "text"
        assert len(plain.content[0].text.split()) == 16 and plain.usage.output_tokens == 16

        with client.messages.stream(model="sim-model", max_tokens=1024, system="Be brief.", messages=ask) as s:
            assert s.get_final_text() == plain.content[0].text
            final = s.get_final_message()
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 16

        raw = list(client.messages.create(model="sim-model", max_tokens=4, messages=ask, stream=True))
        assert [e.type for e in raw][-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert raw[-2].delta.stop_reason == "max_tokens"

        with client.messages.stream(model="sim-model", max_tokens=1024, messages=[
                {"role": "user", "content": "what time?"}], tools=TOOLS_ANTHROPIC) as s:
            called = s.get_final_message()
        [use] = called.content
        assert called.stop_reason == "tool_use" and use.type == "tool_use" and use.input == {"tz": "UTC"}
        assert use.id.startswith("toolu_")
        answer = client.messages.create(model="sim-model", max_tokens=1024, tools=TOOLS_ANTHROPIC, messages=[
            {"role": "user", "content": "what time?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in called.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "12:00"}]}])
        assert answer.stop_reason == "end_turn" and answer.content[0].type == "text"
        assert "sk-ant-sim" in sim.state.requests[-1]["authorization"]

        with pytest.raises(anthropic.NotFoundError):
            client.messages.create(model="nope", max_tokens=8, messages=ask)
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model="sim-model", max_tokens=0, messages=ask)


# ---- The one server under all three APIs ---------------------------------------------------------------------

async def test_same_conversation_same_text_in_every_api():
    async with SimServer(SimSettings(**FAST, seed=11)) as srv, httpx.AsyncClient() as c:
        texts = []
        for api in ("chat", "responses", "messages"):
            path, body = body_for(api, "plan the migration", max_tokens=10)
            whole = (await c.post(srv.root_url + path, json=body)).json()
            texts.append({"chat": lambda w: w["choices"][0]["message"]["content"],
                          "responses": lambda w: w["output"][0]["content"][0]["text"],
                          "messages": lambda w: w["content"][0]["text"]}[api](whole))
        assert texts[0] == texts[1] == texts[2] and len(texts[0].split()) == 10


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
async def test_unknown_model_is_404_in_each_apis_shape(api: str):
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, model="nope")
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 404
        err = r.json()
        if api == "messages":
            assert err["type"] == "error" and err["error"]["type"] == "not_found_error"
        else:
            assert set(err["error"]) == {"message", "type", "param", "code"}
            assert err["error"]["message"] == "The model `nope` does not exist." and err["error"]["param"] == "model"
        if api == "responses":
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_fail_first_answers_in_each_apis_shape(api: str):
    async with SimServer(SimSettings(**FAST, fail_first=1, fail_status=429)) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, stream=True)
        r = await c.post(srv.root_url + path, json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        err = r.json()
        assert err["error"]["type"] == ("rate_limit_error" if api == "messages" else "requests")
        assert (await c.post(srv.root_url + path, json=body)).status_code == 200
        assert srv.state.failed_total == 1 and srv.state.requests_total == 2


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_server_going_away_mid_stream_sends_the_apis_error_event(api: str):
    settings = SimSettings(tokens_per_s=50.0, ttft_s=0.0, max_tokens_default=1000)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, max_tokens=1000, stream=True)
        async with c.stream("POST", srv.root_url + path, json=body) as r:
            raw = ""
            closed = False
            async for text in r.aiter_text():  # the stream ends properly after the error event
                raw += text
                if count_deltas(raw) >= 3 and not closed:
                    await srv.state.engine.close()
                    closed = True
        events = [(event, json.loads(data)) for event, data in parse_sse(raw)]
        event, data = events[-1]
        assert event == "error"
        if api == "responses":
            assert set(data) == {"type", "code", "message", "param", "sequence_number"}
            assert data["type"] == "error" and data["code"] == "server_error" and data["param"] is None
            assert data["sequence_number"] == events[-2][1]["sequence_number"] + 1
        else:
            assert data == {"type": "error", "error": {"type": "overloaded_error",
                                                       "message": "The server is shutting down."}}
        assert srv.state.completed_total == 0


@SDK
async def test_anthropic_sdk_raises_on_the_error_event():
    settings = SimSettings(tokens_per_s=50.0, ttft_s=0.0, max_tokens_default=1000)
    async with SimServer(settings) as srv:
        client = anthropic.AsyncAnthropic(base_url=srv.root_url, api_key="sk-ant-sim", max_retries=0)
        seen = 0
        with pytest.raises(anthropic.APIStatusError) as caught:
            async with client.messages.stream(model="sim-model", max_tokens=1000,
                                              messages=[{"role": "user", "content": "go"}]) as s:
                async for _ in s.text_stream:
                    seen += 1
                    if seen == 3:
                        await srv.state.engine.close()
        assert caught.value.body["error"]["type"] == "overloaded_error"
        await client.close()


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_drop_and_malformed_faults_in_each_api(api: str):
    async with SimServer(SimSettings(**FAST, drop_after_tokens=3)) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, max_tokens=10, stream=True)
        raw = ""
        with pytest.raises(httpx.RemoteProtocolError):
            async with c.stream("POST", srv.root_url + path, json=body) as r:
                async for text in r.aiter_text():
                    raw += text
        assert count_deltas(raw) == 3
        await until(lambda: srv.state.dropped_total == 1 and srv.state.running == 0)
    async with SimServer(SimSettings(**FAST, malformed_after_tokens=2)) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, max_tokens=5, stream=True)
        async with c.stream("POST", srv.root_url + path, json=body) as r:
            raw = (await r.aread()).decode()
        events = parse_sse(raw)
        bad = next(i for i, (_, data) in enumerate(events) if "broken" in data)
        assert sum(e in DELTAS for e, _ in events[:bad]) == 2
        assert sum(e in DELTAS for e, _ in events) == 5 + 1  # the broken one is named a delta too
        assert json.loads(events[-1][1])["type"] in ("response.incomplete", "message_stop")


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_stall_keeps_alive_in_each_api(api: str):
    settings = SimSettings(**FAST, stall_after_tokens=2, keepalive_s=0.05)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, max_tokens=20, stream=True)
        raw = ""
        async with c.stream("POST", srv.root_url + path, json=body) as r:
            async for text in r.aiter_text():
                raw += text
                if raw.count(": keep-alive") >= 3:
                    break
        assert count_deltas(raw) == 2
        await until(lambda: srv.state.aborted_total == 1 and srv.state.running == 0)


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_prefix_hits_rise_on_the_second_turn(api: str):
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, LONG, max_tokens=8)
        first = (await c.post(srv.root_url + path, json=body)).json()
        hits_before = metric((await c.get(srv.root_url + "/metrics")).text, "vllm:prefix_cache_hits_total")
        if api == "responses":
            assert first["usage"]["input_tokens_details"]["cached_tokens"] == 0
            body["input"] = [{"role": "user", "content": LONG}, *first["output"],
                             {"role": "user", "content": "and then?"}]
        else:
            assert first["usage"]["cache_read_input_tokens"] == 0
            body["messages"] += [{"role": "assistant", "content": first["content"]},
                                 {"role": "user", "content": "and then?"}]
        second = (await c.post(srv.root_url + path, json=body)).json()
        hits_after = metric((await c.get(srv.root_url + "/metrics")).text, "vllm:prefix_cache_hits_total")
        assert hits_after > hits_before
        if api == "responses":
            usage = second["usage"]
            assert 0 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]
        else:
            usage = second["usage"]
            assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] > 0
            assert usage["cache_read_input_tokens"] == hits_after - hits_before


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_client_disconnect_aborts_the_sequence(api: str, stream: bool):
    settings = SimSettings(tokens_per_s=50.0, ttft_s=0.0, max_tokens_default=1000)
    async with SimServer(settings) as srv, httpx.AsyncClient() as c:
        path, body = body_for(api, max_tokens=1000, stream=stream)
        if stream:
            async with c.stream("POST", srv.root_url + path, json=body) as r:
                async for text in r.aiter_text():
                    if count_deltas(text):
                        break
                assert srv.state.running == 1
        else:
            async with anyio.create_task_group() as tg:
                async def ask() -> None:
                    await c.post(srv.root_url + path, json=body)

                tg.start_soon(ask)
                await until(lambda: srv.state.running == 1, "the request to run")
                tg.cancel_scope.cancel()  # the client goes away: its connection closes
        await until(lambda: srv.state.aborted_total == 1 and srv.state.running == 0, "the abort")
        m = (await c.get(srv.root_url + "/metrics")).text
        assert metric(m, "cerevisor_sim:aborted_requests_total") == 1
        assert srv.state.completed_total == 0


async def test_requests_counted_by_agent_in_every_api():
    async with SimServer(SimSettings(**FAST)) as srv, httpx.AsyncClient() as c:
        for api, extra in (("chat", {"user": "ann"}), ("responses", {"user": "bob"}),
                           ("messages", {"metadata": {"user_id": "cat"}})):
            path, body = body_for(api, **extra)
            assert (await c.post(srv.root_url + path, json=body)).status_code == 200
        path, body = body_for("messages", metadata={"user_id": "cat"})
        await c.post(srv.root_url + path, json=body, headers={"X-Cerevisor-Agent": "dan", "x-api-key": "sk-ant-1"})
        assert srv.state.requests[-1]["authorization"] == "sk-ant-1"  # Anthropic's key header is the credential
        assert "x-api-key" not in srv.state.requests[-1]["headers"]
        assert dict(srv.state.requests_by_agent) == {"ann": 1, "bob": 1, "cat": 1, "dan": 1}
        assert srv.state.requests_total == 4 and srv.state.completed_total == 4
        assert [r["api"] for r in srv.state.requests] == ["chat", "responses", "messages", "messages"]
