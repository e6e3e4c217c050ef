"""A property of the gateway's whole HTTP surface, driven by hypothesis over a raw socket (paths as written, dots,
escapes and control characters included; any method; credentials in any header; bodies valid, random, nested deep
or not JSON at all; model names with control characters), against a hostile upstream that repeats the run's key in
its answers (tests/gateway/hostile.py). Whatever is sent:

- the gateway answers with a status line, never a 5xx of its own (the upstream here never says one), never a
  traceback (its `failed` count and uvicorn's error log stay empty);
- the upstream is asked only under its base path, with every segment plain, and the governed APIs only through
  the governor (a governed path upstream carries the run's request id);
- no credential crosses to the wrong side: the client's never reaches the upstream, the run's never a client.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import served
from .hostile import KEY, KEY_ENV, Hostile, raw_request, status_of

CLIENT_KEY = "sk-gw-prop-8e7d6c5b4a39"
CLIENT_SECRET = "client-cred-1f2e3d4c5b"
GOVERNED = ("/v1/chat/completions", "/v1/messages", "/v1/responses")
_PLAIN_TARGET = re.compile(r"/v1(/[A-Za-z0-9._~:@+=,-]+)+")


class Background:
    """The run, its gateway and the hostile upstream, served from a thread of their own for the whole module."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.errors: list[logging.LogRecord] = []
        self.thread = threading.Thread(target=anyio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        async with Hostile() as up:
            endpoint = {"name": "up", "kind": "hosted", "base_url": up.base_url, "model": "up-model",
                        "api_key_env": KEY_ENV}
            async with served(endpoints=[endpoint], run={"max_concurrency": 4096},
                              gateway={"keys_env": ["GW_PROP_KEY"], "release_after_s": 0,
                                       "model_map": {"claude-*": "up-model"}}) as s:
                self.up, self.s = up, s
                self.ready.set()
                await anyio.to_thread.run_sync(self.stop.wait)


class _Errors(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.ERROR)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


@pytest.fixture(scope="module")
def surface() -> Iterator[Background]:
    saved = {name: os.environ.get(name) for name in (KEY_ENV, "GW_PROP_KEY")}
    os.environ[KEY_ENV], os.environ["GW_PROP_KEY"] = KEY, CLIENT_KEY
    bg = Background()
    handler = _Errors(bg.errors)
    logging.getLogger("uvicorn.error").addHandler(handler)
    bg.thread.start()
    assert bg.ready.wait(60), "the gateway did not start"
    try:
        yield bg
    finally:
        bg.stop.set()
        bg.thread.join(60)
        logging.getLogger("uvicorn.error").removeHandler(handler)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


SEGMENTS = ["v1", "chat", "completions", "messages", "responses", "models", "embeddings", "a", "x", "slots",
            "admin", ".", "..", "%2e", "%2E%2e", "%2f", "%2F", "%3f", "%23", "%25", "%252e", "%00", "%0d%0a", "%1b",
            "%5c", "%20", "%ff", "", "chat%2fcompletions", "..%2f..%2fslots%3faction%3derase", "ok~name"]
PREFIXES = ["/v1/", "/a/x/v1/", "/a/%2e%2e/v1/", "/", "//v1/", "/v1"]
MODES = ["hi", "echo-error", "echo-frame", "echo-whole", "echo-stream", "string-message", "deep-frame",
         "huge-progress"]
CREDENTIAL_HEADERS = ["api-key", "x-goog-api-key", "openai-organization", "chatgpt-account-id", "cookie",
                      "proxy-authorization", "x-custom-token"]

models = st.one_of(st.just("up-model"), st.sampled_from(["claude-sonnet", "gpt-x", "claude-\x1b]0;T\x07"]),
                   st.text(max_size=20))
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=12)


@st.composite
def bodies(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["chat", "messages", "responses", "json", "deep", "garbage", "empty"]))
    if kind in ("chat", "messages"):
        body: dict[str, Any] = {"model": draw(models), "max_tokens": 4, "stream": draw(st.booleans()),
                                "messages": [{"role": "user", "content": draw(st.sampled_from(MODES))}]}
        return json.dumps(body).encode()
    if kind == "responses":
        return json.dumps({"model": draw(models), "input": draw(st.sampled_from(MODES + [[1], []]))}).encode()
    if kind == "json":
        return json.dumps(draw(json_values)).encode()
    if kind == "deep":
        n = draw(st.integers(60, 3000))
        return b'{"model": "up-model", "messages": ' + b"[" * n + b"]" * n + b"}"
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    return b""


@st.composite
def requests(draw: Any) -> tuple[str, bytes]:
    method = draw(st.sampled_from(["POST", "POST", "GET", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]))
    path = draw(st.sampled_from(PREFIXES)) + "/".join(draw(st.lists(st.sampled_from(SEGMENTS), max_size=5)))
    headers = {"host": "x", "connection": "close", "content-type": "application/json"}
    if draw(st.booleans()):
        headers[draw(st.sampled_from(["authorization", "x-api-key"]))] = \
            f"Bearer {CLIENT_KEY}" if draw(st.booleans()) else CLIENT_KEY
    for name in draw(st.lists(st.sampled_from(CREDENTIAL_HEADERS), max_size=3, unique=True)):
        headers[name] = CLIENT_SECRET
    if draw(st.booleans()):
        headers["x-session-id"] = draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=12)) \
            or "s"
    body = draw(bodies())
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return path, head.encode() + f"content-length: {len(body)}\r\n\r\n".encode() + body


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_the_gateways_surface_holds_whatever_is_sent(surface: Background, request: tuple[str, bytes]) -> None:
    path, raw = request
    up, s = surface.up, surface.s
    before = len(up.seen)
    answer = anyio.run(raw_request, s.server.host, s.server.port, raw)
    status = status_of(answer)
    assert 100 <= status < 500, (path, answer[:300])
    assert KEY not in answer.decode("utf-8", "replace"), (path, answer[:300])
    assert getattr(s.server.gateway, "failed", 0) == 0 and not surface.errors, (path, surface.errors)
    prefix = s.engine.conversations.request_prefix
    for seen in up.seen[before:]:
        if seen.target.endswith(("/metrics", "/health")):
            continue
        target = seen.target.partition("?")[0]
        assert _PLAIN_TARGET.fullmatch(target), (path, seen.target)
        assert ".." not in target.split("/") and "." not in target.split("/")
        if target in GOVERNED:
            assert seen.method == "POST" and seen.headers.get("x-request-id", "").startswith(prefix), (path, seen)
        sent = json.dumps(seen.headers) + seen.target
        assert CLIENT_KEY not in sent and CLIENT_SECRET not in sent, (path, seen.headers)
