"""When the upstream is the problem: down (503 with Retry-After), still loading (the request waits, then is
served), breaking off its answer (an error in the API's shape, never a truncated body), or sending a broken
chunk (passed through as it came: the gateway never re-encodes)."""

from __future__ import annotations

import io

import anyio
import httpx
import pytest

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.sinks.printer import Printer
from cerevisor_tui.sim import SimServer
from cerevisor_tui.sim.server import bind_socket

from ..conftest import free_port, until
from .conftest import NO_EXTENSIONS, Answer, chat, post, served, sim_endpoint
from .upstreams import FakeApi

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_upstream_that_is_down_is_a_503_with_retry_after(stream):
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with served(endpoints=[{"name": "far", "kind": "hosted", "base_url": closed, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(model="m", stream=stream),
                            headers={"X-Session-ID": "d"})
        assert answer.status == 503
        assert int(answer.headers["retry-after"]) > 0
        error = answer.json()["error"]
        assert error["type"] == "service_unavailable" and "far is not answering" in error["message"]
        session = s.session("d")
        await until(lambda: not session.in_flight and session.st.status == "idle", "the request's end told")


async def test_an_upstream_down_for_the_messages_api_is_its_own_error_shape():
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with served(endpoints=[{"name": "far", "kind": "hosted", "base_url": closed, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/messages", {"model": "m", "max_tokens": 5,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status == 503 and answer.headers["retry-after"]
        body = answer.json()
        assert body["type"] == "error" and body["error"]["type"] == "overloaded_error"


async def test_a_local_upstream_not_yet_listening_makes_the_request_wait_then_serves_it():
    port = free_port()
    endpoint = sim_endpoint(f"http://127.0.0.1:{port}/v1", first_byte_timeout_s=30)
    async with served(endpoints=[endpoint]) as s, httpx.AsyncClient(timeout=60) as client, \
            anyio.create_task_group() as group:
        answers: list[Answer] = []

        async def ask() -> None:
            answers.append(await post(client, s.url + "/chat/completions", chat(max_tokens=4),
                                      headers={"X-Session-ID": "early"}))

        group.start_soon(ask)
        await until(lambda: s.of(ev.EndpointWaiting, "early"), "the request waiting for its endpoint")
        assert s.session("early").st.status == "waiting"
        async with SimServer(SimSettings(speed=50), sock=bind_socket("127.0.0.1", port)) as sim:
            await until(lambda: answers, "the answer once the server listens", timeout=30)
            assert sim.state.requests_total == 1
        [answer] = answers
        assert answer.status == 200 and answer.frames[-1] == b"data: [DONE]"
        assert not s.of(ev.AgentKilled)
        assert s.session("early").st.status == "idle"


async def test_a_local_upstream_whose_port_never_opened_is_said_down_after_its_grace_not_waited_on():
    # a dead or mistyped upstream: refused past [gateway] down_after_s with no answer ever, a 503 naming it comes
    # at once, long before the first-byte window (30 min for a local endpoint) would have ended the request
    port = free_port()
    endpoint = sim_endpoint(f"http://127.0.0.1:{port}/v1")
    async with served(endpoints=[endpoint], gateway={"down_after_s": 0.5, "keepalive_s": 30},
                      run={"warmup": "off"}) as s, httpx.AsyncClient(timeout=60) as client:
        first = await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "typo"})
        # a later request is told at its first refusal: the endpoint is down already
        later = await post(client, s.url + "/messages", {"model": "sim-model", "max_tokens": 4, "stream": True,
                                                          "messages": [{"role": "user", "content": "hi"}]},
                           headers={"X-Session-ID": "typo"})
    assert first.status == later.status == 503 and first.headers["retry-after"] == "5"
    message = first.json()["error"]["message"]
    assert f"upstream sim at http://127.0.0.1:{port}/v1 is down" in message and "never answered" in message
    assert later.json()["type"] == "error" and "is down" in later.json()["error"]["message"]
    assert not s.of(ev.AgentKilled)  # nothing was waited on to its deadline
    assert len(s.of(ev.EndpointWaiting, "typo")) >= 1


async def test_a_local_upstream_that_never_comes_is_killed_at_its_first_byte_deadline():
    port = free_port()
    endpoint = sim_endpoint(f"http://127.0.0.1:{port}/v1", first_byte_timeout_s=1.0, extend_when_server_busy=False)
    async with served(endpoints=[endpoint], gateway={"keepalive_s": 30}) as s, \
            httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(), headers={"X-Session-ID": "never"})
        assert answer.status == 504 and "first_byte deadline" in answer.json()["error"]["message"]
        assert s.of(ev.EndpointWaiting, "never")
        await until(lambda: not s.session("never").in_flight, "the request's end told")


async def test_an_upstream_that_drops_mid_stream_is_an_error_event_and_the_session_goes_on():
    async with served(sim={"drop_after_tokens": 3}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=20), headers={"X-Session-ID": "dr"})
        assert answer.status == 200
        assert answer.text  # the three tokens before the drop
        error = answer.data[-1]["error"]
        assert "broke off its answer after 3 tokens" in error["message"]
        assert s.sim.dropped_total == 1
        session = s.session("dr")
        await until(lambda: not session.in_flight and session.st.status == "idle", "the request's end told")
        again = await post(client, s.url + "/chat/completions", chat("again", max_tokens=2),
                           headers={"X-Session-ID": "dr"})
        assert again.status == 200 and again.frames[-1] == b"data: [DONE]"


async def test_a_malformed_chunk_is_passed_through_as_it_came():
    async with served(sim={"malformed_after_tokens": 2}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=5), headers={"X-Session-ID": "m"})
        assert answer.status == 200
        assert b'data: {"id": broken' in answer.frames
        assert answer.frames[-1] == b"data: [DONE]"
        [turn] = await until(lambda: s.of(ev.TurnFinished, "m"), "the turn's end told")
        assert turn.completion_tokens == 5


async def test_a_request_ends_with_its_last_byte_even_when_the_upstream_never_lists_its_models():
    # the session's meters ask the endpoint its context length (GET /v1/models) once the answer has gone out;
    # a server that never answers it must not keep the request in flight, watched, until its idle deadline
    async with FakeApi(silent_gets=True) as api, served(
            endpoints=[{"name": "up", "kind": "local", "base_url": api.base_url, "model": "up-model"}],
            stall={"idle_timeout_s": 20, **NO_EXTENSIONS}) as s, httpx.AsyncClient(timeout=30) as client:
        body = {"model": "up-model", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
        answer = await post(client, s.url + "/messages", body, headers={"X-Session-ID": "m"})
        assert answer.status == 200
        await until(lambda: not s.session("m").in_flight, "the request's end told", timeout=10)
        assert s.session("m").st.status == "idle" and not s.of(ev.AgentKilled)
        [meters] = s.of(ev.AgentMeters, "m")
        assert meters.max_model_len == 0  # not known: the server did not say


async def test_the_request_goes_upstream_as_the_client_wrote_it_with_the_gateways_fields_added():
    """A late turn's body is ~560 KB: the usage the gateway asks for is added after the client's last field, every
    byte before it as the client sent it (its spacing, its escapes, its numbers); only a field the client set itself
    is changed by encoding the body anew."""
    written = (b'{ "model" : "m", "stream": true, "max_tokens": 1e2,\n "messages": [{"role": "user", '
               b'"content": "caf\\u00e9 \\/ ok"}], "temperature": 0.50 }\n')
    async with FakeApi() as api, served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url,
                                                    "model": "m"}]) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", content=written,
                            headers={"content-type": "application/json", "X-Session-ID": "bytes"})
        assert answer.status == 200, answer.raw
        mine = {"model": "m", "stream": True, "stream_options": {"include_usage": False}, "messages": []}
        await post(client, s.url + "/chat/completions", mine, headers={"X-Session-ID": "bytes"})
    sent, changed = api.seen[0].raw, api.seen[1]
    assert sent.startswith(written.rstrip()[:-1]), sent
    assert sent[len(written.rstrip()) - 1:] == b',"stream_options":{"include_usage":true}}'
    assert changed.body["stream_options"] == {"include_usage": True} and changed.raw.count(b'"stream_options"') == 1


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_cookie_the_upstream_sets_goes_with_no_other_request(stream):
    """Hosted APIs answer through load balancers that set cookies (Cloudflare's __cf_bm, a sticky session's). The
    gateway sends every session through one client per endpoint: a cookie it kept would go upstream with each later
    request, whoever's it is (and the run's agents share that client too). None is kept, and none is relayed."""
    async with FakeApi(set_cookie="affinity=of-session-a; Path=/") as api, \
            served(endpoints=[{"name": "up", "kind": "hosted", "base_url": api.base_url, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        for name in ("a", "b", "a"):
            answer = await post(client, s.url + "/responses", {"model": "m", "stream": stream, "input": "hi"},
                                headers={"X-Session-ID": name})
            assert answer.status == 200 and "set-cookie" not in answer.headers, answer.headers
    assert [seen.headers.get("cookie") for seen in api.seen] == [None, None, None]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_anthropics_prompt_is_its_input_and_its_cache_reads_and_writes(stream):
    """Anthropic counts a prompt in three parts: input_tokens (after the last cache breakpoint), tokens read from
    the prompt cache and tokens written to it. Claude Code marks its system prompt and history for caching, so on a
    hosted Anthropic upstream most of each prompt is in the last two: the session's prompt tokens (its context
    meter, its cost) are the three together, and its cached tokens the reads."""
    messages = {"model": "up-model", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    async with FakeApi(cache=(4000, 1500)) as api, served(endpoints=[{"name": "up", "kind": "hosted",
                                                                       "base_url": api.base_url, "model": "up-model"}]) \
            as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.root + "/a/cc/v1/messages", messages)
        assert answer.status == 200
        await until(lambda: s.of(ev.AgentMeters, "cc"), "the request's meters")
    turn, = s.of(ev.TurnFinished, "cc")
    meters, = s.of(ev.AgentMeters, "cc")
    assert turn.prompt_tokens == meters.prompt_tokens == 11 + 4000 + 1500
    assert meters.cached_tokens == 4000


def _ended_told(s, name: str) -> list[tuple[int, str]]:
    """Each request of session `name` as (attempt, how it ended), asserting each was started once and ended once; the
    console's mirror, fed the same events, has none of them left in flight."""
    from cerevisor_tui.ui.mirror import RunMirror

    mirror = RunMirror()
    for event in s.events:
        mirror(event)
    started = [e.attempt for e in s.of(ev.AgentStarted) if e.agent == name]
    ends = [(e.attempt, e.finish_reason) for e in s.of(ev.TurnFinished) if e.agent == name]
    ends += [(e.attempt, f"killed: {e.deadline}") for e in s.of(ev.AgentKilled) if e.agent == name]
    assert sorted(started) == sorted(n for n, _ in ends) == list(range(1, len(started) + 1)), (started, ends)
    assert not mirror.agents[name].in_flight and mirror.agents[name].attempt is None
    return sorted(ends)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_request_the_upstream_refuses_ends_told_and_leaves_no_request_in_flight(stream):
    """An upstream's own error (Anthropic's 529 overloaded, which Claude Code retries) is passed to the client as it
    came, and its attempt ends told (a TurnFinished saying why), as an answered one does: the row does not go on
    counting a request in flight, and the retry that follows is a request of its own."""
    messages = {"model": "up-model", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    lines = io.StringIO()
    async with FakeApi(error_status=529) as api, served(endpoints=[{"name": "up", "kind": "hosted",
                                                                    "base_url": api.base_url, "model": "up-model"}]) \
            as s, httpx.AsyncClient(timeout=30) as client:
        s.engine.subscribe(Printer(lines))
        for _ in range(2):  # the harness retries
            answer = await post(client, s.root + "/a/claude/v1/messages", messages)
            assert answer.status == 529 and answer.json()["error"]["type"] == "overloaded_error"
        session = s.session("claude")
        await until(lambda: not session.in_flight and session.st.status == "idle", "the requests' ends told")
        assert _ended_told(s, "claude") == [(1, "upstream answered 529"), (2, "upstream answered 529")]
        # two requests, no turn: the report and the headless line count a request that got no answer as one
        report = next(x for x in s.engine.report.to_dict()["sessions"] if x["name"] == "claude")
        assert (report["requests"], report["turns"], report["unanswered"]) == (2, 0, 2)
        assert report["output_tokens_per_s"] is None
    told = [line for line in lines.getvalue().splitlines() if "claude: request" in line and " sent to " not in line]
    assert len(told) == 2 and all("ended without its answer (upstream answered 529)" in line for line in told), told


async def test_every_way_a_request_ends_unanswered_is_told_once():
    """Broken off mid-stream, an upstream not answering, a client gone: each request's attempt ends with exactly one
    end (its reason on the TurnFinished, a kill as AgentKilled), so a console never shows a request in flight that
    is not."""
    async with served(sim={"drop_after_tokens": 3}) as s, httpx.AsyncClient(timeout=30) as client:
        answer = await post(client, s.url + "/chat/completions", chat(max_tokens=20), headers={"X-Session-ID": "dr"})
        assert "broke off" in answer.data[-1]["error"]["message"]
        await until(lambda: not s.session("dr").in_flight, "the request's end told")
        assert _ended_told(s, "dr") == [(1, "upstream broke off its answer")]
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with served(endpoints=[{"name": "far", "kind": "hosted", "base_url": closed, "model": "m"}]) as s, \
            httpx.AsyncClient(timeout=30) as client:
        assert (await post(client, s.url + "/chat/completions", chat(model="m"), headers={"X-Session-ID": "d"})
                ).status == 503
        await until(lambda: not s.session("d").in_flight, "the request's end told")
        assert _ended_told(s, "d") == [(1, "upstream not answering")]
