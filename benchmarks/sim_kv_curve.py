"""Throughput against concurrency on the simulator's KV model: the cliff, and a CPU tier that softens it.

Runs the simulator with `--profile qwen3.6-35b-a3b@2xh100` (in-process, a fresh one per point) and, at each
concurrency, that many multi-turn conversations at once: a 12K-token first prompt, then 8 follow-up
turns of 4K tokens each (the shape of vLLM's tiered-offloading write-up), every turn resending the
whole conversation as an agent does. It prints a markdown table of aggregate output tokens per
simulated second, without and with a CPU KV tier. Throughput is measured on the simulator's clock
(`cerevisor_sim:engine_time_seconds`), which stands still while the server is idle or the host is
busy: clients have no think time, and a slow machine slows the run, not the numbers.

    python benchmarks/sim_kv_curve.py                 # the full table (about 2 minutes on 2 cores)
    python benchmarks/sim_kv_curve.py --levels 16,64,128 --cpu-offload-gib 0,64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import sys
import time
from dataclasses import dataclass

import httpx

from cerevisor_tui.config.models import SimSettings
from cerevisor_tui.sim import SimServer

PROFILE = "qwen3.6-35b-a3b@2xh100"


@dataclass
class Point:
    concurrency: int
    cpu_offload_gib: float
    output_tokens: int
    sim_s: float
    wall_s: float
    hit_rate: float
    cpu_hit_rate: float
    preemptions: int
    max_waiting: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.sim_s if self.sim_s > 0 else 0.0


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(found[1]) if found else 0.0


def _filler(rng: random.Random, tokens: int) -> str:
    """Unique text the simulator counts as `tokens` tokens (4 characters each)."""
    return rng.randbytes(tokens * 2).hex()


async def _conversation(url: str, cid: int, args: argparse.Namespace) -> int:
    # A client per conversation: one shared pool of hundreds of connections costs httpcore O(n^2) work.
    # verify=False: plain http on loopback, and loading the CA bundle per client costs ~50 ms each.
    async with httpx.AsyncClient(timeout=None, verify=False) as client:
        return await _turns(client, url, cid, args)


async def _turns(client: httpx.AsyncClient, url: str, cid: int, args: argparse.Namespace) -> int:
    rng = random.Random(cid)
    messages = [{"role": "system", "content": _filler(rng, args.first_tokens)},
                {"role": "user", "content": f"conversation {cid}: begin"}]
    produced = 0
    for turn in range(1 + args.turns):
        if turn:
            messages.append({"role": "user", "content": _filler(rng, args.turn_tokens)})
        r = await client.post(url, json={"model": "sim-model", "messages": messages, "max_tokens": args.output_tokens})
        r.raise_for_status()
        body = r.json()
        produced += body["usage"]["completion_tokens"]
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return produced


async def _sample_waiting(client: httpx.AsyncClient, metrics_url: str, box: list[int]) -> None:
    while True:
        try:
            text = (await client.get(metrics_url)).text
            box[0] = max(box[0], int(_metric(text, "vllm:num_requests_waiting")))
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)


async def _point(concurrency: int, cpu_gib: float, args: argparse.Namespace) -> Point:
    settings = SimSettings(profile=args.profile, speed=args.speed, ttft_s=0.0, cpu_offload_gib=cpu_gib)
    async with SimServer(settings) as srv, httpx.AsyncClient(timeout=None) as client:
        eng, kv = srv.state.engine, srv.state.kv
        waiting = [0]
        sampler = asyncio.create_task(_sample_waiting(client, srv.root_url + "/metrics", waiting))
        started, sim_started = time.monotonic(), eng.now
        url = srv.base_url + "/chat/completions"
        produced = await asyncio.gather(*(_conversation(url, c, args) for c in range(concurrency)))
        sampler.cancel()
        return Point(
            concurrency=concurrency, cpu_offload_gib=cpu_gib, output_tokens=sum(produced),
            sim_s=eng.now - sim_started, wall_s=time.monotonic() - started,
            hit_rate=kv.hits_tokens / kv.queries_tokens if kv.queries_tokens else 0.0,
            cpu_hit_rate=kv.cpu_hits_tokens / kv.cpu_queries_tokens if kv.cpu_queries_tokens else 0.0,
            preemptions=eng.preemptions_total, max_waiting=waiting[0],
        )


def _table(points: list[Point], levels: list[int], tiers: list[float]) -> str:
    by = {(p.concurrency, p.cpu_offload_gib): p for p in points}
    head = ["concurrency"]
    for gib in tiers:
        name = "no CPU tier" if gib == 0 else f"CPU tier {gib:g} GiB"
        head += [f"{name}: output tok/s", "prefix hits", "preemptions", "max waiting"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in levels:
        cells = [str(n)]
        for gib in tiers:
            p = by[(n, gib)]
            hits = f"{p.hit_rate:.0%}" + (f" + {p.cpu_hit_rate:.0%} CPU" if gib else "")
            cells += [f"{p.tokens_per_s:,.0f}", hits, str(p.preemptions), str(p.max_waiting)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


async def main_async(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.levels.split(",")]
    tiers = [float(x) for x in args.cpu_offload_gib.split(",")]
    points = []
    started = time.monotonic()
    for gib in tiers:
        for n in levels:
            p = await _point(n, gib, args)
            points.append(p)
            print(f"  concurrency {n:>4}, CPU tier {gib:>4g} GiB: {p.tokens_per_s:8,.0f} output tok/s "
                  f"(simulated {p.sim_s:6.1f} s in {p.wall_s:5.1f} s wall; prefix hits {p.hit_rate:.0%}, "
                  f"preemptions {p.preemptions})", file=sys.stderr, flush=True)
    print(f"\nProfile {args.profile}; conversations of {args.first_tokens} + {args.turns}x{args.turns_label} "
          f"tokens, {args.output_tokens} output tokens per turn; simulated clock. "
          f"Took {time.monotonic() - started:.0f} s.\n")
    print(_table(points, levels, tiers))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default=PROFILE, help=f"simulator profile (default {PROFILE})")
    parser.add_argument("--levels", default="16,32,64,96,128,192", help="concurrency levels (comma separated)")
    parser.add_argument("--cpu-offload-gib", default="0,64", help="CPU tier sizes to compare, GiB (0: none)")
    parser.add_argument("--first-tokens", type=int, default=12288, help="first prompt of a conversation")
    parser.add_argument("--turn-tokens", type=int, default=4096, help="each follow-up user message")
    parser.add_argument("--turns", type=int, default=8, help="follow-up turns")
    parser.add_argument("--output-tokens", type=int, default=256, help="answer length per turn")
    parser.add_argument("--speed", type=float, default=100.0, help="simulator time scale")
    args = parser.parse_args(argv)
    args.turns_label = args.turn_tokens
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
