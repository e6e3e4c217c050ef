"""What scrubbing API keys costs the engine's hot path, side by side: client C of client_throughput.py (the
engine with its watchdog, journal, report and printer) with no key configured, and with one.

With a key, every token delta goes through a StreamScrubber per field (config/secrets.py): the text is
searched for the key and a tail that could begin it is held back until the next delta. Without one, the
engine keeps no scrubber and the per-delta cost is one test. The same fast SSE server (client_throughput's,
in a process of its own) serves both; rounds interleave (no key, key, then key, no key, ...).

    python benchmarks/scrub_cost.py                         # 64 and 256 streams, 3 rounds
    python benchmarks/scrub_cost.py --concurrency 256 --repeats 5

Measured on the 2-core dev box (2026-11, shared with other work): with a key / without, per client
CPU-second, medians of 5 rounds: 0.93-0.95 at 64 and 256 streams; but an A/A run (no key both times) on the
same box spread 0.93-1.47, so that is within its noise. cProfile of one keyed run puts the scrubber
(`_held_back` and the StreamScrubbers under it) at 0.09 s of 4.0 s, about 2% of the client's CPU, for 17,000
deltas of 15 tokens (~80 characters) each: ~0.5 us per delta, against ~30 us of the engine's own work per
delta. Without a key the engine keeps no scrubber and the cost is one `is not None` test per delta.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import client_throughput as ct  # noqa: E402

KEY_ENV = "CEREVISOR_BENCH_KEY"
KEY = "sk-bench-" + "5f0c" * 10  # starts with "s": " jumps" ends in one, so tails are held and released


def client(with_key: bool, base_url: str, streams: int, tokens: int) -> dict:
    if with_key:
        import cerevisor_tui.config as config

        os.environ[KEY_ENV] = KEY
        validate = config.validate

        def with_api_key(data, **kwargs):
            for ep in data.get("endpoints", []):
                ep["api_key_env"] = KEY_ENV
            return validate(data, **kwargs)

        config.validate = with_api_key  # client C imports validate from here when it runs
    return ct.client_main("C", base_url, streams, tokens, (0.1, 0.45))


def run(with_key: bool, server: ct.FastServer, streams: int, tokens: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "client", "--key", str(int(with_key)), "--base-url",
                          server.base_url, "--streams", str(streams), "--tokens", str(tokens)],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"client failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["tok_per_cpu_s"] = result["tokens"] / result["cpu_s"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("client")
    c.add_argument("--key", type=int, required=True)
    c.add_argument("--base-url", required=True)
    c.add_argument("--streams", type=int, required=True)
    c.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--total-tokens", type=int, default=262144)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.command == "client":
        print(json.dumps(client(bool(args.key), args.base_url, args.streams, args.tokens)))
        return 0
    print(f"scrub cost: client C without and with an API key configured, {args.total_tokens} tokens per run, "
          f"{args.repeats} interleaved rounds; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    with ct.FastServer() as server:
        ct.run_client("A", server, 8, 64, (0.0, 1.0))  # warm the server
        for streams in (int(x) for x in args.concurrency.split(",")):
            tokens = args.total_tokens // streams
            ratios, plain, keyed = [], [], []
            for r in range(args.repeats):
                order = (False, True) if r % 2 == 0 else (True, False)
                got = {k: run(k, server, streams, tokens) for k in order}
                plain.append(got[False]["tok_per_cpu_s"])
                keyed.append(got[True]["tok_per_cpu_s"])
                ratios.append(keyed[-1] / plain[-1])
                print(f"  {streams:4d} streams round {r + 1}: no key {plain[-1]:>9,.0f} tok/CPU-s, "
                      f"key {keyed[-1]:>9,.0f} tok/CPU-s, ratio {ratios[-1]:.3f}", flush=True)
            print(f"| {streams} streams | no key {statistics.median(plain):,.0f} | key {statistics.median(keyed):,.0f} "
                  f"| key / no key {statistics.median(ratios):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
