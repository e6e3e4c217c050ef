"""Client-side cost of streaming, side by side: a bare httpx loop, the openai SDK, cerevisor-tui's engine, aiperf.

A fast vLLM-shaped SSE server runs in a process of its own (raw asyncio, precomputed bytes, 16
`chat.completion.chunk` events per write, each stream as fast as the socket takes it). Each client runs
in a fresh process of its own, one after the other and interleaved (A B C, then C B A, ...):

  A  bare httpx: `aiter_lines()` + `json.loads`, the practical ceiling of an httpx client
  B  the official `openai` SDK: `AsyncOpenAI(...).chat.completions.create(stream=True)`
  C  cerevisor-tui's engine as `cerevisor-tui run` drives it: Engine with its watchdog and report, the
     journal (events.jsonl and transcripts in a run directory) and the printer, one agent per stream
  D  NVIDIA's aiperf load generator (`aiperf profile`, streaming chat, the same concurrency, output length
     and URL). It pins Textual 5 and Rich 14, so it lives in a venv of its own: --aiperf PATH, or `aiperf`
     on PATH; without it D is left out and the script says why
  R  with --baseline REF: C, its streams read by the ChatStream of endpoints/client.py as of git REF (to
     measure a change to the stream parser side by side with the code it replaces)

N concurrent streams (64 and 256 by default), one request each, --total-tokens split over them. The figure
that matters is tokens per client CPU-second: the client process's own user+system time between 10% and
45% of the run's tokens, when every stream has started and none has ended (connecting and closing are
left out; see Meter). The server shares the same cores, so wall tokens/s measures the machine as much as
the client; it is printed too. Medians over --repeats rounds; the ratios C/A and C/B are computed per
round, then their median is shown. B is twenty times slower: its streams are as long (--b-share of the
tokens, 256 a stream at 256 streams; shorter ones let its per-request cost into the figure) and it is
measured over a shorter window (--b-window).

D is a tree of processes (a controller, workers, record processors, a dataset manager...) that parses
each response after it ends, so it cannot be measured over a window: its figure is the difference of two
runs with the same requests, of the full length and of 16 tokens, each the CPU time of its whole process
tree (see run_aiperf). The whole run's figure, start-up included, is printed beside it. aiperf counts
tokens from the server's usage report (--use-server-token-count: no tokenizer in its hot path, as in ours),
and is given a tiny word-level tokenizer written here: it loads one even so, and its built-in one would
download tiktoken's table.

    python benchmarks/client_throughput.py                       # 64 and 256 streams, 3 rounds (~2 min; ~5 with D)
    python benchmarks/client_throughput.py --concurrency 256 --repeats 5
    python benchmarks/client_throughput.py --events-per-write 1  # one event per write
    python benchmarks/client_throughput.py --aiperf ~/.venvs/aiperf/bin/aiperf
    python benchmarks/client_throughput.py --modes CR --baseline HEAD~1  # C now against C at HEAD~1

Targets (issues 7 and 14): C/A >= 0.85, C/B >= 5 and C/D >= 1 at both concurrencies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = "bench-model"
ROOT = Path(__file__).resolve().parent.parent
TOKEN_TEXTS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")

# ---------------------------------------------------------------------------------------------------
# The server: raw asyncio, one Protocol per connection, HTTP/1.1 keep-alive, chunked SSE like vLLM.
# ---------------------------------------------------------------------------------------------------


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk_obj(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    # the fields and their order as vLLM sends them
    return {"id": "chatcmpl-b3c9a0e1f2d44c6f8a1b2c3d4e5f6a7b", "object": "chat.completion.chunk",
            "created": 1767225600, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def _http_chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class _Payloads:
    """Every byte the server sends, built once: a block of `per_write` token events is one write."""

    def __init__(self, per_write: int) -> None:
        self.per_write = per_write
        self.events = [_sse(_chunk_obj({"content": t})) for t in TOKEN_TEXTS]
        self.head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                     b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        self.first = _http_chunk(_sse(_chunk_obj({"role": "assistant", "content": ""})))
        self.block = self._block(per_write)
        self._blocks: dict[int, bytes] = {}

    def _block(self, n: int) -> bytes:
        return _http_chunk(b"".join(self.events[i % len(self.events)] for i in range(n)))

    def tail_block(self, n: int) -> bytes:
        block = self._blocks.get(n)
        if block is None:
            block = self._blocks[n] = self._block(n)
        return block

    @staticmethod
    def end(tokens: int, prompt_tokens: int) -> bytes:
        finish = _sse(_chunk_obj({}, "length"))
        usage = _sse({"id": "chatcmpl-b3c9a0e1f2d44c6f8a1b2c3d4e5f6a7b", "object": "chat.completion.chunk",
                      "created": 1767225600, "model": MODEL, "choices": [],
                      "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + tokens,
                                "completion_tokens": tokens}})
        return _http_chunk(finish + usage + b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _plain(status: str, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: " + ctype + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


METRICS = (b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
           b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"bench-model\"} 0.0\n"
           b"# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
           b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"bench-model\"} 0.0\n")


class _Connection(asyncio.Protocol):
    """One client connection. Class attributes hold the server's settings and its counters."""

    payloads: _Payloads
    default_tokens = 1024
    rate = 0.0  # tokens/s of each stream; 0: as fast as the socket takes them
    stall_base_s = 0.0  # agents named stall-N stop sending (and keep the connection) after base + N x step s
    stall_step_s = 0.0
    first_at_once = False  # the first block goes out with the headers (a TTFT without the pacing's phase in it)
    sent = 0  # tokens written, all streams together
    streams = 0  # streams open now

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=256 << 10)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.writable.set()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        while self.transport is not None and not self.busy:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            length, agent = 0, ""
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "x-cerevisor-agent":
                    agent = value.strip()
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            method, path, _ = head.split("\r\n", 1)[0].split(" ", 2)
            if method == "POST" and path.endswith("/chat/completions"):
                try:
                    tokens = int(json.loads(body).get("max_tokens") or self.default_tokens)
                except (ValueError, AttributeError):
                    tokens = self.default_tokens
                self.busy = True
                asyncio.get_running_loop().create_task(self._stream(tokens, agent))
            elif path.endswith("/health"):
                self.transport.write(_plain("200 OK", b""))
            elif path.endswith("/metrics"):
                self.transport.write(_plain("200 OK", METRICS, b"text/plain; version=0.0.4"))
            elif path.endswith("/models"):
                self.transport.write(_plain("200 OK", json.dumps(
                    {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 32768}]}).encode()))
            elif path.endswith("/stats"):
                self.transport.write(_plain("200 OK", json.dumps(
                    {"tokens": _Connection.sent, "streams": _Connection.streams}).encode()))
            else:
                self.transport.write(_plain("404 Not Found", b'{"detail":"Not Found"}'))

    def _stall_block(self, agent: str) -> int:
        """The block after which this stream stops sending: -1 for all but the stall-N agents."""
        if not agent.startswith("stall-") or not self.rate:
            return -1
        after_s = self.stall_base_s + int(agent.rsplit("-", 1)[1]) * self.stall_step_s
        return int(after_s * self.rate / self.payloads.per_write)

    async def _stream(self, tokens: int, agent: str) -> None:
        p = self.payloads
        t = self.transport
        writable = self.writable
        per_write = p.per_write
        _Connection.streams += 1
        try:
            full, rest = divmod(tokens, per_write)
            block = p.block
            start = 0
            if self.first_at_once and full:
                t.write(p.head + p.first + block)
                _Connection.sent += per_write
                start = 1
            else:
                t.write(p.head + p.first)
            if self.rate:
                loop = asyncio.get_running_loop()
                interval = per_write / self.rate
                phase = random.random()
                next_at = loop.time() + (start + phase) * interval  # streams' writes spread over the interval
                stall_at = self._stall_block(agent)
                for i in range(start, full):
                    if i == stall_at:
                        await self.closed  # a wedged model: the connection stays open, nothing more comes
                        return
                    delay = next_at - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if not writable.is_set():
                        await writable.wait()
                    if self.transport is None:
                        return
                    t.write(block)
                    _Connection.sent += per_write
                    next_at += interval
                if start:  # the answer lasts tokens / rate, as at the pace, though its first block came at once
                    delay = next_at - phase * interval - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
            else:
                for i in range(start, full):
                    if not writable.is_set():
                        await writable.wait()
                    elif i % 64 == 63:
                        await asyncio.sleep(0)  # let other streams have the loop now and then
                    if self.transport is None:
                        return  # the client went away
                    t.write(block)
                    _Connection.sent += per_write
            if rest:
                t.write(p.tail_block(rest))
                _Connection.sent += rest
            t.write(p.end(tokens, 24))
        finally:
            self.busy = False
            _Connection.streams -= 1
        if self.transport is not None and self.buf:
            self._next()


async def _serve(port: int, per_write: int, default_tokens: int, rate: float = 0.0, stall_base_s: float = 0.0,
                 stall_step_s: float = 0.0, first_at_once: bool = False) -> None:
    _Connection.payloads = _Payloads(per_write)
    _Connection.default_tokens = default_tokens
    _Connection.first_at_once = first_at_once
    _Connection.rate, _Connection.stall_base_s, _Connection.stall_step_s = rate, stall_base_s, stall_step_s
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, "127.0.0.1", port, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def proc_cpu_s(pid: int | None) -> float:
    """A process's CPU time so far (user + system), from /proc; nan when it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, TypeError):
        return float("nan")


class FastServer:
    """The SSE server in a child process; `with FastServer() as srv:` gives `srv.base_url`.

    `rate`: tokens per second of each stream (0: as fast as it can); agents named `stall-N` then stop
    after `stall_base_s + N * stall_step_s` seconds and keep their connection open, as a wedged model does.
    `first_at_once`: the first block of tokens goes out with the response's headers, the pacing after it.
    """

    def __init__(self, per_write: int = 16, default_tokens: int = 1024, *, rate: float = 0.0,
                 stall_base_s: float = 0.0, stall_step_s: float = 0.0, first_at_once: bool = False) -> None:
        self.per_write = per_write
        self.default_tokens = default_tokens
        self.extra = ["--rate", str(rate), "--stall-base-s", str(stall_base_s), "--stall-step-s", str(stall_step_s),
                      *(["--first-at-once"] if first_at_once else [])]
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> FastServer:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", "--events-per-write", str(self.per_write),
             "--tokens", str(self.default_tokens), *self.extra], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        return self

    async def stats(self) -> dict[str, int]:
        """Tokens written so far and streams open, asked over HTTP."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(b"GET /stats HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        return json.loads(body)

    def cpu_s(self) -> float:
        """The server's CPU time so far (user + system), from /proc."""
        return proc_cpu_s(self.proc.pid if self.proc is not None else None)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(5)


# ---------------------------------------------------------------------------------------------------
# The clients, each run in a fresh process: `client_throughput.py client --mode A ...` prints one JSON line.
# ---------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Write a long story about a fox."}]


class Meter:
    """Counts streamed tokens and measures CPU and wall time between two fractions of the expected total.

    The window leaves out connecting and closing so that the figure is the cost of streaming itself: httpcore's
    pool does work in proportion to idle connections x all connections at every response close, which
    would land in the window of whichever client's streams happen to end inside it (A and C share that pool). When the window ends before the streams do, the process prints
    its result and exits at once: the rest of the run would measure nothing.
    """

    def __init__(self, total: int, window: tuple[float, float]) -> None:
        self.count = 0
        self.total = total
        self.whole = window == (0.0, 1.0)
        self.first = max(1, int(total * window[0]))
        self.last = max(self.first + 1, int(total * window[1]))
        self.t0: tuple[float, float] | None = None
        self.result: dict[str, Any] = {}

    def start(self) -> None:
        if self.whole:
            self.t0 = (time.process_time(), time.perf_counter())

    def tick(self) -> None:
        self.count += 1
        if self.count == self.first and self.t0 is None:
            self.t0 = (time.process_time(), time.perf_counter())
        elif self.count == self.last and not self.whole:
            self.stop()

    def tick_on_delta(self, event: Any) -> None:
        """An engine subscriber: counts the tokens of every TokenDelta (one event may carry several)."""
        if event.kind == "TokenDelta":
            self.count += event.tokens
            if self.t0 is None and self.count >= self.first:
                self.first = self.count  # the window starts at the first event past its mark
                self.t0 = (time.process_time(), time.perf_counter())
            elif self.t0 is not None and self.count >= self.last and not self.whole:
                self.stop()

    def stop(self) -> None:
        assert self.t0 is not None
        cpu, wall = time.process_time() - self.t0[0], time.perf_counter() - self.t0[1]
        tokens = self.count - (0 if self.whole else self.first)
        self.result = {"tokens": tokens, "counted": self.count, "cpu_s": cpu, "wall_s": wall,
                       "rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        if not self.whole:
            print(json.dumps(self.result), flush=True)
            os._exit(0)


async def _client_a(base_url: str, streams: int, tokens: int, meter: Meter) -> None:
    import httpx

    url = base_url + "/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": tokens,
            "stream_options": {"include_usage": True}}
    loads = json.loads
    tick = meter.tick

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    obj = loads(line[6:])
                    choices = obj["choices"]
                    if choices and choices[0]["delta"].get("content"):
                        tick()

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        meter.start()
        await asyncio.gather(*(one(client) for _ in range(streams)))


async def _client_b(base_url: str, streams: int, tokens: int, meter: Meter) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=None)
    create = client.chat.completions.create  # resolves the SDK's lazily imported resources before timing
    tick = meter.tick

    async def one() -> None:
        stream = await create(model=MODEL, messages=MESSAGES, stream=True, max_tokens=tokens,
                              stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                tick()

    async with client:
        meter.start()
        await asyncio.gather(*(one() for _ in range(streams)))


def _client_c(base_url: str, streams: int, tokens: int, meter: Meter, run_dir: str, client_py: str = "") -> None:
    """What `cerevisor-tui run` does: engine + journal (run directory) + report + printer, one agent per stream.

    `client_py`: another version of endpoints/client.py whose ChatStream reads the streams (client R).
    """
    import anyio

    from cerevisor_tui.config import validate
    from cerevisor_tui.engine.engine import Engine
    from cerevisor_tui.engine.sinks.journal import Journal
    from cerevisor_tui.engine.sinks.printer import Printer

    if client_py:
        _use_chat_stream_from(client_py)

    config = validate({
        "run": {"mode": "parallel", "max_concurrency": streams, "metrics_interval_s": 2.0},
        "endpoints": [{"name": "fast", "kind": "local", "base_url": base_url, "model": MODEL,
                       "max_concurrency": streams}],
        "agents": [{"name": f"agent-{i:04d}", "system": MESSAGES[0]["content"], "prompt": MESSAGES[1]["content"],
                    "max_tokens": tokens, "retries": 0} for i in range(streams)],
    })
    engine = Engine(config, run_dir=run_dir)
    journal = Journal(run_dir, engine.report)
    journal.open()
    engine.subscribe(journal)
    engine.subscribe(Printer(open(os.devnull, "w")))
    engine.subscribe(meter.tick_on_delta)
    meter.start()
    try:
        code = anyio.run(engine.run)
    finally:
        journal.write_report()
        journal.close()
    if code != 0:
        raise SystemExit(f"engine run failed (exit {code}): {engine.report.totals()}")


def _use_chat_stream_from(path: str) -> None:
    """Client R: the engine builds its streams from the ChatStream of the endpoints/client.py at `path`."""
    import importlib.util

    from cerevisor_tui.engine import connections

    spec = importlib.util.spec_from_file_location("cerevisor_bench_baseline_client", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # @dataclass looks its class's module up while it runs
    spec.loader.exec_module(module)
    connections.ChatStream = module.ChatStream  # type: ignore[attr-defined]  # what Connections.stream builds


def client_main(mode: str, base_url: str, streams: int, tokens: int, window: tuple[float, float],
                client_py: str = "") -> dict[str, Any]:
    import httpx  # noqa: F401  (imports are done before any timing)

    meter = Meter(streams * tokens, window)
    if mode in ("C", "R"):
        with tempfile.TemporaryDirectory(prefix="cerevisor-bench-") as tmp:
            _client_c(base_url, streams, tokens, meter, tmp, client_py if mode == "R" else "")
    else:
        if mode == "B":
            import openai  # noqa: F401
        fn = _client_a if mode == "A" else _client_b
        asyncio.run(fn(base_url, streams, tokens, meter))
    meter.stop()
    return meter.result


# ---------------------------------------------------------------------------------------------------
# Client D: aiperf, a process tree of its own, measured from outside.
# ---------------------------------------------------------------------------------------------------


class AiperfMissing(Exception):
    """aiperf cannot run here; the message says why, for the operator."""


def aiperf_version(aiperf: str | None) -> str:
    """aiperf's version line, or AiperfMissing with the reason it cannot be used."""
    if not aiperf:
        raise AiperfMissing("no `aiperf` on PATH and no --aiperf given (it pins textual~=5.3 and rich~=14.1, so "
                            "install it in a venv of its own: python -m venv ~/.venvs/aiperf && "
                            "~/.venvs/aiperf/bin/pip install aiperf==0.13.0, then --aiperf ~/.venvs/aiperf/bin/aiperf)")
    try:
        out = subprocess.run([aiperf, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AiperfMissing(f"{aiperf} --version: {exc}") from exc
    if out.returncode != 0:
        raise AiperfMissing(f"{aiperf} --version exited {out.returncode}: {(out.stderr or out.stdout).strip()[-500:]}")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"


def write_tokenizer(directory: Path) -> Path:
    """A word-level Hugging Face tokenizer of a dozen words: aiperf loads a tokenizer even when it counts the
    server's usage, and its built-in one downloads tiktoken's table from the network."""
    directory.mkdir(parents=True, exist_ok=True)
    words = ["[UNK]", *(t.strip() for t in TOKEN_TEXTS)]
    (directory / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": 0, "content": "[UNK]", "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}],
        "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
        "model": {"type": "WordLevel", "vocab": {w: i for i, w in enumerate(words)}, "unk_token": "[UNK]"}}))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "model_max_length": 1 << 20}))
    return directory


def _aiperf_once(aiperf: str, server: FastServer, streams: int, tokens: int, workdir: Path) -> tuple[float, float]:
    """One `aiperf profile` run, `streams` streaming chat requests at once of `tokens` each: the CPU time of
    its whole process tree (getrusage of the children it reaped, and they theirs) and its wall time."""
    art = workdir / f"artifacts-{streams}-{tokens}-{time.monotonic_ns()}"
    cmd = [aiperf, "profile", "--model", MODEL, "--url", server.base_url.removesuffix("/v1"),
           "--endpoint-type", "chat", "--streaming", "--concurrency", str(streams), "--request-count", str(streams),
           "--osl", str(tokens), "--use-legacy-max-tokens", "--isl", "32",
           "--tokenizer", str(write_tokenizer(workdir / "tokenizer")), "--use-server-token-count",
           "--ui-type", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(art)]
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    with open(workdir / "aiperf.log", "w") as log:
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, timeout=300).returncode
        except subprocess.TimeoutExpired:
            code = "killed after 300 s"
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        tail = (workdir / "aiperf.log").read_text(errors="replace")[-1500:]
        raise AiperfMissing(f"aiperf exited {code}:\n{tail}")
    completed = _aiperf_completed(art)
    if completed != streams:
        raise AiperfMissing(f"aiperf completed {completed} of {streams} requests without error (see {art})")
    shutil.rmtree(art, ignore_errors=True)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime), wall


AIPERF_BASE_TOKENS = 16


def run_aiperf(aiperf: str, server: FastServer, streams: int, tokens: int, workdir: Path) -> dict[str, Any]:
    """Client D: what aiperf's streaming costs it, by difference. aiperf runs twice, with the same requests of
    `tokens` and of 16 tokens; the second takes its start-up (about 6 CPU-seconds: imports, a dozen services)
    and per-request costs out of the first. A window like the other clients' would not do: aiperf keeps
    each response's raw SSE messages and parses them after the request ends, and the server's count of
    tokens sent runs megabytes of socket buffer ahead of what a client has read."""
    base_cpu, base_wall = _aiperf_once(aiperf, server, streams, AIPERF_BASE_TOKENS, workdir)
    cpu0 = server.cpu_s()
    full_cpu, full_wall = _aiperf_once(aiperf, server, streams, tokens, workdir)
    streamed = streams * (tokens - AIPERF_BASE_TOKENS)
    return {"tokens": streamed, "cpu_s": full_cpu - base_cpu, "wall_s": full_wall - base_wall,
            "server_cpu_s": server.cpu_s() - cpu0,
            "tok_per_cpu_s": streamed / (full_cpu - base_cpu), "tok_per_s": streamed / (full_wall - base_wall),
            "whole_tok_per_cpu_s": streams * tokens / full_cpu}


def _aiperf_completed(art: Path) -> int | None:
    """Requests aiperf completed without error, from its JSON export (None when it cannot be read)."""
    try:
        export = json.loads((art / "profile_export_aiperf.json").read_text())
        count = export["request_count"]["avg"]
        errors = (export.get("error_request_count") or {}).get("avg", 0) or 0
        return int(count) - int(errors)
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------------
# The driver: interleaved rounds, medians, ratios.
# ---------------------------------------------------------------------------------------------------

MODES = {"A": "bare httpx (aiter_lines + json.loads)", "B": "openai AsyncOpenAI stream",
         "C": "cerevisor-tui engine (watchdog+journal+report)", "D": "aiperf profile (streaming chat)",
         "R": "C with --baseline's endpoints/client.py"}


def run_client(mode: str, server: FastServer, streams: int, tokens: int, window: tuple[float, float],
               client_py: str = "") -> dict[str, Any]:
    cpu0 = server.cpu_s()
    out = subprocess.run([sys.executable, __file__, "client", "--mode", mode, "--base-url", server.base_url,
                          "--streams", str(streams), "--tokens", str(tokens), "--window", _window_arg(window),
                          *(["--client-py", client_py] if client_py else [])],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"client {mode} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["server_cpu_s"] = server.cpu_s() - cpu0
    if window == (0.0, 1.0) and result["tokens"] != streams * tokens:
        raise SystemExit(f"client {mode} counted {result['tokens']} tokens, expected {streams * tokens}")
    result["tok_per_cpu_s"] = result["tokens"] / result["cpu_s"]
    result["tok_per_s"] = result["tokens"] / result["wall_s"]
    return result


def _window_arg(window: tuple[float, float]) -> str:
    return f"{window[0]:g},{window[1]:g}"


def _parse_window(text: str) -> tuple[float, float]:
    lo, hi = (float(x) for x in text.split(","))
    if not 0 <= lo < hi <= 1:
        raise argparse.ArgumentTypeError("the window is two fractions, 0 <= start < end <= 1")
    return lo, hi


def _fmt(x: float) -> str:
    return f"{x:,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="(internal) run the SSE server; prints its port")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--events-per-write", type=int, default=16)
    serve.add_argument("--tokens", type=int, default=1024)
    serve.add_argument("--rate", type=float, default=0.0)
    serve.add_argument("--stall-base-s", type=float, default=0.0)
    serve.add_argument("--stall-step-s", type=float, default=0.0)
    serve.add_argument("--first-at-once", action="store_true")
    client = sub.add_parser("client", help="(internal) run one client; prints one JSON line")
    client.add_argument("--mode", choices=list(MODES), required=True)
    client.add_argument("--base-url", required=True)
    client.add_argument("--streams", type=int, required=True)
    client.add_argument("--tokens", type=int, required=True)
    client.add_argument("--window", type=_parse_window, default=(0.1, 0.45))
    client.add_argument("--client-py", default="", help="client R: the endpoints/client.py to read streams with")
    parser.add_argument("--concurrency", default="64,256", help="concurrent streams, comma-separated (default 64,256)")
    parser.add_argument("--total-tokens", type=int, default=262144,
                        help="completion tokens per run, split over its streams (default 262144: 4096 a stream "
                        "at 64, 1024 at 256)")
    parser.add_argument("--b-share", type=float, default=0.25,
                        help="B streams this share of the tokens: it is twenty times slower (default 0.25)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per concurrency (default 3)")
    parser.add_argument("--modes", default="ABCD", help="which clients to run (default ABCD; R with --baseline)")
    parser.add_argument("--aiperf", default=shutil.which("aiperf"),
                        help="client D's aiperf executable (default: aiperf on PATH)")
    parser.add_argument("--baseline", metavar="REF", default="",
                        help="add client R: C reading its streams with endpoints/client.py as of git REF")
    parser.add_argument("--b-window", type=_parse_window, default=(0.1, 0.2),
                        help="B's window (default 0.1,0.2: as long streams as the others, a shorter measurement)")
    parser.add_argument("--window", type=_parse_window, default=(0.1, 0.45),
                        help="measure between these fractions of all tokens (default 0.1,0.45: every stream has "
                        "started and none has ended; 0,1: the whole run, connecting and closing included)")
    parser.add_argument("--events-per-write", type=int, default=16,
                        help="SSE events the server puts in one write (default 16)")
    parser.add_argument("--json", action="store_true", help="also print every run as JSON")
    args = parser.parse_args(argv)

    if args.command == "serve":
        asyncio.run(_serve(args.port, args.events_per_write, args.tokens, args.rate, args.stall_base_s,
                           args.stall_step_s, args.first_at_once))
        return 0
    if args.command == "client":
        print(json.dumps(client_main(args.mode, args.base_url, args.streams, args.tokens, args.window,
                                     args.client_py)))
        return 0

    levels = [int(x) for x in args.concurrency.split(",")]
    modes = [m for m in args.modes.upper() if m in MODES]
    if args.baseline and "R" not in modes:
        modes.append("R")
    if "R" in modes and not args.baseline:
        raise SystemExit("client R needs --baseline REF")
    workdir = Path(tempfile.mkdtemp(prefix="cerevisor-bench-"))
    client_py = ""
    if args.baseline:
        shown = subprocess.run(["git", "show", f"{args.baseline}:cerevisor_tui/endpoints/client.py"], cwd=ROOT,
                               capture_output=True, text=True)
        if shown.returncode != 0:
            raise SystemExit(f"--baseline {args.baseline}: {shown.stderr.strip()}")
        client_py = str(workdir / "baseline_client.py")
        Path(client_py).write_text(shown.stdout)
    if "D" in modes:
        try:
            print(f"D: {aiperf_version(args.aiperf)} ({args.aiperf})")
        except AiperfMissing as exc:
            print(f"D left out: {exc}")
            modes.remove("D")
    print(f"client throughput: {args.total_tokens} tokens per run (B: {args.b_share:g} of that), "
          f"{args.events_per_write} events per server write, measured between {_window_arg(args.window)} of each "
          f"run's tokens, {args.repeats} interleaved rounds; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
          flush=True)
    results: dict[int, dict[str, list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    with FastServer(args.events_per_write) as server:
        run_client("A", server, 8, 64, (0.0, 1.0))  # warm the server and the page cache
        for streams in levels:
            results[streams] = {m: [] for m in modes}
            for r in range(args.repeats):
                for mode in (modes if r % 2 == 0 else modes[::-1]):
                    tokens = max(16, int(args.total_tokens * (args.b_share if mode == "B" else 1) // streams))
                    window = args.b_window if mode == "B" else args.window
                    if mode == "D":
                        try:
                            res = run_aiperf(args.aiperf, server, streams, tokens, workdir)
                        except AiperfMissing as exc:
                            print(f"D left out from here on: {exc}", flush=True)
                            modes.remove("D")
                            for by_mode in results.values():
                                by_mode.pop("D", None)
                            continue
                    else:
                        res = run_client(mode, server, streams, tokens, window, client_py)
                    results[streams][mode].append(res)
                    last = (f"whole run {_fmt(res['whole_tok_per_cpu_s'])} tok/CPU-s" if mode == "D"
                            else f"rss {res['rss_mib']:.0f} MiB")
                    print(f"  {streams:4d} streams  round {r + 1}  {mode}: {_fmt(res['tok_per_cpu_s']):>9} tok/CPU-s"
                          f"  {_fmt(res['tok_per_s']):>9} tok/s  ({res['tokens']} tokens, cpu {res['cpu_s']:.2f} s, "
                          f"wall {res['wall_s']:.2f} s, server cpu {res['server_cpu_s']:.2f} s, {last})", flush=True)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"\n{time.perf_counter() - started:.0f} s in all\n")
    print("| streams | client | tokens / client CPU-s | wall tokens / s |")
    print("|---:|---|---:|---:|")
    for streams, by_mode in results.items():
        for mode, runs in by_mode.items():
            print(f"| {streams} | {mode}: {MODES[mode]} | {_fmt(statistics.median(r['tok_per_cpu_s'] for r in runs))} "
                  f"| {_fmt(statistics.median(r['tok_per_s'] for r in runs))} |")
    if "D" in modes:
        print("\nD's whole run (its start-up included), tokens / client CPU-s: " + ", ".join(
            f"{streams} streams {_fmt(statistics.median(r['whole_tok_per_cpu_s'] for r in by_mode['D']))}"
            for streams, by_mode in results.items()))
    others = [m for m in "ABDR" if m in modes]
    if "C" in modes and others:
        targets = {"A": 0.85, "B": 5.0, "D": 1.0}
        print()
        print("| streams | " + " | ".join(f"C/{m} per CPU-s" for m in others) + " | "
              + " | ".join(f"C/{m} wall" for m in others) + " | targets (C/A >= 0.85, C/B >= 5, C/D >= 1) |")
        print("|---:|" + "---:|" * (2 * len(others)) + "---|")
        for streams, by_mode in results.items():
            def ratio(x: str, y: str, key: str, by_mode=by_mode) -> float:
                return statistics.median(c[key] / o[key] for c, o in zip(by_mode[x], by_mode[y], strict=True))
            cpu = {m: ratio("C", m, "tok_per_cpu_s") for m in others}
            missed = [m for m in others if m in targets and cpu[m] < targets[m]]
            print(f"| {streams} | " + " | ".join(f"{cpu[m]:.2f}" for m in others) + " | "
                  + " | ".join(f"{ratio('C', m, 'tok_per_s'):.2f}" for m in others) + " | "
                  + ("MISSED: " + ", ".join(f"C/{m}" for m in missed) if missed else "hold") + " |")
        print("\nRatios are medians of the per-round ratios. Tokens per client CPU-second is the fair figure: the"
              "\nserver runs on the same cores, so wall tokens/s also measures the server and whatever else the"
              "\nmachine is doing.")
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
