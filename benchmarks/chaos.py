"""A chaos soak: random faults against live runs for N minutes, then the checks a user cares about.

    python benchmarks/chaos.py                       # 10 minutes on the simulator
    python benchmarks/chaos.py --minutes 2 --seed 7  # what .ci/run runs
    python benchmarks/chaos.py --against vllm        # real vLLM (needs PEERS_DIR's set-up; see .ci/integration.sh)
    python benchmarks/chaos.py --minutes 60          # an hour of it

Rounds follow one another until the time is up. Each round is one headless `cerevisor-tui run` of a workflow
(agents in waves, several turns, some calling an MCP tool) that also serves a gateway, against a server behind
a loopback TCP proxy of this script's. Every few seconds one fault, picked at random:

- server:   the server SIGKILLed and started again on its port;
- run:      the run SIGKILLed, then `run --resume` of its directory;
- cut:      every connection through the proxy cut mid-stream;
- disk:     the run directory's filesystem (a small tmpfs, when this user may mount one) filled, then emptied;
- console:  `attach --jsonl` started, read until its first event, then killed;
- mcp:      the MCP server of a tool call in progress SIGKILLed;
- gateway:  a gateway client that disconnects mid-stream, then one that must be served in full;
- wedge:    the server wedged (the proxy takes connections and never answers) while the run starts again
            (SIGKILL, `run --resume`): its warm-up meets the wedge; the wedge lifts after a few seconds;
- metrics:  the server's /metrics lies for a while (1e308 requests running, NaN waiting, KV use -4, +Inf
            preemptions): the run must stay up and keep its agents going;
- halfopen: 200 connections to the gateway that send half a request line and stop, held open: a client must
            still be served, and the gateway must close them at its header deadline;
- flood:    a flood of distinct gateway sessions, far past the per-key cap: each answered (served or 429,
            never a 5xx of the gateway's own), and a client served after it.

At the end of each round (every agent has an outcome, then `stop`), it checks:
- every agent has exactly one outcome: one report row, in a final status, the journal's last word on it;
- no completed turn was sent twice: the proxy records each request's X-Request-Id as it reaches the server,
  and no request for an (agent, turn) arrives after the journal recorded that turn's final answer;
- no journal is unreadable: every line decodes, but the one line a SIGKILL may cut per kill;
- no secret: the canary API key (the endpoint's api_key_env) is in no file of the round;
- no process is left: nothing started by the round (run, consoles, MCP servers) outlives it.

It prints a table of the faults injected and their outcomes, and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import tomli_w

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cerevisor_tui.contract.events import EventError, decode_event  # noqa: E402
from tests.integration import servers  # noqa: E402

MCP_FAKE = ROOT / "tests" / "fixtures" / "mcp_fake.py"
KEY_ENV = "CHAOS_CANARY_KEY"
FINAL = {"completed", "failed", "killed", "skipped", "cancelled"}
FAULTS = ("server", "run", "cut", "disk", "console", "mcp", "gateway", "wedge", "metrics", "halfopen", "flood")
LYING_METRICS = (b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1e308\n"
                 b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting NaN\n"
                 b"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc -4\n"
                 b"# TYPE vllm:num_preemptions_total counter\nvllm:num_preemptions_total +Inf\n")
HEADER_TIMEOUT_S = 3.0  # the gateway's [gateway] header_timeout_s in each round
FORGET_AFTER_S = 5.0  # and its forget_after_s: a flood's sessions are let go of within the round
MAX_SESSIONS = 64  # and its max_sessions_per_key (no keys: all its clients together)
HALF_OPEN = 200
FLOOD = 150
REQUEST_ID = re.compile(rb"\r\nx-request-id:[ \t]*([^\r\n]+)\r\n", re.I)
TURN_OF = re.compile(r"\.(c\d+)\.t(\d+)\.")  # an agent's request id: <run>.<agent>.t<turn>.a<attempt>


# ----------------------------------------------------------------------------------------------------------
# the proxy: every request's id and arrival time, and a cut of every connection on demand


@dataclass
class Proxy:
    upstream_port: int
    port: int = 0
    seen: list[tuple[str, float]] = field(default_factory=list)  # (X-Request-Id, monotonic time)
    wedged: asyncio.Event | None = None  # set: the server is wedged (connections taken, never answered) until cleared
    lying: bool = False  # /metrics answered with LYING_METRICS
    _open: set[asyncio.StreamWriter] = field(default_factory=set)
    _server: asyncio.Server | None = None

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.wedged is not None:  # a wedged server: the request is taken and nothing ever comes back
            self._open.add(writer)
            lifted = self.wedged
            with contextlib.suppress(OSError):
                await lifted.wait()
            self._open.discard(writer)
            writer.transport.abort()
            return
        first = b""
        if self.lying:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                first = await reader.readuntil(b"\r\n")
            if first.startswith(b"GET /metrics"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n"
                             + f"content-length: {len(LYING_METRICS)}\r\n\r\n".encode() + LYING_METRICS)
                with contextlib.suppress(OSError):
                    await writer.drain()
                writer.transport.abort()
                return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._open.update((writer, up_writer))
        if first:
            up_writer.write(first)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool, tail: bytes = b"") -> None:
            try:
                while chunk := await src.read(65536):
                    if record:
                        data = tail + chunk
                        for m in REQUEST_ID.finditer(data):
                            if m.end() > len(tail):
                                self.seen.append((m.group(1).decode("latin-1").strip(), time.monotonic()))
                        tail = data[-512:]
                    dst.write(chunk)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer, True, first), pipe(up_reader, writer, False))
        finally:
            self._open.discard(writer)
            self._open.discard(up_writer)

    async def pause(self) -> None:
        """Stop listening, as a dead server's port does: a client is refused, not accepted and dropped."""
        if self._server is not None:
            self._server.close()
            self._server = None

    async def resume(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    def cut(self) -> int:
        """Abort every open connection, both sides; how many client connections were open."""
        opened = list(self._open)
        for w in opened:
            w.transport.abort()
        return len(opened) // 2

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)


# ----------------------------------------------------------------------------------------------------------
# the server under test


def server_process(against: str, port: int, log_dir: Path) -> servers.ServerProcess:
    if against == "sim":
        argv = [sys.executable, "-m", "cerevisor_tui", "sim", "--port", str(port), "--seed", "5",
                "--tokens-per-s", "60", "--ttft-s", "0.2", "--max-num-seqs", "8",
                "--tool-steps", "1", "--tool-args", "{ hang = { seconds = 1.5 } }"]
        return servers.ServerProcess("sim", argv, dict(os.environ), port, log_dir, model="sim-model")
    if against == "vllm":
        return servers.vllm(port, log_dir)
    if against == "llama":
        return servers.llama_server(port, log_dir)
    raise SystemExit(f"chaos: --against {against!r}: sim, vllm or llama")


def ready_timeout_s(against: str) -> float:
    return 30.0 if against == "sim" else 300.0


# ----------------------------------------------------------------------------------------------------------
# a round: one run of a workflow, its faults and its checks


def workflow(url: str, model: str, run_dir: Path, gateway_port: int, agents: int, tools: bool,
             first_byte_s: float) -> dict[str, Any]:
    config: dict[str, Any] = {
        "run": {"mode": "parallel", "max_concurrency": 4},
        # a first-byte window that outlasts the server's restart: its agents wait for its port, as for a cold start
        "stall": {"first_byte_timeout_s": first_byte_s, "idle_timeout_s": 10},
        "endpoints": [{"name": "box", "base_url": url, "model": model, "api_key_env": KEY_ENV}],
        "gateway": {"listen": f"127.0.0.1:{gateway_port}", "upstream": "box", "release_after_s": 0,
                    "header_timeout_s": HEADER_TIMEOUT_S, "forget_after_s": FORGET_AFTER_S,
                    "max_sessions_per_key": MAX_SESSIONS},
        "agents": [],
    }
    if tools:
        config["mcp_servers"] = [{"name": "fake", "command": sys.executable, "args": [str(MCP_FAKE)],
                                  "allow": ["*"]}]
    for i in range(agents):
        agent: dict[str, Any] = {"name": f"c{i}", "prompt": f"chaos task {i}", "turns": [f"go on {i}", "finish"],
                                 "max_tokens": 48, "retries": 3}
        if i >= agents // 2:  # a second wave, so a resume has both finished and waiting agents
            agent["depends_on"] = [f"c{i - agents // 2}"]
        if tools and i % 4 == 1:
            agent["tools"] = ["fake"]
        config["agents"].append(agent)
    return config


@dataclass
class Round:
    number: int
    dir: Path
    run_dir: Path
    config_path: Path
    agents: list[str]
    gateway_port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    kills: int = 0
    disk_stops: int = 0  # runs stopped by a full disk (and resumed)
    segments: int = 0
    mounted: bool = False
    pids: set[int] = field(default_factory=set)  # every process this round started

    def start(self, resume: bool) -> None:
        args = [sys.executable, "-m", "cerevisor_tui", "run", str(self.config_path), "--approve-all"]
        args += ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir)]
        out = (self.dir / f"run-{self.segments}.out").open("wb")
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=self.env, start_new_session=True)
        out.close()
        self.pids.add(self.proc.pid)
        self.segments += 1

    def journal_lines(self) -> list[bytes]:
        try:
            return (self.run_dir / "events.jsonl").read_bytes().splitlines()
        except OSError:
            return []

    def outcomes(self) -> tuple[dict[str, str], Counter[str]]:
        """Each agent's last outcome in the journal, and how many times each was recorded completed."""
        last: dict[str, str] = {}
        completed: Counter[str] = Counter()
        for raw in self.journal_lines():
            if b'"AgentFinished"' not in raw:
                continue
            with contextlib.suppress(ValueError):
                data = json.loads(raw)
                if data.get("event") == "AgentFinished" and data.get("agent") in self.agents:
                    last[data["agent"]] = data["status"]
                    completed[data["agent"]] += data["status"] == "completed"
        return last, completed

    def all_finished(self) -> bool:
        """Every agent has its outcome; `cancelled` is not one here (only a stop cancels, and a stopped run is
        resumed)."""
        last, _ = self.outcomes()
        return all(last.get(a) in FINAL - {"cancelled"} for a in self.agents)


async def wait_for(predicate, timeout_s: float, step_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step_s)
    return predicate()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.out = Path(args.out or tempfile.mkdtemp(prefix="cerevisor-chaos-"))
        self.out.mkdir(parents=True, exist_ok=True)
        self.canary = f"sk-chaos-{secrets.token_hex(16)}"
        self.faults: Counter[tuple[str, str]] = Counter()  # (fault, outcome)
        self.failures: list[str] = []
        self.server_port = servers.free_port()
        self.server: servers.ServerProcess | None = None
        self.proxy: Proxy | None = None
        self.round: Round | None = None
        self.tools = args.against == "sim"  # the simulator calls tools; a random-weight model does not
        self.can_mount = os.geteuid() == 0 and shutil.which("mount") is not None
        self.checked_rounds = 0

    # -- the server -------------------------------------------------------------------------------------
    def start_server(self) -> None:
        self.server = server_process(self.args.against, self.server_port, self.out / "servers")
        self.server.start()
        self.server.wait_ready(ready_timeout_s(self.args.against))

    def model(self) -> str:
        assert self.server is not None
        return self.server.model

    # -- a round --------------------------------------------------------------------------------------
    def new_round(self, number: int) -> Round:
        rdir = self.out / f"round-{number}"
        rdir.mkdir()
        fs = rdir / "fs"
        fs.mkdir()
        mounted = False
        if self.can_mount and "disk" in self.args.faults:
            mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(fs)],
                                     capture_output=True).returncode == 0
        assert self.proxy is not None
        gateway_port = servers.free_port()
        config = workflow(f"http://127.0.0.1:{self.proxy.port}/v1", self.model(), fs / "run", gateway_port,
                          self.args.agents, self.tools, 2 * ready_timeout_s(self.args.against))
        path = rdir / "chaos.toml"
        path.write_text(tomli_w.dumps(config))
        env = {**os.environ, KEY_ENV: self.canary}
        return Round(number, rdir, fs / "run", path, [a["name"] for a in config["agents"]], gateway_port, env,
                     mounted=mounted)

    async def play_round(self, rnd: Round, deadline: float) -> None:
        rnd.start(resume=False)
        round_limit = time.monotonic() + max(120.0, self.args.round_limit_s)
        while time.monotonic() < round_limit:
            pause = self.rng.uniform(0.5, 1.5) * self.args.fault_every_s
            end = time.monotonic() + pause
            restarted = False
            while time.monotonic() < end and not restarted:
                await asyncio.sleep(0.2)
                if rnd.all_finished():
                    break
                if rnd.proc is not None and rnd.proc.poll() is not None:
                    if not self.stopped_by_a_full_disk(rnd):
                        self.note_failure(rnd, f"the run exited with {rnd.proc.returncode} before its agents "
                                               f"finished (see {rnd.dir}/run-{rnd.segments - 1}.out)")
                        return
                    restarted = True  # a pause of its own before the next fault
            if rnd.all_finished():
                break
            if not restarted and time.monotonic() < deadline:  # after the soak's time, no new faults: the round finishes
                await self.inject(rnd, self.rng.choice(self.args.faults))
        else:
            self.note_failure(rnd, f"its agents had not all finished after {self.args.round_limit_s:.0f} s")
        await self.end_round(rnd)

    def stopped_by_a_full_disk(self, rnd: Round) -> bool:
        """The run stopped because its journal could not be written (as designed: what was written is kept):
        resume it, as its operator would once the disk has room. False for any other exit."""
        out = (rnd.dir / f"run-{rnd.segments - 1}.out").read_text(errors="replace")
        if "No space left on device" not in out:  # the run stopped, or a resume refused the full disk
            return False
        self.log(rnd, f"the run stopped on a full disk (free {shutil.disk_usage(rnd.run_dir).free} B); resuming")
        rnd.disk_stops += 1
        self.faults[("disk", "run stopped, resumed")] += 1
        deadline = time.monotonic() + 30
        while shutil.disk_usage(rnd.run_dir).free < (4 << 20) and time.monotonic() < deadline:
            time.sleep(0.2)
        rnd.start(resume=(rnd.run_dir / "events.jsonl").exists())  # refused at its start: started again
        return True

    async def end_round(self, rnd: Round) -> None:
        if rnd.proc is not None and rnd.proc.poll() is not None and self.stopped_by_a_full_disk(rnd):
            pass  # it ended as the disk filled (its last report not written): resumed, it writes it, then stops
        if rnd.proc is not None and rnd.proc.poll() is None:
            for _ in range(60):  # a run just resumed opens its control socket first
                stop = subprocess.run([sys.executable, "-m", "cerevisor_tui", "stop", str(rnd.run_dir)],
                                      capture_output=True, text=True, env=rnd.env, timeout=120)
                if stop.returncode == 0 or rnd.proc.poll() is not None:
                    break
                await asyncio.sleep(0.5)
            if stop.returncode != 0 and rnd.proc.poll() is None:
                self.note_failure(rnd, f"`stop` exited {stop.returncode}: {stop.stderr.strip()[-300:]}")
            try:
                rnd.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.note_failure(rnd, "the run did not end within 60 s of `stop`")
                os.killpg(rnd.proc.pid, signal.SIGKILL)
                rnd.proc.wait()

    # -- faults ---------------------------------------------------------------------------------------
    def log(self, rnd: Round, line: str) -> None:
        with (rnd.dir / "faults.log").open("a") as fh:
            fh.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    async def inject(self, rnd: Round, fault: str) -> None:
        self.log(rnd, f"{fault}: injecting")
        outcome = await getattr(self, f"fault_{fault}")(rnd)
        self.log(rnd, f"{fault}: {outcome}")
        self.faults[(fault, outcome)] += 1
        if outcome.startswith("FAILED"):
            self.note_failure(rnd, f"{fault}: {outcome}")

    async def fault_server(self, rnd: Round) -> str:
        assert self.server is not None and self.proxy is not None
        await self.proxy.pause()  # its port refuses while it is down, as the server's own would
        self.proxy.cut()
        self.server.kill()
        with contextlib.suppress(Exception):
            self.server.proc.wait(10)  # type: ignore[union-attr]
        await asyncio.sleep(self.rng.uniform(0.2, 2.0))
        try:
            await asyncio.to_thread(self.start_server)
        except RuntimeError as exc:
            return f"FAILED: did not start again: {str(exc)[:200]}"
        finally:
            await self.proxy.resume()
        return "killed, restarted"

    async def fault_run(self, rnd: Round) -> str:
        assert rnd.proc is not None
        os.killpg(rnd.proc.pid, signal.SIGKILL)  # the run and what it started (MCP servers)
        rnd.proc.wait()
        rnd.kills += 1
        rnd.start(resume=True)
        return "SIGKILL, resumed"

    async def fault_cut(self, rnd: Round) -> str:
        assert self.proxy is not None
        n = self.proxy.cut()
        return "cut mid-stream" if n else "nothing open"

    async def fault_disk(self, rnd: Round) -> str:
        if not rnd.mounted:
            return "n/a (no tmpfs: not root, or mount refused)"
        filler = rnd.run_dir.parent / "filler"
        try:
            with filler.open("wb") as fh:
                with contextlib.suppress(OSError):
                    while True:
                        fh.write(b"\0" * (1 << 20))
                        fh.flush()
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
        finally:
            filler.unlink(missing_ok=True)
        return "filled, emptied"

    async def fault_console(self, rnd: Round) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "cerevisor_tui", "attach", str(rnd.run_dir), "--jsonl",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=rnd.env)
        rnd.pids.add(proc.pid)
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 20)
            outcome = "attached, detached" if line else "run not live"
            with contextlib.suppress(EventError, ValueError):
                if line:
                    decode_event(line)
        except TimeoutError:
            outcome = "FAILED: no event within 20 s"
        finally:
            # a hang-up is one way a console ends, unless this soak runs under nohup: its consoles inherit the
            # ignored SIGHUP, and one sent would wait for ever on a console that, blocked on a full pipe, lives on
            ends = [signal.SIGKILL, signal.SIGTERM]
            if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
                ends.append(signal.SIGHUP)
            sent = self.rng.choice(ends)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sent)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                outcome = f"FAILED: still running 20 s after {sent.name}"
        return outcome

    async def fault_mcp(self, rnd: Round) -> str:
        if not self.tools:
            return "n/a (no tool calls on this server)"
        for pid in processes_with(str(MCP_FAKE)):
            if rnd.proc is not None and parent_of(pid) == rnd.proc.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                return "killed mid-call"
        return "none running"

    async def fault_gateway(self, rnd: Round) -> str:
        url = f"http://127.0.0.1:{rnd.gateway_port}/v1/chat/completions"
        body = {"model": self.model(), "messages": [{"role": "user", "content": "chaos gateway"}],
                "max_tokens": 24, "stream": True}
        sid = f"chaos-gw-{rnd.number}-{self.rng.randrange(1 << 30)}"
        try:
            async with httpx.AsyncClient(timeout=30) as client:
                async with client.stream("POST", url, json=body, headers={"X-Session-ID": sid}) as response:
                    async for _ in response.aiter_bytes():
                        break  # the client goes away after its first bytes
                served = await client.post(url, json={**body, "stream": False},
                                           headers={"X-Session-ID": sid + "-next"})
        except httpx.HTTPError as exc:
            return f"gateway unreachable ({type(exc).__name__})"
        if served.status_code == 200:
            return "disconnected; next served"
        return f"disconnected; next got {served.status_code}"

    async def fault_wedge(self, rnd: Round) -> str:
        assert self.proxy is not None and rnd.proc is not None
        self.proxy.wedged = asyncio.Event()
        self.proxy.cut()
        os.killpg(rnd.proc.pid, signal.SIGKILL)  # started again on the wedged server: its warm-up meets the wedge
        rnd.proc.wait()
        rnd.kills += 1
        rnd.start(resume=True)
        await asyncio.sleep(self.rng.uniform(3.0, 6.0))
        self.proxy.wedged.set()
        self.proxy.wedged = None
        await asyncio.sleep(0.5)
        if rnd.proc.poll() is not None and not self.stopped_by_a_full_disk(rnd):
            return f"FAILED: the run exited with {rnd.proc.returncode} on a wedged server"
        return "wedged at warm-up, lifted"

    async def fault_metrics(self, rnd: Round) -> str:
        assert self.proxy is not None and rnd.proc is not None
        self.proxy.lying = True
        self.proxy.cut()  # the monitor's next look opens a new connection, which is lied to
        try:
            await asyncio.sleep(self.rng.uniform(3.0, 6.0))  # more than one look at [run] metrics_interval_s
        finally:
            self.proxy.lying = False
        if rnd.proc.poll() is not None and not self.stopped_by_a_full_disk(rnd):
            return f"FAILED: the run exited with {rnd.proc.returncode} on lying metrics"
        return "lied, run up"

    async def fault_halfopen(self, rnd: Round) -> str:
        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        try:
            for _ in range(HALF_OPEN):
                reader, writer = await asyncio.open_connection("127.0.0.1", rnd.gateway_port)
                writer.write(b"POST /v1/chat/compl")
                held.append((reader, writer))
        except OSError as exc:
            if not held:
                return f"gateway unreachable ({type(exc).__name__})"
        served = await self.served_by_gateway(rnd, "halfopen")
        if not served.startswith("served"):
            return f"FAILED: with {len(held)} half-open connections held, a client was {served}"

        async def closed(reader: asyncio.StreamReader) -> bool:
            with contextlib.suppress(OSError):
                while await reader.read(4096):
                    pass
            return True

        try:  # every one closed by the gateway, at its header deadline (or to make room for a newer one)
            await asyncio.wait_for(asyncio.gather(*(closed(r) for r, _ in held)), HEADER_TIMEOUT_S + 10)
        except TimeoutError:
            return f"FAILED: half-open connections still open {HEADER_TIMEOUT_S + 10:g} s on"
        finally:
            for _, writer in held:
                writer.transport.abort()
        return "held, client served, all closed"

    async def fault_flood(self, rnd: Round) -> str:
        url = f"http://127.0.0.1:{rnd.gateway_port}/v1/chat/completions"
        body = {"model": self.model(), "messages": [{"role": "user", "content": "flood"}], "max_tokens": 1,
                "stream": False}
        statuses: Counter[str] = Counter()
        limit = asyncio.Semaphore(16)
        tag = self.rng.randrange(1 << 30)

        async def one(client: httpx.AsyncClient, i: int) -> None:
            async with limit:
                try:
                    r = await client.post(url, json=body, headers={"X-Session-ID": f"flood-{tag}-{i}"})
                    statuses[str(r.status_code)] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1

        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(FLOOD)))
        if statuses["500"] or statuses["ConnectError"] == FLOOD:
            return f"FAILED: {dict(statuses)}"
        await asyncio.sleep(FORGET_AFTER_S * 1.5)  # the flood's sessions forgotten: room for a client again
        served = await self.served_by_gateway(rnd, "flood")
        if not served.startswith("served"):
            return f"FAILED: after a flood ({dict(statuses)}), a client was {served}"
        return "flooded (200 and 429 only), client served" if set(statuses) <= {"200", "429"} else \
            "flooded (some cut by the faults), client served"

    async def served_by_gateway(self, rnd: Round, what: str) -> str:
        """One whole request of a new session through the round's gateway: "served", or what came instead."""
        url = f"http://127.0.0.1:{rnd.gateway_port}/v1/chat/completions"
        body = {"model": self.model(), "messages": [{"role": "user", "content": f"chaos {what}"}],
                "max_tokens": 4, "stream": False}
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(url, json=body, headers={"X-Session-ID": f"chaos-{what}-{rnd.number}-"
                                                                               f"{self.rng.randrange(1 << 30)}"})
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__})"
        return "served" if r.status_code == 200 else f"answered {r.status_code}"

    # -- checks ---------------------------------------------------------------------------------------
    def note_failure(self, rnd: Round, what: str) -> None:
        self.failures.append(f"round {rnd.number}: {what}")

    def check_round(self, rnd: Round) -> None:
        self.checked_rounds += 1
        lines = rnd.journal_lines()
        # the journal: every line decodes, but one a SIGKILL may have cut per kill
        events, unreadable = [], 0
        for raw in lines:
            if not raw.strip():
                continue
            try:
                events.append(decode_event(raw))
            except (EventError, ValueError):
                unreadable += 1
        if unreadable > rnd.kills:  # a SIGKILL may cut the line being written; nothing else may
            self.note_failure(rnd, f"{unreadable} journal lines do not decode ({rnd.kills} SIGKILLs)")
        # exactly one outcome per agent
        last, _ = rnd.outcomes()  # a resumed run says again that what it reuses completed: the last word counts
        for agent in rnd.agents:
            if last.get(agent) not in FINAL:
                self.note_failure(rnd, f"agent {agent} has no outcome in the journal")
        try:
            report = json.loads((rnd.run_dir / "report.json").read_text())
        except (OSError, ValueError) as exc:
            self.note_failure(rnd, f"report.json unreadable: {exc}")
            report = {"agents": []}
        rows = Counter(a.get("name") for a in report.get("agents", []))
        for agent in rnd.agents:
            if rows[agent] != 1:
                self.note_failure(rnd, f"agent {agent} has {rows[agent]} rows in report.json")
        for row in report.get("agents", []):
            name = row.get("name")
            if name in last and row.get("status") != last[name]:
                self.note_failure(rnd, f"agent {name}: report says {row.get('status')}, journal {last[name]}")
        # no completed turn sent again: a request for (agent, turn) after the journal had its final answer
        answered: dict[tuple[str, int], float] = {}
        for e in events:
            if (type(e).__name__ == "MessageRecorded" and e.role == "assistant" and not e.tool_calls and not e.partial
                    and e.agent in rnd.agents):
                answered.setdefault((e.agent, e.turn), e.t)
        assert self.proxy is not None
        doubled = []
        for rid, at in self.proxy.seen:
            m = TURN_OF.search(rid)
            if m and (m.group(1), int(m.group(2))) in answered and at > answered[(m.group(1), int(m.group(2)))]:
                doubled.append(rid)
        if doubled:
            self.note_failure(rnd, f"{len(doubled)} requests for turns already answered: {doubled[:3]}")
        # the canary key is in no file
        for path in rnd.dir.rglob("*"):
            with contextlib.suppress(OSError):
                if path.is_file() and self.canary.encode() in path.read_bytes():
                    self.note_failure(rnd, f"the canary key is in {path}")
        # nothing left running
        time_left = time.monotonic() + 15
        while time.monotonic() < time_left and (left := [p for p in rnd.pids if alive(p)]):
            time.sleep(0.2)
        left = [p for p in rnd.pids if alive(p)] + [p for p in processes_with(str(rnd.dir))]
        if left:
            self.note_failure(rnd, f"processes left: {sorted(set(left))}")
            for p in set(left):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
        self.unmount(rnd)
        self.proxy.seen.clear()

    def unmount(self, rnd: Round) -> None:
        """The round's tmpfs unmounted, its run directory first copied beside it (kept for a post-mortem)."""
        if rnd.mounted:
            with contextlib.suppress(OSError):
                shutil.copytree(rnd.run_dir, rnd.dir / "run", ignore=shutil.ignore_patterns("*.sock", "lock"))
            subprocess.run(["umount", "-l", str(rnd.run_dir.parent)], capture_output=True)
            rnd.mounted = False

    # -- the soak -------------------------------------------------------------------------------------
    async def main(self) -> int:
        started = time.monotonic()
        deadline = started + self.args.minutes * 60
        print(f"chaos: {self.args.minutes:g} min against {self.args.against}, seed {self.args.seed}, "
              f"faults every ~{self.args.fault_every_s:g} s: {', '.join(self.args.faults)}; files in {self.out}")
        await asyncio.to_thread(self.start_server)
        self.proxy = await Proxy(self.server_port).start()
        number = 0
        try:
            while time.monotonic() < deadline:
                number += 1
                rnd = self.round = self.new_round(number)
                await self.play_round(rnd, deadline)
                tally = Counter(rnd.outcomes()[0].values())
                self.check_round(rnd)
                print(f"  round {number}: {rnd.segments} segment(s), {rnd.kills} SIGKILL(s), "
                      + ", ".join(f"{n} {s}" for s, n in sorted(tally.items())), flush=True)
        finally:
            if self.round is not None and self.round.proc is not None and self.round.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.round.proc.pid, signal.SIGKILL)
            if self.round is not None:
                self.unmount(self.round)
            await self.proxy.close()
            if self.server is not None:
                self.server.stop()
        self.report(time.monotonic() - started)
        return 1 if self.failures else 0

    def report(self, elapsed_s: float) -> None:
        print(f"\n{'fault':<10} {'outcome':<44} {'count':>5}")
        for (fault, outcome), n in sorted(self.faults.items()):
            print(f"{fault:<10} {outcome:<44} {n:>5}")
        total = sum(self.faults.values())
        print(f"\n{total} faults in {elapsed_s / 60:.1f} min over {self.checked_rounds} rounds")
        checks = ("one outcome per agent", "no completed turn sent twice", "every journal readable",
                  "no secret in any file", "no process left")
        if self.failures:
            print(f"FAILED: {len(self.failures)} problem(s):")
            for line in self.failures:
                print(f"  - {line}")
        else:
            print("passed: " + "; ".join(checks))


def processes_with(text: str) -> list[int]:
    """Processes whose command line holds `text` (this script's own excepted)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(entry.name))
    return found


def parent_of(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    return -1


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie has ended; its parent has not reaped it yet
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
    parser.add_argument("--against", default="sim", choices=("sim", "vllm", "llama"),
                        help="the server: the simulator, or real vLLM / llama-server from PEERS_DIR")
    parser.add_argument("--seed", type=int, default=1, help="the faults' random seed (default 1)")
    parser.add_argument("--fault-every-s", type=float, default=4.0, help="mean seconds between faults (4)")
    parser.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS),
                        help=f"which faults, comma-separated (default all: {','.join(FAULTS)})")
    parser.add_argument("--agents", type=int, default=16, help="agents in each round's workflow (default 16)")
    parser.add_argument("--round-limit-s", type=float, default=600.0,
                        help="a round whose agents have not all finished by then fails (default 600)")
    parser.add_argument("--out", help="where rounds are kept (default: a new temporary directory)")
    args = parser.parse_args()
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(sorted(unknown))}; known: {', '.join(FAULTS)}")
    if args.against != "sim":
        try:
            (servers.check_vllm_setup if args.against == "vllm" else servers.check_llama_setup)()
        except servers.SetupMissing as exc:
            parser.error(str(exc))
    return asyncio.run(Soak(args).main())


if __name__ == "__main__":
    sys.exit(main())
