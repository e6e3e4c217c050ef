"""`cerevisor-tui replay`: write a file of agentic sessions, generated from a preset or imported from a
published trace, and say what it holds in the studies' own figures."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from cerevisor_tui.replay.trace import TraceError, TraceTurn, write_trace

PROG = "cerevisor-tui replay"


def main(args: argparse.Namespace) -> int:
    from cerevisor_tui.replay.stats import trace_stats

    try:
        turns = _turns(args)
        write_trace(turns, args.output)
    except (TraceError, ValueError) as exc:
        print(f"{PROG} {args.replay_command}: error: {exc}", file=sys.stderr)
        return 2
    stats = trace_stats(turns)
    if args.json:
        json.dump({"file": args.output, **stats.to_dict()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        _print_stats(stats, args.output, sys.stdout)
    return 0


def _turns(args: argparse.Namespace) -> list[TraceTurn]:
    if args.replay_command == "generate":
        from cerevisor_tui.replay.generate import generate

        return generate(args.preset, args.sessions, args.seed)
    from cerevisor_tui.replay.importers import import_trace

    return import_trace(args.file, args.format)


def _print_stats(stats, path: str, out: TextIO) -> None:
    subagents = f", {stats.subagent_sessions:,} subagent sessions" if stats.subagent_sessions else ""
    out.write(f"wrote {stats.turns:,} turns of {stats.sessions:,} sessions{subagents} to {path}\n")
    out.write(f"{'':22}{'median':>10}{'mean':>10}\n")
    rows = (
        ("turns a session", stats.turns_per_session, lambda v: f"{v:.1f}".removesuffix(".0")),
        ("first context", stats.first_context_tokens, _tokens),
        ("new tokens a turn", stats.new_tokens, _tokens),
        ("output a turn", stats.output_tokens, _tokens),
        ("gap before a turn", stats.gap_s, lambda v: f"{v:.1f} s"),
        ("prompt a turn", stats.prompt_tokens, _tokens),
    )
    for label, spread, shown in rows:
        out.write(f"{label:22}{shown(spread.median):>10}{shown(spread.mean):>10}\n")
    out.write(f"prefix share {stats.prefix_share:.1%} (mean over turns after the first); "
              f"{stats.subagent_spawn_share:.0%} of sessions spawn subagents\n")


def _tokens(value: float) -> str:
    return f"{value / 1000:.1f}K" if value >= 10_000 else f"{value:,.0f}"
