"""Whether the simulator keeps up with agent traffic at its real size: 560 KB prompts (a 140K-token turn 43) from
256 sessions at once, on this machine, at a sped-up clock.

1. What one request costs the simulator as its prompt grows: parsing the JSON body (the HTTP edge, in C) and
   hashing the prompt into its KV blocks once (`sim/text.block_hashes`) are the only work that grows with it;
   the token count is a length, the output seed a CRC in C. Printed per size and per KB.
2. 256 sessions of 2 turns each with 140K-token prompts (the second extends the first by 2K), closed loop
   through the replay client against `--sim agentx-12xgb300` in this process: wall time, the simulator's pace
   (engine seconds per wall second; the asked speed when the host keeps up), requests per second, the
   process's peak RSS and what the simulator's request log still holds.

    python benchmarks/sim_big_prompts.py            # both (about a minute on 2 shared cores)
    python benchmarks/sim_big_prompts.py --sessions 64
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import time
import tracemalloc

from cerevisor_tui.config import SimSettings
from cerevisor_tui.replay.run import ReplaySettings, prompt_text, replay
from cerevisor_tui.replay.trace import BLOCK_TOKENS, TraceTurn
from cerevisor_tui.sim import SimServer
from cerevisor_tui.sim import text as simtext

BIG_TOKENS = 140_000  # 560 KB of prompt text at 4 characters a token


def per_request_cost() -> None:
    print("| prompt | JSON body parse | render | block hashes (once) | output seed | total | per KB |")
    print("|---|---|---|---|---|---|---|")
    for tokens in (2_500, 25_000, BIG_TOKENS):
        text = prompt_text(list(range(tokens // BLOCK_TOKENS + 1)), tokens, "s")
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], "stream": True}).encode()
        rounds = 30
        messages = [{"role": "user", "content": text}]
        steps = ((json.loads, body), (simtext.render_prompt, messages), (simtext.block_hashes, text, 64),
                 (simtext.text_seed, 0, text))
        timings = []
        for step, *step_args in steps:
            start = time.perf_counter()
            for _ in range(rounds):
                step(*step_args)
            timings.append((time.perf_counter() - start) / rounds * 1e3)
        kb = len(body) / 1024
        total = sum(timings)
        print(f"| {kb:,.0f} KB | {timings[0]:.2f} ms | {timings[1]:.2f} ms | {timings[2]:.2f} ms | "
              f"{timings[3]:.2f} ms | {total:.2f} ms | {total / kb * 1000:.1f} µs |")


def big_trace(sessions: int) -> list[TraceTurn]:
    blocks = BIG_TOKENS // BLOCK_TOKENS + 1
    turns = []
    for s in range(sessions):
        own = list(range(s * 1000, s * 1000 + blocks + 5))
        turns.append(TraceTurn(f"s{s}", 1, BIG_TOKENS, 50, own[:blocks]))
        turns.append(TraceTurn(f"s{s}", 2, 2000, 50, own[:blocks + 4], delay_ms=2000))
    return turns


async def keep_up(sessions: int, speed: float) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tracemalloc.start()  # what Python still holds after the run: RSS does not shrink when memory is freed
    async with SimServer(SimSettings(profile="agentx-12xgb300", speed=speed)) as srv:
        engine = srv.state.engine
        start_sim, start_wall = engine.now, time.monotonic()
        report = await replay(big_trace(sessions), srv.base_url,
                              ReplaySettings(concurrency=sessions, speed=speed, clock=engine.clock_s))
        wall_s, sim_s = time.monotonic() - start_wall, engine.now - start_sim
        log = srv.state.requests
        held = sum(entry["body_bytes"] for entry in log if entry["messages"] is not None)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gc.collect()
    held_now, held_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\n{sessions} sessions x 2 turns of {BIG_TOKENS:,}-token prompts at speed {speed:g}: "
          f"{report.turns_completed}/{report.turns} turns in {wall_s:.1f} s wall "
          f"({report.turns_completed / wall_s:.1f} requests/s), pace {sim_s / wall_s:.1f} engine s per wall s, "
          f"prefix hit rate {report.prefix_hit_rate:.2f}")
    print(f"peak RSS {rss_before:.0f} MiB before, {rss_after:.0f} MiB during (client and simulator in one process, "
          f"every session's prompt in flight at once); Python memory allocated during the run: {held_peak / 2**20:.0f} MiB "
          f"at its peak, {held_now / 2**20:.0f} MiB still held after it; request log: {len(log)} entries, "
          f"bodies of {held / 2**20:.1f} MiB kept")



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--speed", type=float, default=20.0)
    args = parser.parse_args()
    per_request_cost()
    asyncio.run(keep_up(args.sessions, args.speed))


if __name__ == "__main__":
    main()
