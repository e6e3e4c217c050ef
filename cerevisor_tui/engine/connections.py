"""The run's connections to its endpoints: an HTTP client for each (and the built-in simulator where one is
configured without a URL), the model each is asked for, and who reads the agents' streams (this process, or
the stream worker process of endpoints/worker.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from cerevisor_tui.config.models import Config, EndpointConfig
from cerevisor_tui.config.secrets import key_problem
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.client import ChatStream, build_client, list_models
from cerevisor_tui.endpoints.errors import EndpointError, EndpointUnreachable, MissingApiKey, StreamBroken
from cerevisor_tui.endpoints.metrics import server_root
from cerevisor_tui.engine.clock import MONOTONIC, Clock

if TYPE_CHECKING:
    from cerevisor_tui.endpoints.worker import RemoteStream, StreamWorker

PROPS_TIMEOUT_S = 2.0  # a /props that takes longer says nothing: the request goes without asking for progress
MODELS_TIMEOUT_S = 2.0  # the longest an answer's meters wait for /v1/models (its context length)


class Connections:
    """Open for the length of a run (`open`); `stream` gives an attempt its stream, read where the run reads."""

    def __init__(self, config: Config, emit: Callable[[ev.Event], None], *, stream_process: bool = False,
                 clock: Clock = MONOTONIC) -> None:
        self.config = config
        self.emit = emit
        self.clock = clock  # the run's: the time of what it tells
        # the agents' streams read by a worker process (endpoints/worker.py) rather than in this loop
        self.stream_process = stream_process
        self.stream_process_problem = ""  # why the worker could not start, if it could not
        self.base_urls: dict[str, str] = {ep.name: ep.base_url for ep in config.endpoints}
        self.models: dict[str, str] = {ep.name: ep.model for ep in config.endpoints if ep.model}
        self.clients: dict[str, httpx.AsyncClient] = {}
        # the model's context length per endpoint (configured, or vLLM's max_model_len from /v1/models); 0: unknown
        self.max_model_len: dict[str, int] = {ep.name: ep.max_model_len for ep in config.endpoints if ep.max_model_len}
        self.worker: StreamWorker | None = None
        self._model_locks: dict[str, anyio.Lock] = {}
        # what serves each endpoint (metrics.ServerKind), once its /props or the monitor's /metrics told
        self.server_kinds: dict[str, str] = {}
        self._kind_locks: dict[str, anyio.Lock] = {}

    async def open(self, stack: AsyncExitStack) -> None:
        """A client per endpoint (and its simulator, and the stream worker), closed when `stack` closes."""
        cap = max(self.config.run.max_concurrency, *(ep.max_concurrency for ep in self.config.endpoints), 1)
        for ep in self.config.endpoints:
            key = api_key(ep)
            if ep.kind == "simulated" and not ep.base_url:
                from cerevisor_tui.sim import SimServer

                server = await stack.enter_async_context(SimServer(ep.sim, port=0, model=ep.model or "sim-model"))
                self.base_urls[ep.name] = server.base_url
            client = build_client(min(cap, ep.max_concurrency), key)
            self.clients[ep.name] = await stack.enter_async_context(client)
        if self.stream_process:
            from cerevisor_tui.endpoints.worker import StreamWorker

            worker = StreamWorker()
            for ep in self.config.endpoints:
                worker.add_client(ep.name, min(cap, ep.max_concurrency), ep.api_key_env)
            try:
                self.worker = await stack.enter_async_context(worker)
            except EndpointError as exc:  # a machine that cannot start it still runs, reading in this process
                self.stream_process_problem = exc.problem

    async def model(self, ep: EndpointConfig) -> str:
        """The model id to request: configured, or the first that /v1/models lists (asked once)."""
        if ep.name in self.models:
            return self.models[ep.name]
        lock = self._model_locks.setdefault(ep.name, anyio.Lock())
        async with lock:
            if ep.name not in self.models:
                listed = await list_models(self.clients[ep.name], ep.name, self.base_urls[ep.name])
                if not listed:
                    raise EndpointError(ep.name, "/v1/models lists no model; set model in the endpoint's config")
                self.models[ep.name] = str(listed[0]["id"])
                self._take_max_model_len(ep.name, listed)
                self.emit(ev.ModelResolved(self.clock.now(), ep.name, self.models[ep.name]))
        return self.models[ep.name]

    async def context_limit(self, ep: EndpointConfig) -> int:
        """The model's context length (for the context-fill meter): configured, or what /v1/models said of it
        (a hosted API's list says nothing of it); 0 when unknown. Never raises, and waits at most
        MODELS_TIMEOUT_S: an answer's meters are what waits on it, and a server that froze (or went) right
        after an answer must not hold its agent. Asked once, and again at a later answer when it went unanswered
        (a server that refused it or answered without the figure is not asked again)."""
        if ep.name not in self.max_model_len:
            self.max_model_len[ep.name] = 0  # (an answer beside this one, meanwhile: unknown)
            if ep.kind != "hosted" and ep.name in self.clients:
                try:
                    listed = await list_models(self.clients[ep.name], ep.name, self.base_urls[ep.name],
                                               timeout_s=MODELS_TIMEOUT_S)
                except (EndpointUnreachable, StreamBroken):
                    del self.max_model_len[ep.name]
                    return 0
                except EndpointError:
                    return 0
                self._take_max_model_len(ep.name, listed)
        return self.max_model_len[ep.name]

    async def asks_progress(self, ep: EndpointConfig) -> bool:
        """Whether the endpoint's requests ask for prefill progress (`prompt_progress`): always or never as
        configured; "auto" on a llama.cpp server, told by its /props (asked until it answers) or its metrics."""
        if ep.prompt_progress != "auto":
            return ep.prompt_progress == "on"
        if ep.kind == "hosted":
            return False
        if ep.name not in self.server_kinds:
            async with self._kind_locks.setdefault(ep.name, anyio.Lock()):
                if ep.name not in self.server_kinds:
                    kind = await props_kind(self.clients[ep.name], self.base_urls[ep.name])
                    if kind:
                        self.server_kinds[ep.name] = kind
        return self.server_kinds.get(ep.name) == "llamacpp"

    def _take_max_model_len(self, endpoint: str, listed: list[dict[str, Any]]) -> None:
        model = self.models.get(endpoint)
        card = next((m for m in listed if m.get("id") == model), listed[0] if listed else {})
        value = card.get("max_model_len")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and not self.max_model_len.get(endpoint):
            self.max_model_len[endpoint] = value
        self.max_model_len.setdefault(endpoint, 0)  # the list was read: context_limit does not ask for it again

    def chat_url(self, endpoint: str) -> str:
        return self.base_urls[endpoint].rstrip("/") + "/chat/completions"

    def stream(self, endpoint: str, url: str, body: dict[str, Any],
               headers: dict[str, str]) -> ChatStream | RemoteStream:
        """One request's stream: read by the stream worker while it runs, else in this process."""
        if self.worker is not None:
            return self.worker.stream(endpoint, url, body, headers)
        return ChatStream(self.clients[endpoint], endpoint, url, body, headers)


async def props_kind(client: httpx.AsyncClient, base_url: str) -> str:
    """"llamacpp" when the server's /props answers as llama-server's does (its slots and generation settings),
    "unknown" when it answers otherwise; "" when it cannot say yet (not up, still loading: ask again later)."""
    try:
        response = await client.get(server_root(base_url) + "/props", timeout=httpx.Timeout(PROPS_TIMEOUT_S))
    except httpx.HTTPError:
        return ""
    if response.status_code >= 500:
        return ""
    try:
        props = response.json() if response.status_code == 200 else None
    except ValueError:
        props = None
    llama = isinstance(props, dict) and ("default_generation_settings" in props or "total_slots" in props)
    return "llamacpp" if llama else "unknown"


def api_key(ep: EndpointConfig) -> str | None:
    """The endpoint's API key, from the environment variable its config names (never from a file); one
    that cannot go in an HTTP header is refused, naming the variable, never showing the value."""
    if not ep.api_key_env:
        return None
    value = os.environ.get(ep.api_key_env)
    if not value:
        raise MissingApiKey(ep.name, f"environment variable {ep.api_key_env} (api_key_env) is not set")
    problem = key_problem(value)
    if problem:
        raise MissingApiKey(ep.name, f"environment variable {ep.api_key_env} (api_key_env) {problem}")
    return value


def wants_stream_process(config: Config, *, console: bool) -> bool:
    """`[run] stream_process`: "auto" reads the streams in a second process in the console (where drawing
    competes with reading for the loop) when there is a second CPU to run it on."""
    setting = config.run.stream_process
    if setting == "auto":
        return console and (os.cpu_count() or 1) >= 2
    return setting == "on"
