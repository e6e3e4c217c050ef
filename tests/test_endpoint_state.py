"""Each endpoint's state (engine/endpoint_state.py), its rules on a virtual clock: a port that never answered is
down after its grace, counted from its first refusal; a server seen up is down after a few failed looks in a row;
loading only while the server says so; wedged while its looks say up; and each change told once."""

from __future__ import annotations

import pytest

from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.metrics import ServerStatus
from cerevisor_tui.engine.clock import VirtualClock
from cerevisor_tui.engine.endpoint_state import DOWN_AFTER_CHECKS, EndpointStates, address
from cerevisor_tui.engine.sinks.printer import Printer

URL = "http://127.0.0.1:8399/v1"
REFUSED = ServerStatus(URL, reachable=False, error="health: connection refused")
UP = ServerStatus(URL, reachable=True, health_status=200)
LOADING = ServerStatus(URL, reachable=True, health_status=503, loading=True, loading_message="Loading model")

pytestmark = pytest.mark.anyio


def owner(down_after_s: float = 30.0) -> tuple[EndpointStates, VirtualClock, list[ev.EndpointState]]:
    told: list[ev.EndpointState] = []
    clock = VirtualClock(start=100.0)
    states = EndpointStates(told.append, clock, {"vllm0": URL}, down_after_s)  # type: ignore[arg-type]
    return states, clock, told


async def test_a_port_that_never_answered_is_down_after_its_grace_from_its_first_refusal():
    states, clock, told = owner(30.0)
    assert states.refused("vllm0") is None  # a request's refusal starts the grace
    await clock.advance(29.0)
    states.looked("vllm0", REFUSED)
    assert not told and states.down_at("vllm0") == 130.0
    await clock.advance(1.0)
    states.looked("vllm0", REFUSED)
    [down] = told
    assert (down.endpoint, down.state, down.since) == ("vllm0", "down", 100.0)
    assert down.why == "connection refused at 127.0.0.1:8399; it has never answered"
    assert states.refused("vllm0") == 30.0  # a request is told at once now
    await clock.advance(12.0)
    states.looked("vllm0", REFUSED)
    assert len(told) == 1  # the same state: no news
    assert Printer.describe(down) == "vllm0: DOWN: connection refused at 127.0.0.1:8399; it has never answered"


async def test_a_server_seen_up_that_refuses_is_down_after_a_few_failed_looks_and_up_when_it_answers():
    states, clock, told = owner(0.5)
    states.looked("vllm0", UP)
    assert [e.state for e in told] == ["up"]
    for _ in range(DOWN_AFTER_CHECKS - 1):
        await clock.advance(2.0)
        states.looked("vllm0", REFUSED)
        assert states.refused("vllm0") is None  # seen up: a restart waits, never a 503
    assert [e.state for e in told] == ["up"]  # one or two failed looks are a blip
    await clock.advance(2.0)
    states.looked("vllm0", REFUSED)
    assert told[-1].state == "down" and told[-1].since == 102.0  # since its first failed look
    assert "connection refused at 127.0.0.1:8399" in told[-1].why
    await clock.advance(2.0)
    states.looked("vllm0", UP)
    assert [e.state for e in told] == ["up", "down", "up"]


async def test_loading_lasts_while_the_server_says_so_and_a_wedge_while_its_looks_say_up():
    states, clock, told = owner()
    states.looked("vllm0", LOADING)
    states.looked("vllm0", LOADING)
    assert [(e.state, e.why) for e in told] == [("loading", "Loading model")]
    await clock.advance(5.0)
    states.looked("vllm0", UP)
    states.wedged("vllm0", "server wedged: no progress for 45 s")
    states.looked("vllm0", UP)  # its /health says 200: it is still wedged
    assert [e.state for e in told] == ["loading", "up", "wedged"]
    states.moves_again("vllm0")
    assert [e.state for e in told] == ["loading", "up", "wedged", "up"]


async def test_a_request_that_connects_brings_a_never_answered_endpoint_up_and_ends_its_grace():
    states, clock, told = owner(1.0)
    states.refused("vllm0")
    await clock.advance(2.0)
    assert states.refused("vllm0") == 2.0
    states.answered("vllm0")
    assert [e.state for e in told] == ["down", "up"]
    assert states.down_at("vllm0") is None and states.refused("vllm0") is None


def test_an_address_is_host_and_port_as_typed():
    assert address("http://127.0.0.1:8399/v1") == "127.0.0.1:8399"
    assert address("https://api.example.com/v1") == "api.example.com:443"
    assert address("http://[::1]:8000/v1") == "[::1]:8000"
