"""The simulator's HTTP face: a starlette app speaking the parts of vLLM's API the console and gateway use.

`/health`, `/v1/models`, `/metrics` with vLLM's metric names, and three ways to ask for an answer, each
streamed as SSE or not: `/v1/chat/completions` (chat.py), OpenAI's `/v1/responses` (responses.py) and
Anthropic's `/v1/messages` (messages.py). All three take one path here: the body read into a Prompt, an
engine sequence (`scheduler.BatchEngine`: KV cache, prefix reuse, batch, queue), its tokens streamed with
the configured faults, the counters kept; an API only reads its body and frames its answers and errors.

A streamed chat request with `"return_progress": true` also gets llama-server's `prompt_progress` chunks while
its prompt prefills (`_Progress`); the responses and messages APIs ignore the field, as they have no such event
here. Durations the server reports (`time_ms`, the latency histograms) are engine seconds over `speed`: what
a client's clock sees.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import text as simtext
from cerevisor_tui.sim import tools as simtools
from cerevisor_tui.sim.api import Api, ApiError, Finish, Frames, Reply, ToolCall
from cerevisor_tui.sim.chat import ChatApi
from cerevisor_tui.sim.chat import error_body as chat_error
from cerevisor_tui.sim.kv import KvCache
from cerevisor_tui.sim.messages import MessagesApi
from cerevisor_tui.sim.profiles import GIB, SimServerSpec, resolve
from cerevisor_tui.sim.responses import ResponsesApi
from cerevisor_tui.sim.scheduler import DONE, BatchEngine, Histogram, Sequence

OWNER = "cerevisor-sim"
_DROP = object()  # yielded by a stream to cut the connection without finishing the response


class RequestLog(deque[dict[str, Any]]):
    """The latest requests (what tests read back), bounded in entries and in the prompt text they keep: past
    `kept_bytes` of bodies, the oldest entries lose their `messages` and `body` (`body_bytes` stays). 1,000
    agent turns of 560 KB would otherwise hold half a gigabyte."""

    def __init__(self, maxlen: int, kept_bytes: int = 32 * 2**20) -> None:
        super().__init__(maxlen=maxlen)
        self.kept_bytes = kept_bytes
        self._held: deque[tuple[dict[str, Any], int]] = deque()  # entries still holding a body, oldest first
        self._held_bytes = 0

    def add(self, entry: dict[str, Any], body_bytes: int) -> None:
        entry["body_bytes"] = body_bytes
        self.append(entry)
        self._held.append((entry, body_bytes))
        self._held_bytes += body_bytes
        while self._held_bytes > self.kept_bytes and len(self._held) > 1:
            old, size = self._held.popleft()
            old["messages"] = old["body"] = None
            self._held_bytes -= size


@dataclass
class SimState:
    """What the simulated server did, for tests and for the console's label (in-process only)."""

    settings: SimSettings
    model: str
    spec: SimServerSpec
    engine: BatchEngine
    started_at: float = field(default_factory=time.monotonic)
    requests_total: int = 0  # requests received, in all three APIs
    completed_total: int = 0
    aborted_total: int = 0  # client went away before the end
    dropped_total: int = 0  # fault: connection cut by the server
    failed_total: int = 0  # fault: answered with fail_status
    rejected_total: int = 0  # 4xx: bad request, unknown model, too long
    requests: RequestLog = field(default_factory=lambda: RequestLog(1000))
    """The latest requests with their credential (Authorization, or x-api-key), in a bounded log."""
    requests_by_agent: Counter[str] = field(default_factory=Counter)
    """Requests per agent, from the `X-Cerevisor-Agent` header or the body (`user`, messages' `metadata.user_id`)."""

    @property
    def kv(self) -> KvCache:
        return self.engine.kv

    @property
    def running(self) -> int:
        return len(self.engine.running)

    @property
    def waiting(self) -> int:
        return len(self.engine.waiting)

    @property
    def max_running_seen(self) -> int:
        return self.engine.max_running_seen

    @property
    def preemptions_total(self) -> int:
        return self.engine.preemptions_total

    @property
    def cold_start_left_s(self) -> float:
        """Real seconds of cold start left (0 once loaded)."""
        end = self.started_at + self.settings.cold_start_s / self.settings.speed
        return max(0.0, end - time.monotonic())

    @property
    def loading(self) -> bool:
        return self.cold_start_left_s > 0

    @property
    def wedged(self) -> bool:
        """The wedge_after_s fault has struck: the engine moves no more, /health still says 200."""
        return self.engine.wedged


class _SimCollector:
    """Reads SimState at scrape time into vLLM-named metrics."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        st, eng, kv, spec = self.state, self.state.engine, self.state.kv, self.state.spec
        labels = ["engine", "model_name"]
        values = ["0", st.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", st.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", st.waiting)
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting.", labels=[*labels, "reason"])
        by_reason.add_metric([*values, "capacity"], st.waiting)  # the simulator waits only for room
        by_reason.add_metric([*values, "deferred"], 0.0)
        yield by_reason
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv.usage)
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      kv.queries_tokens)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      kv.hits_tokens)
        if kv.cpu_blocks:
            yield counter("vllm:external_prefix_cache_queries",
                          "External (CPU tier) prefix cache queries, in tokens.", kv.cpu_queries_tokens)
            yield counter("vllm:external_prefix_cache_hits",
                          "External (CPU tier) prefix cache hits, in tokens.", kv.cpu_hits_tokens)
            # the native offloading connector's names for its CPU tier (endpoints/tiers.py reads them)
            block_bytes = spec.block_size * spec.bytes_per_token
            yield counter("vllm:kv_offload_store_bytes", "Bytes stored from GPU to the CPU tier.",
                          kv.cpu_stored_blocks * block_bytes)
            yield counter("vllm:kv_offload_load_bytes", "Bytes loaded from the CPU tier to GPU.",
                          kv.cpu_loaded_blocks * block_bytes)
            yield gauge("vllm:kv_offload_cpu_cache_usage_perc", "CPU offload cache usage. 1 means 100 percent usage.",
                        kv.cpu_used_blocks / kv.cpu_blocks)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      eng.preemptions_total)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      eng.generation_tokens_total)
        yield counter("vllm:request_success", "Count of successfully processed requests.", st.completed_total)

        def histogram(name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
            m = HistogramMetricFamily(name, doc, labels=labels)
            m.add_metric(values, h.cumulative(), h.sum)
            return m

        yield histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                        eng.ttft_s)
        yield histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
                        eng.queue_time_s)
        yield histogram("vllm:request_prefill_time_seconds",
                        "Histogram of time spent in PREFILL phase for request.", eng.prefill_time_s)
        yield histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        eng.inter_token_s)
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks",
                    "kv_cache_size_tokens", "kv_cache_memory_bytes", "kv_offloading_size",
                    "max_model_len", "engine"],
        )
        offload_gib = spec.num_cpu_blocks * spec.block_size * spec.bytes_per_token / GIB
        info.add_metric(
            [str(spec.block_size), "auto", "True", str(spec.num_gpu_blocks), str(spec.num_cpu_blocks),
             str(spec.kv_cache_tokens), str(spec.kv_cache_tokens * spec.bytes_per_token),
             str(offload_gib) if spec.num_cpu_blocks else "None",
             str(spec.max_model_len), "0"],
            1.0,
        )
        yield info
        yield counter("cerevisor_sim:aborted_requests", "Requests whose client went away before the end.",
                      st.aborted_total)
        yield counter("cerevisor_sim:dropped_requests", "Connections cut by the drop_after_tokens fault.",
                      st.dropped_total)
        yield counter("cerevisor_sim:computed_prompt_tokens", "Prompt tokens computed (not served from cache).",
                      eng.computed_prompt_tokens_total)
        yield gauge("cerevisor_sim:engine_time_seconds", "Simulated time of the engine clock.", eng.now)


class _Stream(Response):
    """An SSE response that ends when the client goes away and can cut the connection on purpose."""

    def __init__(self, chunks: AsyncGenerator[bytes | object, None], on_disconnect: Callable[[], None]) -> None:
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        self.chunks = chunks
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        complete = False

        async def pump() -> None:
            nonlocal complete
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                if chunk is _DROP:
                    return  # uvicorn closes the transport of a response that never completes
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            complete = True

        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                if not complete:
                    self.on_disconnect()
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                await pump()
            finally:
                tg.cancel_scope.cancel()  # done, or dropped on purpose: stop listening
        await self.chunks.aclose()


class _Server:
    """The one request path of every API: read the body into a Prompt, check it, run it as an engine Sequence,
    then stream its tokens (with the faults) or wait for the whole answer, counting as it goes. An API only
    reads the body and frames the answer (sim/api.py)."""

    def __init__(self, state: SimState) -> None:
        self.state = state

    def route(self, api: Api) -> Route:
        async def endpoint(request: Request) -> Response:
            return await self.handle(request, api)

        return Route(api.path, endpoint, methods=["POST"])

    async def handle(self, request: Request, api: Api) -> Response:
        st, settings = self.state, self.state.settings
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as exc:
            st.rejected_total += 1
            return api.error(400, f"Invalid JSON body: {exc}")
        try:
            prompt = api.read(body)
        except ApiError as exc:
            st.rejected_total += 1
            return api.error(exc.status, exc.message, param=exc.param)
        model = prompt.model or st.model
        if model != st.model:
            st.rejected_total += 1
            return api.error(404, api.unknown_model(model), param="model")
        st.requests_total += 1
        auth = request.headers.get("authorization") or request.headers.get("x-api-key")
        agent = request.headers.get("x-cerevisor-agent") or prompt.agent
        st.requests.add({"api": api.name, "model": model, "messages": prompt.messages,
                            "max_tokens": prompt.max_tokens, "stream": prompt.stream, "authorization": auth,
                            "has_authorization": auth is not None, "agent": agent,
                            "request_id": request.headers.get("x-request-id"), "body": prompt.body,
                            # what routers read (X-Session-ID and the like); never the key
                            "headers": {k: v for k, v in request.headers.items()
                                        if k not in ("authorization", "x-api-key")}}, len(raw))
        if agent:
            st.requests_by_agent[agent] += 1
        if st.requests_total <= settings.fail_first:
            st.failed_total += 1
            status = settings.fail_status
            headers = {"Retry-After": "1"} if status == 429 else None
            return api.error(status, f"Simulated failure {st.requests_total} of {settings.fail_first}",
                             headers=headers)
        left = st.cold_start_left_s
        if left > 0:
            await asyncio.sleep(left)
        rendered = simtext.render_prompt(prompt.messages)
        prompt_tokens = simtext.count_tokens(rendered)
        max_tokens = prompt.max_tokens
        explicit = max_tokens is not None
        if not explicit:
            max_tokens = min(settings.max_tokens_default, max(1, st.spec.max_model_len - prompt_tokens))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            st.rejected_total += 1
            return api.error(400, f"max_tokens must be at least 1, got {max_tokens!r}", param="max_tokens")
        limit = st.spec.max_model_len
        if prompt_tokens + max_tokens > limit:
            st.rejected_total += 1
            return api.error(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        if prompt.max_tokens_is_cap:  # the answer's own length, unless max_tokens cuts it
            explicit = max_tokens < settings.max_tokens_default
            max_tokens = min(max_tokens, settings.max_tokens_default)
        chosen = simtools.choose_call(prompt.tools, prompt.messages, settings, rendered)
        call = ToolCall(*chosen) if chosen is not None else None
        if call is not None:  # the answer is a tool call: its arguments stream as its tokens
            max_tokens = len(simtools.pieces(call.arguments))
        wants_progress = api.prompt_progress and prompt.stream and prompt.body.get("return_progress") is True
        seq = Sequence(
            prompt_tokens=prompt_tokens,
            hashes=simtext.block_hashes(rendered, st.spec.block_size),
            max_tokens=max_tokens,
            notify_each_token=prompt.stream,
            notify_progress=wants_progress,
        )
        st.engine.submit(seq)
        words = (iter(simtools.pieces(call.arguments)) if call is not None
                 else simtext.words(simtext.text_seed(settings.seed, rendered)))
        finish: Finish = "tool_calls" if call is not None else "length" if explicit else "stop"
        reply = Reply(id=api.new_id(), model=model, created=int(time.time()), seq=seq, finish=finish, call=call,
                      prompt=prompt)
        if prompt.stream:
            frames = api.frames(reply)
            progress = _Progress(st.engine, seq, frames, settings.progress_every_tokens) if wants_progress else None
            return _Stream(self._events(reply, words, frames, progress), lambda: self._abort(seq))
        return await self._whole(request, reply, words, api)

    def _abort(self, seq: Sequence) -> None:
        if self.state.engine.abort(seq):
            self.state.aborted_total += 1

    async def _whole(self, request: Request, reply: Reply, words: Iterator[str], api: Api) -> Response:
        seq = reply.seq

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            self._abort(seq)

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            while seq.phase != DONE and not seq.closed and not seq.aborted:
                seq.changed.clear()
                await seq.changed.wait()
        finally:
            watcher.cancel()
        if seq.aborted or seq.closed:
            return Response(status_code=499)
        self.state.completed_total += 1
        return JSONResponse(api.whole(reply, "".join(itertools.islice(words, seq.generated))))

    async def _events(self, reply: Reply, words: Iterator[str], frames: Frames,
                      progress: _Progress | None) -> AsyncGenerator[bytes | object, None]:
        st, settings, seq = self.state, self.state.settings, reply.seq
        keepalive = settings.keepalive_s / settings.speed if settings.keepalive_s > 0 else None
        drop_at, bad_at = settings.drop_after_tokens, settings.malformed_after_tokens
        sent = 0
        quiet_since = time.monotonic()  # the last thing sent, for the keep-alives
        try:
            while True:
                if seq.closed:  # the server is shutting down
                    failure = frames.failure("The server is shutting down.")
                    yield _DROP if failure is None else failure.encode()
                    return
                ready = seq.generated
                if ready > sent:
                    out: list[str] = []
                    if sent == 0:
                        if progress is not None:
                            out.append(progress.due())
                            out.append(progress.final())
                        out.append(frames.opening())
                    while sent < ready:
                        if sent == drop_at:
                            break
                        if sent == bad_at:
                            out.append(frames.malformed())
                        out.append(frames.piece(next(words)))
                        sent += 1
                    if out:
                        yield "".join(out).encode()
                        quiet_since = time.monotonic()
                    if sent == drop_at:
                        st.engine.abort(seq)
                        st.dropped_total += 1
                        yield _DROP
                        return
                elif progress is not None and sent == 0:
                    events = progress.due()
                    if events:
                        yield events.encode()
                        quiet_since = time.monotonic()
                if seq.phase == DONE and sent >= seq.generated:
                    if seq.aborted:
                        return
                    st.completed_total += 1
                    yield frames.closing().encode()
                    return
                seq.changed.clear()
                if seq.generated > sent or seq.phase == DONE or seq.closed:
                    continue
                waits = []
                if progress is not None and sent == 0:
                    if progress.pending():
                        continue
                    next_s = progress.next_in_s()
                    if next_s is not None:
                        waits.append(max(next_s, 0.001))
                if keepalive is not None:
                    waits.append(max(0.0, quiet_since + keepalive - time.monotonic()))
                if not waits:
                    await seq.changed.wait()
                    continue
                try:  # asyncio.timeout, not wait_for: 3.11's wait_for may lose a cancel that comes as it ends
                    async with asyncio.timeout(min(waits)):
                        await seq.changed.wait()
                except TimeoutError:
                    if keepalive is not None and time.monotonic() >= quiet_since + keepalive:
                        yield b": keep-alive\n\n"
                        quiet_since = time.monotonic()
        finally:
            if seq.phase != DONE:
                self._abort(seq)


class _Progress:
    """llama-server's prompt_progress for one streamed request, as `--return-progress` clients see it.

    As llama-server does (server-context.cpp, send_partial_response with is_progress): a first event when its
    prompt starts processing (`processed` = the cached tokens), one after each batch of `every` tokens, and
    one with `processed` = `total` just before the first token. A preempted request starts again from its
    new admission's cache. The events fall at the times the engine's prefill rate puts them, however coarse
    its steps (BatchEngine.prompt_progress)."""

    def __init__(self, engine: BatchEngine, seq: Sequence, frames: Frames, every: int) -> None:
        self.engine, self.seq, self.frames, self.every = engine, seq, frames, every
        self.admission = 0  # the admission the events so far are about
        self.last = -1  # `processed` of the latest event

    def _event(self, processed: int) -> str:
        seq = self.seq
        elapsed_s = (self.engine.sim_time() - seq.admitted_at) / self.engine.p.speed
        self.last = processed
        return self.frames.progress(seq.prompt_tokens, seq.progress_base, processed, int(elapsed_s * 1000))

    def pending(self) -> bool:
        """An event is due now."""
        processed = self.engine.prompt_progress(self.seq)
        if processed is None:
            return False
        return self.seq.admissions != self.admission or processed >= self.last + self.every

    def due(self) -> str:
        """The events due now, in order ("" for none)."""
        seq = self.seq
        processed = self.engine.prompt_progress(seq)
        if processed is None:
            return ""
        out = []
        if seq.admissions != self.admission:
            self.admission = seq.admissions
            out.append(self._event(seq.progress_base))
        while self.last + self.every <= processed:
            out.append(self._event(self.last + self.every))
        return "".join(out)

    def final(self) -> str:
        """The event of the whole prompt processed, if not sent yet (the first token is on its way)."""
        seq, out = self.seq, ""
        if seq.admissions != self.admission:  # its whole prefill fell between two looks
            self.admission = seq.admissions
            out = self._event(seq.progress_base)
        if self.last < seq.prompt_tokens:
            out += self._event(seq.prompt_tokens)
        return out

    def next_in_s(self) -> float | None:
        """Real seconds until the next event, if the engine's step under way reaches it; None: wait for it."""
        return self.engine.seconds_until_processed(self.seq, self.last + self.every)


class _QuietIncomplete(logging.Filter):
    """Hide uvicorn's error line for a response cut on purpose (the drop fault)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in record.getMessage()


_filter_installed = False


def _install_log_filter() -> None:
    global _filter_installed
    if not _filter_installed:
        logging.getLogger("uvicorn.error").addFilter(_QuietIncomplete())
        _filter_installed = True


def create_app(settings: SimSettings, *, model: str = "sim-model") -> Starlette:
    """A starlette app serving one simulated model; `app.state.sim` is its SimState."""
    spec = resolve(settings)
    kv = KvCache(spec.num_gpu_blocks, spec.block_size, spec.num_cpu_blocks)
    state = SimState(settings=settings, model=model, spec=spec, engine=BatchEngine(spec.params, kv))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SimCollector(state))
    _install_log_filter()

    server = _Server(state)

    async def health(request: Request) -> Response:
        if state.loading:
            return JSONResponse(chat_error(503, "Loading model"), status_code=503)
        return Response(status_code=200)

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model, "object": "model", "created": int(state.started_at), "owned_by": OWNER, "root": model,
            "parent": None, "max_model_len": spec.max_model_len}]})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        *(server.route(api) for api in (ChatApi(), ResponsesApi(), MessagesApi())),
        Route("/metrics", metrics, methods=["GET"]),
    ])
    app.state.sim = state
    return app
