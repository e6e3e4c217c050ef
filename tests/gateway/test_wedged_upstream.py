"""A gateway session's requests on a wedged upstream (engine/wedge.py): every request in flight is ended with the
wedge's reason, long before the first-byte deadline, and the harness hears it in its API's error shape."""

from __future__ import annotations

import anyio
import httpx
import pytest

from cerevisor_tui.contract import events as ev

from ..conftest import until
from .conftest import Answer, chat, post, served

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_every_request_of_a_session_on_a_wedged_upstream_is_ended_with_the_wedge(stream):
    async with (
        served(
            sim={"wedge_after_s": 0.0},
            run={"metrics_interval_s": 0.2},
            stall={"first_byte_timeout_s": 600.0, "wedge_timeout_s": 1.0},
        ) as s,
        httpx.AsyncClient(timeout=120) as client,
        anyio.create_task_group() as group,
    ):
        answers: list[Answer] = []

        async def ask(session: str) -> None:
            answers.append(
                await post(
                    client,
                    s.url + "/chat/completions",
                    chat(max_tokens=4, stream=stream),
                    headers={"X-Session-ID": session},
                )
            )

        group.start_soon(ask, "w1")
        group.start_soon(ask, "w2")
        await until(lambda: len(answers) == 2, "both requests answered", timeout=60)
    wedged = [e for e in s.events if isinstance(e, ev.ServerWedged)]
    assert [(w.rule, sorted(w.agents)) for w in wedged] == [("frozen", ["w1", "w2"])]
    killed = [e for e in s.events if isinstance(e, ev.AgentKilled)]
    assert sorted(k.agent for k in killed) == ["w1", "w2"]
    assert all((k.deadline, k.reason) == ("wedge", wedged[0].reason) for k in killed)
    said = f"cerevisor gateway: the request was ended: {wedged[0].reason}"
    for answer in answers:  # a stream's headers were out: its error is the stream's last event
        if stream:
            assert answer.status == 200 and said in answer.frames[-1].decode()
        else:
            assert answer.status == 504 and answer.json()["error"]["message"] == said
