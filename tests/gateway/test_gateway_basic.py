from __future__ import annotations

import json

import httpx
import pytest

from cerevisor_tui.contract import events as ev

from .conftest import served

pytestmark = pytest.mark.anyio


async def test_chat_streamed_passes_through_and_is_a_session():
    async with served() as s, httpx.AsyncClient() as client:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "max_tokens": 6}
        async with client.stream("POST", s.url + "/chat/completions", json=body,
                                 headers={"X-Session-ID": "alpha"}) as r:
            assert r.status_code == 200
            assert r.headers["x-accel-buffering"] == "no"
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        frames = [f for f in raw.split(b"\n\n") if f and not f.startswith(b":")]  # (keep-alive comments)
        assert frames[-1] == b"data: [DONE]"
        words = [json.loads(f[6:])["choices"][0]["delta"].get("content") for f in frames[:-1]
                 if json.loads(f[6:])["choices"]]
        assert len([w for w in words if w]) == 6
        opened = s.of(ev.SessionOpened)
        assert [(o.agent, o.source) for o in opened] == [("alpha", "x-session-id")]
        turns = s.of(ev.TurnFinished, "alpha")
        assert turns and turns[0].completion_tokens == 6
