"""CPU per event of the run's event channel: the in-process subscriber against the control socket.

The same events (a synthetic run's, mostly TokenDelta) go
- (a) in-process: to a RunMirror called directly, as the in-process console's engine calls it;
- (b) over the socket: ControlServer (its subscriber call: the event's JSON line, msgspec straight from the
  Struct) -> its writes to a Unix socket -> ControlClient (readline, the line decoded into its typed message) ->
  RunMirror, the server and the client each in a process of its own, as `run --detach` and `attach` are.
Each side's CPU is its own process's `time.process_time()` over the events, so the figures are per
CPU-second and move little with the machine's load; wall time moves with it. The cases run in fresh
processes, interleaved over --rounds, and the script prints medians and ratios.

    python benchmarks/event_channel.py                    # 60,000 events, 5 rounds (about 1 minute)
    python benchmarks/event_channel.py --events 20000 --rounds 3 --codec shipped,dict

The server emits the events `--batch` at a time, one batch per loop iteration (the engine emits what one
network read of each stream carried, and the server writes what a loop iteration emitted as one write).
`--codec` compares ways to write and read the event lines: `shipped` (contract/wire.py: msgspec encodes
each event Struct and decodes each line into its typed message, fields checked) and `dict` (the same lines
through to_dict, json.dumps, json.loads and `events.event_of`, the typed check kept). Both write the same
JSON lines.

Measured (2 cores, 60,000 events, 5 rounds, medians): before the contract package, when events were
dataclasses and only TokenDelta lines took msgspec, the socket cost 14.5 us of CPU an event (server and
client together). The figures of the contract package are in docs/performance.md's benchmark table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULT = "RESULT "
WORDS = "the quick brown fox jumps over the lazy dog while a model writes at length about it".split()


def make_events(n: int, agents: int, tokens_per_delta: int = 8, deltas_per_turn: int = 48) -> tuple[Any, list[Any]]:
    """RunStarted, then `n` events of a run of `agents` streaming at once: each turn is AgentStarted, the
    user's message recorded, FirstToken, `deltas_per_turn` TokenDeltas of `tokens_per_delta` tokens each,
    TurnFinished and the assistant's message recorded (the whole answer), the agents interleaved a step at
    a time; every 2,048 events a ServerSample and a LoadChanged of the endpoint."""
    from cerevisor_tui.contract import events as ev

    names = [f"agent-{i:03d}" for i in range(agents)]
    stall = ev.StallPolicy(60.0, 30.0, (0.5, 0.8), "tokens", 300.0, 3, True)
    started = ev.RunStarted(0.0, "run-bench", "parallel", agents, [names],
                            [ev.EndpointSummary("box", "local", "http://127.0.0.1:8000/v1", "bench-model", agents,
                                                stall=stall)],
                            agents={name: ev.AgentPlan("box", 0, 1000) for name in names}, effective_cap=agents)

    def script(k: int, name: str) -> Any:
        turn = 0
        while True:
            turn += 1
            n = turn  # bound now: each lambda is called before the next turn, but say so
            yield lambda t, n=n: ev.AgentStarted(t, name, n, n, 1000, "box", 60.0, 30.0)
            yield lambda t, n=n: ev.MessageRecorded(t, name, n, n, "user", f"{name}: turn {n}, write at length.")
            yield lambda t, n=n: ev.FirstToken(t, name, n, n, 0.05)
            answer: list[str] = []
            for d in range(deltas_per_turn):
                text = "".join(" " + WORDS[(k + d + j) % len(WORDS)] for j in range(tokens_per_delta))
                answer.append(text)
                yield lambda t, n=n, text=text: ev.TokenDelta(t, name, n, text, "", "", tokens_per_delta)
            whole = "".join(answer)
            yield lambda t, n=n: ev.TurnFinished(t, name, n, n, 1000, 40, deltas_per_turn * tokens_per_delta,
                                                 "length", 0.05, 4.0)
            yield lambda t, n=n, whole=whole: ev.MessageRecorded(t, name, n, n, "assistant", whole)

    scripts = [script(k, name) for k, name in enumerate(names)]
    out: list[Any] = []
    t = 100.0
    while len(out) < n:
        for s in scripts:
            t += 0.00005
            out.append(next(s)(t))
            if len(out) % 2048 == 0:
                out.append(ev.ServerSample(t, "box", True, "vllm", running=float(agents), waiting=0.0,
                                           kv_cache_usage=0.61, prefix_hit_rate=0.2, preemptions=0.0))
                out.append(ev.LoadChanged(t, "box", agents, agents, "fits",
                                          ev.LoadEstimate(400, 1_000_000, 2500, source="server")))
            if len(out) >= n:
                break
    return started, out[:n]


def use_codec(codec: str) -> None:
    """Put the codec's event line writer and reader in the server's and the client's modules (what they call)."""
    import msgspec

    from cerevisor_tui.contract import events as ev
    from cerevisor_tui.contract import wire
    from cerevisor_tui.supervisor import client, server

    if codec == "shipped":
        return

    def event_line(event: Any) -> bytes:  # dict: every event through to_dict and json.dumps
        return json.dumps({"type": "event", "event": event.to_dict()}, separators=(",", ":")).encode() + b"\n"

    def read_server(line: bytes) -> Any:  # and back through json.loads and event_of
        data = json.loads(line)
        if data.get("type") == "event":
            return wire.EventMessage(ev.event_of(data["event"]))
        return msgspec.convert(data, wire.ServerMessage)

    server.event_line, client.read_server = event_line, read_server  # type: ignore[attr-defined]


# ---- the three processes ------------------------------------------------------------------------------

def run_inprocess(args: argparse.Namespace) -> dict[str, Any]:
    """(a): a RunMirror called directly with each event."""
    from cerevisor_tui.ui.mirror import RunMirror

    started, events = make_events(args.events, args.agents)
    mirror = RunMirror()
    mirror(started)
    cpu0 = time.process_time()
    for event in events:
        mirror(event)
    cpu = time.process_time() - cpu0
    assert mirror.tokens_total > 0
    return {"cpu_s": cpu}


async def run_server(args: argparse.Namespace) -> dict[str, Any]:
    """(b), the run's side: a ControlServer that the events are emitted to, `--batch` per loop iteration."""
    from cerevisor_tui.supervisor.server import ControlServer

    use_codec(args.codec)
    started, events = make_events(args.events, args.agents)
    got_done = asyncio.Event()

    def dispatch(command: Any) -> Any:
        if command.name == "pause":  # the client has taken in every event
            got_done.set()
        return None

    run_dir = Path(args.dir)
    (run_dir / "events.jsonl").touch()
    server = ControlServer(run_dir, "run-bench", dispatch)
    await server.start()
    print("listening", flush=True)
    while server.clients == 0:
        await asyncio.sleep(0.01)
    server(started)
    await asyncio.sleep(0.2)
    written0 = os.times()
    cpu0 = time.process_time()
    wall0 = time.perf_counter()
    batch = args.batch
    for i in range(0, len(events), batch):
        for event in events[i:i + batch]:
            server(event)
        await asyncio.sleep(0)
    emitted_cpu = time.process_time() - cpu0
    await got_done.wait()
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    times = os.times()
    await server.close("benchmark over")
    return {"cpu_s": cpu, "emit_cpu_s": emitted_cpu, "wall_s": wall,
            "sys_s": times.system - written0.system}


async def run_client(args: argparse.Namespace) -> dict[str, Any]:
    """(b), the console's side: a ControlClient feeding a RunMirror, until every event has come."""
    from cerevisor_tui.contract.commands import Pause
    from cerevisor_tui.supervisor.client import ControlClient
    from cerevisor_tui.ui.mirror import RunMirror

    use_codec(args.codec)
    mirror = RunMirror()
    client = await ControlClient.connect(Path(args.dir), replay=False)
    want = args.events
    seen = [0]
    marks: dict[str, float] = {}

    def on_event(event: Any) -> None:
        if event.kind == "RunStarted":
            mirror(event)
            marks["cpu0"], marks["sys0"] = time.process_time(), os.times().system
            return
        mirror(event)
        seen[0] += 1
        if seen[0] == want:
            marks["cpu"] = time.process_time() - marks["cpu0"]
            marks["sys"] = os.times().system - marks["sys0"]
            client.send(Pause())

    await client.run(on_event)
    if seen[0] != want:
        raise SystemExit(f"the client got {seen[0]} of {want} events ({client.bye or 'connection lost'})")
    return {"cpu_s": marks["cpu"], "sys_s": marks["sys"], "tokens": mirror.tokens_total}


def child(args: argparse.Namespace) -> int:
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
    if args.role == "inprocess":
        result = run_inprocess(args)
    elif args.role == "server":
        result = asyncio.run(run_server(args))
    else:
        result = asyncio.run(run_client(args))
    if profile is not None:
        profile.disable()
        profile.dump_stats(Path(args.profile) / f"{args.role}-{args.codec}.prof")
    print(RESULT + json.dumps(result), flush=True)
    return 0


# ---- the parent -----------------------------------------------------------------------------------------

def spawn(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, *argv], stdout=subprocess.PIPE, text=True)


def result_of(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=600)
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise SystemExit(f"{what} ended without figures (exit code {proc.returncode})")


def one_round(args: argparse.Namespace, codec: str) -> dict[str, dict[str, Any]]:
    common = ["--events", str(args.events), "--agents", str(args.agents), "--batch", str(args.batch),
              "--codec", codec, *(["--profile", args.profile] if args.profile else [])]
    with tempfile.TemporaryDirectory(prefix="cerevisor-event-channel-") as tmp:
        server = spawn(["--role", "server", "--dir", tmp, *common])
        assert server.stdout is not None
        if server.stdout.readline().strip() != "listening":
            raise SystemExit("the server did not start")
        client = spawn(["--role", "client", "--dir", tmp, *common])
        c = result_of(client, "the client")
        s = result_of(server, "the server")
    return {"server": s, "client": c}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=60_000, help="events driven through each side (default 60,000)")
    parser.add_argument("--agents", type=int, default=256, help="agents whose events interleave (default 256)")
    parser.add_argument("--batch", type=int, default=16, help="events the server is given per loop iteration")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each case in fresh processes (default 5)")
    parser.add_argument("--codec", default="shipped,dict",
                        help="the ways to write and read event lines compared, comma-separated: shipped, dict "
                        "(default shipped,dict)")
    parser.add_argument("--events-per-s", type=float, default=2560,
                        help="the event rate the summary prices the channel at (default 2,560: what console_load.py "
                        "measured over the socket at 256 agents and 21,500 tokens/s)")
    parser.add_argument("--profile", metavar="DIR",
                        help="run each process under cProfile, its stats in DIR/ROLE-CODEC.prof (the CPU figures "
                        "then include the profiler's own)")
    parser.add_argument("--role", choices=("inprocess", "server", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        args.codec = args.codec.split(",")[0]
        return child(args)

    codecs = [c.strip() for c in args.codec.split(",") if c.strip()]
    if not codecs or any(c not in ("shipped", "dict") for c in codecs):
        parser.error("--codec: shipped or dict, comma-separated")
    _, sample = make_events(min(args.events, 20_000), args.agents)
    deltas = sum(1 for e in sample if e.kind == "TokenDelta")
    from cerevisor_tui.contract.wire import event_line

    line_bytes = statistics.fmean(len(event_line(e)) for e in sample)
    print(f"event channel: {args.events:,} events of {args.agents} agents ({deltas / len(sample):.0%} TokenDelta, "
          f"{line_bytes:.0f} bytes a line on average), {args.batch} a loop iteration; {args.rounds} rounds; "
          f"codecs {', '.join(codecs)}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    started = time.perf_counter()
    inproc: list[float] = []
    socket: dict[str, dict[str, list[float]]] = {c: {"server": [], "client": [], "wall": []} for c in codecs}
    n = args.events
    for r in range(args.rounds):
        a = result_of(spawn(["--role", "inprocess", "--events", str(n), "--agents", str(args.agents),
                             *(["--profile", args.profile] if args.profile else [])]), "(a)")
        inproc.append(a["cpu_s"] / n * 1e6)
        line = f"  round {r + 1}: in-process {inproc[-1]:.2f} us"
        for codec in codecs:
            b = one_round(args, codec)
            socket[codec]["server"].append(b["server"]["cpu_s"] / n * 1e6)
            socket[codec]["client"].append(b["client"]["cpu_s"] / n * 1e6)
            socket[codec]["wall"].append(b["server"]["wall_s"])
            line += (f"; {codec}: server {socket[codec]['server'][-1]:.2f} us, "
                     f"client {socket[codec]['client'][-1]:.2f} us")
        print(line, flush=True)
    load_end = os.getloadavg()[0]

    def spread(values: list[float]) -> str:
        v = sorted(values)
        return f"{statistics.median(v):.2f} ({v[0]:.2f}-{v[-1]:.2f})" if len(v) > 1 else f"{v[0]:.2f}"

    a_med = statistics.median(inproc)
    print(f"\nCPU microseconds per event, medians of {args.rounds} rounds (range):\n")
    print("| path | run side (server) | console side (client) | both | both / in-process |")
    print("|---|---:|---:|---:|---:|")
    print(f"| (a) in-process: RunMirror called directly | - | {spread(inproc)} | {a_med:.2f} | 1.00 |")
    for codec in codecs:
        s, c = socket[codec]["server"], socket[codec]["client"]
        both = [x + y for x, y in zip(s, c, strict=True)]
        print(f"| (b) socket, {codec} codec | {spread(s)} | {spread(c)} | {statistics.median(both):.2f} | "
              f"{statistics.median(both) / a_med:.2f} |")
    for codec in codecs:
        c = statistics.median(socket[codec]["client"])
        print(f"\n{codec}: the client's share that is the channel (its CPU less the mirror's): {c - a_med:.2f} us "
              f"an event; at {args.events_per_s:,.0f} events/s the channel costs "
              f"{(statistics.median(socket[codec]['server']) + c - a_med) * args.events_per_s / 1e4:.1f}% of a "
              f"core, both sides; wall for the events {statistics.median(socket[codec]['wall']):.2f} s")
    print(f"\nload {load_end:.1f} at the end; {time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
