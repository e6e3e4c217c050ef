"""Command line: argument parsing and dispatch, nothing else.

Each subcommand's work lives in `cerevisor_tui.commands.<name>`, imported only when that subcommand runs,
so `--help` and the headless path stay fast (the headless path never imports Textual).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cerevisor_tui import __version__
from cerevisor_tui.kinds import MODES

REPLAY_PRESETS = ("agentx", "aiperf-inference-day", "tiered-offload")  # replay/generate.py PRESETS (a test checks)
REPLAY_FORMATS = ("mooncake", "weka", "tracelab")  # replay/importers.py FORMATS

EPILOG = """\
examples:
  cerevisor-tui                               console on the built-in simulator (demo workflow)
  cerevisor-tui --config team.toml            console on your endpoints and agents
  cerevisor-tui run workflow.toml --report out.json
  cerevisor-tui run workflow.toml --detach     a run that outlives the terminal; then: attach, ls, stop
  cerevisor-tui gateway --upstream http://127.0.0.1:8000/v1 --model sim-model
                                              govern Claude Code, Codex, aider, ... pointed at :8100
  cerevisor-tui sim --port 8000               a simulated vLLM-like server on loopback
  cerevisor-tui probe http://127.0.0.1:8000/v1
  cerevisor-tui estimate --model llama-3.1-8b --gpu h100 --context 32768
  cerevisor-tui replay generate --preset agentx -o agentx.jsonl   agentic sessions as the studies describe them

exit codes: 0 success; 1 the run ended with failed or killed agents (probe: endpoint unusable);
2 usage or config error; 141 the output was closed before it was all written (ls | head).
Config lookup: --config, $CEREVISOR_TUI_CONFIG, ./cerevisor.toml, then the user config dir.
See config.example.toml for every key."""


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line and a pointer to --help, not a usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=36)


def build_parser(*, sim_options: bool = True) -> argparse.ArgumentParser:
    """The whole command line; `sim_options=False` leaves out the simulator's flags, which need pydantic."""
    parser = _Parser(
        prog="cerevisor-tui",
        description="Operator console for many AI agents on OpenAI-compatible model servers.",
        epilog=EPILOG,
        formatter_class=_formatter,
    )
    parser.add_argument("--version", action="version", version=f"cerevisor-tui {__version__}")
    parser.add_argument("--config", metavar="FILE", help="config file (TOML); default: see lookup below")
    parser.add_argument("--theme", metavar="NAME", help="colour theme (cerevisor-dark, cerevisor-light, cerevisor-contrast, ...)")
    parser.add_argument("--in-process", action="store_true",
                        help="console: run the workflow inside the console's own process (it ends with the console) "
                             "instead of in a run process the console attaches to (which outlives the terminal)")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", parser_class=_Parser)

    run = sub.add_parser(
        "run",
        help="run a workflow headless (scripts, CI)",
        description="Run a workflow headless: a line per event, a run directory and a JSON report.",
        epilog="examples:\n  cerevisor-tui run config.example.toml --mode parallel --concurrency 8 --report out.json\n"
        "  cerevisor-tui run team.toml --mode auto   # each endpoint's cap found live; every change printed with its reason",
        formatter_class=_formatter,
    )
    run.add_argument("file", metavar="FILE", help="workflow config (TOML)")
    run.add_argument("--mode", choices=MODES,
                     help="override [run].mode: sequential (one agent at a time), parallel (up to --concurrency), "
                     "auto (each endpoint's cap follows what its server sustains: KV fit, queue, preemptions, throughput)")
    run.add_argument("--concurrency", type=int, metavar="N",
                     help="override [run].max_concurrency (with --mode auto: the ceiling, [run.auto].max_cap)")
    run.add_argument("--endpoint", metavar="URL", help="send every agent to this base URL (…/v1) instead")
    run.add_argument("--model", metavar="ID", help="model id to request (with --endpoint, or for every endpoint)")
    run.add_argument("--report", metavar="PATH", help="also write the JSON report here")
    run.add_argument("--jsonl", action="store_true", help="print each event as one JSON object per line")
    run.add_argument("--run-dir", metavar="DIR", help="directory for events.jsonl, transcripts/ and report.json")
    run.add_argument("--resume", metavar="RUN", help="rerun only what did not complete in RUN (run id or directory)")
    run.add_argument("--detach", action="store_true",
                     help="run in a process of its own that outlives this terminal (SSH loss included); prints the "
                     "run id and returns at once: then `attach`, `ls`, `stop`")
    run.add_argument("--approve-all", action="store_true",
                     help="approve every MCP tool call its server's rules `ask` about (without it, a run in the "
                     "foreground denies them and tells the model; a --detach run waits for a console to answer)")
    run.add_argument("--detached", action="store_true", help=argparse.SUPPRESS)  # the process --detach starts
    run.add_argument("--run-id", help=argparse.SUPPRESS)  # the id --detach printed
    run.add_argument("--lock-fd", type=int, help=argparse.SUPPRESS)  # the run directory's lock, --detach's

    gateway = sub.add_parser(
        "gateway",
        help="govern the harnesses you did not write (Claude Code, Codex CLI, aider, ...): each session a row",
        description="Serve an OpenAI- and Anthropic-compatible front door (POST /v1/chat/completions, /v1/responses, "
        "/v1/messages; GET /v1/models) in front of your model server. Every session of a harness pointed at it is "
        "an agent of the run: a row in the console with its live stream, admitted by the mode, the cap and Auto, "
        "each request under the two-deadline stall watchdog, transcripts and a report as for any run. Requests are "
        "passed through, never translated between APIs, and never retried by the gateway (the harness decides).\n\n"
        "Like the console, it starts the run in a process of its own and attaches; an SSH drop is a detach, the "
        "harnesses' connections stay up (`attach`, `ls`, `stop` reach it). --headless serves in the foreground "
        "without a console (for systemd): a line per event, ended by SIGTERM or `stop`, its report written.",
        epilog="examples:\n"
        "  cerevisor-tui gateway --upstream http://127.0.0.1:8000/v1            the whole set-up\n"
        "  cerevisor-tui gateway --upstream http://127.0.0.1:8000/v1 --model sim-model     every request to one model\n"
        "  cerevisor-tui gateway --config box.toml --headless --report gw.json   [gateway] and [[endpoints]] from a file\n\n"
        "then, e.g.:\n"
        "  ANTHROPIC_BASE_URL=http://127.0.0.1:8100 claude          Claude Code\n"
        "  OPENAI_BASE_URL=http://127.0.0.1:8100/v1 python agent.py   anything on the openai SDK\n"
        "  http://127.0.0.1:8100/a/NAME/v1                            a base URL whose path names the session\n\n"
        "Without --upstream or endpoints in the config it serves the built-in simulator (model sim-model).\n"
        "A non-loopback --listen needs [gateway] keys_env (client keys); see docs/gateway.md (\"Security\").",
        formatter_class=_formatter,
    )
    gateway.add_argument("--config", dest="gateway_config", metavar="FILE",
                         help="config file with [gateway] and [[endpoints]] (default: none; --upstream is enough)")
    gateway.add_argument("--listen", metavar="HOST:PORT", help="where to serve (default [gateway] listen, 127.0.0.1:8100)")
    gateway.add_argument("--upstream", metavar="URL",
                         help="the model server's OpenAI base URL (…/v1), or the name of an endpoint or pool of the config")
    gateway.add_argument("--model", metavar="ID",
                         help="send every request to model ID, whatever the harness asks for (else [gateway] model_map)")
    gateway.add_argument("--mode", choices=MODES, help="sequential (one session at a time), parallel (up to "
                         "--concurrency sessions), auto (each endpoint's cap follows what its server sustains)")
    gateway.add_argument("--concurrency", type=int, metavar="N", help="most sessions holding a slot at once (parallel)")
    gateway.add_argument("--run-dir", metavar="DIR", help="directory for events.jsonl, transcripts/ and report.json")
    gateway.add_argument("--report", metavar="PATH", help="also write the JSON report here")
    gateway.add_argument("--headless", action="store_true",
                         help="serve in the foreground without a console; a line per event; SIGTERM or `stop` ends it")
    gateway.add_argument("--detach", action="store_true",
                         help="start the gateway's run in a process of its own and return at once, without a console "
                              "(then `attach`, `ls`, `stop`)")
    gateway.add_argument("--jsonl", action="store_true", help="with --headless: print each event as one JSON object")

    attach = sub.add_parser(
        "attach",
        help="open the console on a run: live, or finished/crashed read-only",
        description="Open the console on a run. A live run (started with `run --detach`, or any run in progress) "
        "goes on when the console closes or its terminal goes away (an SSH drop is a detach); several consoles "
        "may attach to one run, and each sees and may do the same. A finished or crashed run opens read-only "
        "from its journal.",
        epilog="examples:\n  cerevisor-tui attach                      your live run (asks which, with several)\n"
        "  cerevisor-tui attach 20261201-031250-ab12\n  cerevisor-tui attach ~/runs/nightly --jsonl   its events as JSON lines, no console",
        formatter_class=_formatter,
    )
    attach.add_argument("run", nargs="?", metavar="RUN",
                        help="run id or run directory (default: your live run; with several, it asks which)")
    attach.add_argument("--jsonl", action="store_true",
                        help="no console: print the run's events as JSON lines (past ones first) until it ends")
    attach.add_argument("--runs-dir", metavar="DIR", help="where runs are (default: [run] run_dir of the config, "
                        "else the user state dir)")

    ls = sub.add_parser(
        "ls",
        help="list runs: live, finished, resumable or crashed",
        description="List the runs in the runs directory, newest first: id, state, agents done of total, started.\n"
        "live: in progress (attach to it); finished: every agent completed; resumable: ended with agents not "
        "completed; crashed: ended without finishing (killed, machine down). `run FILE --resume RUN` goes on "
        "with the last two.",
        formatter_class=_formatter,
    )
    ls.add_argument("--json", action="store_true", help="print the runs as a JSON list")
    ls.add_argument("--runs-dir", metavar="DIR", help="where runs are (default: [run] run_dir of the config, else "
                    "the user state dir)")

    stop = sub.add_parser(
        "stop",
        help="stop a live run: running agents are cancelled, the report is written",
        description="Stop a live run the way `q` then Stop does in its console: running agents are cancelled, the "
        "journal and report are written, every attached console is told. Returns when the run has ended.",
        formatter_class=_formatter,
    )
    stop.add_argument("run", nargs="?", metavar="RUN",
                      help="run id or run directory (default: your live run, named before it is stopped; with "
                           "several, it asks which)")
    stop.add_argument("--yes", action="store_true",
                      help="without RUN and with several live runs of yours: stop the newest without asking")
    stop.add_argument("--runs-dir", metavar="DIR", help="where runs are (default: [run] run_dir of the config, "
                      "else the user state dir)")

    sim = sub.add_parser(
        "sim",
        help="serve a simulated vLLM-like endpoint on loopback",
        description="A simulated vLLM-like OpenAI-compatible server: /health, /v1/models, /v1/chat/completions, /metrics.",
        epilog="example:\n  cerevisor-tui sim --port 8000 --max-num-seqs 4 --stall-after-tokens 20",
        formatter_class=_formatter,
    )
    sim.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    sim.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    if sim_options:
        _add_sim_options(sim)

    probe = sub.add_parser(
        "probe",
        help="measure what an endpoint sustains and recommend mode and cap",
        description="Check an endpoint (health, models, metrics) and sweep concurrency 1, 2, 4, ... to find its knee.",
        epilog="examples:\n  cerevisor-tui probe http://127.0.0.1:8000/v1 --max-concurrency 64\n"
        "  cerevisor-tui --config team.toml probe --json      the first configured endpoint\n"
        "  cerevisor-tui probe --workflow team.toml            conversations like team.toml's agents\n\n"
        "Each level keeps N streamed requests in flight for --level-seconds and at least 2 x N requests, and\n"
        "measures output tokens/s and TTFT p50/p95 while reading the server's /metrics. The sweep stops past\n"
        "the knee: the server queues requests, two levels in a row add under 15% throughput, TTFT p50 grows\n"
        "over 4x level 1's, or requests fail. Bounds: --max-requests in all (default 1000), --max-seconds in\n"
        "all (default 180), 60 s per request. Progress goes to stderr; the table or JSON to stdout.\n\n"
        "--workflow FILE replays the agents of a workflow config instead: at each level, max(N, 4) conversations\n"
        "with their system prompt and prompt sizes, their follow-up turns (the whole conversation resent each\n"
        "turn) and their max_tokens, N at a time, each with its own text so no cache hit is an accident. The\n"
        "table adds the server's prefix-cache hit rate per level, and the cap is the highest level whose hits\n"
        "stay near the best level's (within 15 points) with throughput within 10% of the best: past it, each\n"
        "agent's prefix is evicted before its next turn (when no level has both, prefixes win and the reason\n"
        "says what throughput that costs). A server without prefix-cache metrics is judged on throughput and\n"
        "TTFT. Without URL it probes the endpoint most agents use. Default --max-seconds: 600.\n\n"
        "Every finished probe saves its cap for that URL and model in the user state dir (probes.json).\n"
        "exit codes: 0 measured; 1 the endpoint is unusable (one line says why); 2 usage or config error.",
        formatter_class=_formatter,
    )
    probe.add_argument("url", nargs="?", metavar="URL",
                       help="base URL (…/v1); default: the first configured endpoint, or with --workflow the one "
                            "its agents use")
    probe.add_argument("--workflow", metavar="FILE",
                       help="workflow config (TOML) whose [[agents]] shape the probe's conversations")
    probe.add_argument("--max-concurrency", type=int, default=64, metavar="N", help="highest level of the sweep (default 64)")
    probe.add_argument("--model", metavar="ID", help="model id (default: the first of /v1/models)")
    probe.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    probe.add_argument("--max-tokens", type=int, metavar="N",
                       help="tokens per probe request (default 64); with --workflow, the most per answer "
                            "(default: each agent's max_tokens)")
    probe.add_argument("--level-seconds", type=float, default=2.0, metavar="S", help="least time each level runs (default 2)")
    probe.add_argument("--max-requests", type=int, default=1000, metavar="N", help="most requests in all, warm-up included (default 1000)")
    probe.add_argument("--max-seconds", type=float, metavar="S", help="most seconds in all (default 180; with --workflow 600)")
    probe.add_argument("--port-wait-seconds", type=float, default=60.0, metavar="S",
                       help="a server on this machine that does not listen yet (still starting) is asked again each "
                            "second for this long (default 60; 0: at once unreachable)")
    probe.add_argument("--json", action="store_true", help="print the result as JSON")

    replay = sub.add_parser(
        "replay",
        help="agentic sessions as the sizing studies describe them: generate or import a file, replay it",
        description="A replay file holds agentic sessions, one JSON line per turn: session_id, turn (from 1), "
        "input_length (the tokens new at this turn; turn 1: the whole first prompt), output_length, hash_ids "
        "(the whole prompt's 512-token blocks: the same id, the same text), delay_ms (the gap before the turn) "
        "and parent (a subagent's parent session, or null).",
        epilog="examples:\n"
        "  cerevisor-tui replay generate --preset agentx -o agentx.jsonl\n"
        "  cerevisor-tui replay generate --preset aiperf-inference-day --sessions 1131 --seed 42 -o day.jsonl\n"
        "  cerevisor-tui replay import conversation_trace.jsonl --format mooncake -o mooncake.jsonl\n"
        "  cerevisor-tui replay run agentx.jsonl --sim llama-3.1-8b@h100 --speed 10\n\n"
        "Each prints what the file holds: turns a session, first context, new and output tokens a turn, gaps,\n"
        "the whole prompt a turn, the prefix share and subagents (--json: as one object). See docs/replay.md.",
        formatter_class=_formatter,
    )
    replay_sub = replay.add_subparsers(dest="replay_command", metavar="ACTION", parser_class=_Parser, required=True)
    generate = replay_sub.add_parser(
        "generate",
        help="generate sessions from a preset",
        description="Generate agentic coding sessions from AIPerf's layer model (shared tools and system prompt, "
        "a group's repository context, the session's start, its growing history; lognormal sizes; agentic and "
        "human gaps; resets, restarts and subagents). The same preset, count and seed give the same file.\n\n"
        "presets:\n"
        "  aiperf-inference-day  AIPerf's reference trace: medians 11 turns a session, 47.3K first context,\n"
        "                        3.9K new and 786 output tokens a turn, 2.0 s between turns (1,131 sessions)\n"
        "  agentx                vLLM's AgentX study: medians 43 turns, 142K input and 444 output tokens a turn,\n"
        "                        > 95% of each turn's input a prefix of the one before, 44% spawn subagents (256)\n"
        "  tiered-offload        vLLM's tiered KV offloading study: 12K first prompt + 2K a round, 8 rounds (128)",
        epilog="example:\n  cerevisor-tui replay generate --preset aiperf-inference-day --sessions 1131 --seed 42 -o day.jsonl",
        formatter_class=_formatter,
    )
    generate.add_argument("--preset", required=True, choices=REPLAY_PRESETS, metavar="NAME",
                          help="agentx, aiperf-inference-day or tiered-offload")
    generate.add_argument("--sessions", type=int, metavar="N", help="top-level sessions (default: the preset's count)")
    generate.add_argument("--seed", type=int, default=42, metavar="S", help="random seed (default 42)")
    generate.add_argument("-o", "--output", required=True, metavar="FILE", help="the replay file to write")
    generate.add_argument("--json", action="store_true", help="print what the file holds as one JSON object")
    importer = replay_sub.add_parser(
        "import",
        help="read a published trace (Mooncake, Weka, TraceLab) into a replay file",
        description="Read a published trace into a replay file.\n\n"
        "formats:\n"
        "  mooncake  JSON lines of timestamp, input_length, output_length, hash_ids (Mooncake's traces; with\n"
        "            session_id and delay: AIPerf's multi-turn rows)\n"
        "  weka      Weka's KV-cache-tester traces: a JSON object per trace, or a directory of .json files\n"
        "            (id, block_size, hash_id_scope, requests with t, type, in, out, hash_ids; subagent\n"
        "            entries become subagent sessions)\n"
        "  tracelab  TraceLab's normalized round trace (session_id, round_index, input_tokens_total,\n"
        "            output_tokens, tools' latencies as the gap after a round)\n\n"
        "A turn whose prompt does not extend the one before (a compaction) starts a new session <id>~<n>.",
        epilog="example:\n  cerevisor-tui replay import llm_round_trace.public.jsonl --format tracelab -o tracelab.jsonl",
        formatter_class=_formatter,
    )
    importer.add_argument("file", metavar="FILE", help="the published trace")
    importer.add_argument("--format", required=True, choices=REPLAY_FORMATS, help="the trace's format")
    importer.add_argument("-o", "--output", required=True, metavar="FILE", help="the replay file to write")
    importer.add_argument("--json", action="store_true", help="print what the file holds as one JSON object")

    run_replay = replay_sub.add_parser(
        "run",
        help="replay a file closed loop against a server or the built-in simulator",
        description="Send a replay file's sessions to a server, closed loop: each turn only after the previous "
        "answer arrived and its gap passed (divided by --speed), --concurrency sessions at a time (a subagent "
        "starts after the answer that spawned it, within its parent's session's slot; with --as-agents in one of its "
        "own). A prompt is its blocks' "
        "text, so the server's prefix cache sees the file's own sharing; max_tokens is the turn's output_length.\n\n"
        "Without --endpoint it starts a simulator (--sim PROFILE picks its model and GPU; --speed scales its "
        "clock too, and the times shown are its own). It prints turns completed, TTFT and interactivity (output "
        "tokens/s per user) p50/p90, goodput (turns meeting --slo-interactivity and --slo-ttft-s, and how many a "
        "minute) and the prefix-cache hit rate from the server's /metrics counters.\n\n"
        "By default a plain client sends them (the measuring stick: what the server does with the traffic alone). "
        "--as-agents sends them as the run's own agents and --through-gateway as harness sessions through the "
        "run's gateway: under the run's --mode, cap, Auto and watchdog, and the report adds its cap changes and "
        "kills.\n"
        "exit codes: 0 every turn answered; 1 some failed (the first error is shown); 2 usage or file error.",
        epilog="examples:\n"
        "  cerevisor-tui replay run tiered.jsonl --sim --speed 20 --concurrency 32\n"
        "  cerevisor-tui replay run agentx.jsonl --sim llama-3.1-8b@h100 --speed 10 --report replay.json\n"
        "  cerevisor-tui replay run agentx.jsonl --endpoint http://127.0.0.1:8000/v1 --concurrency 16\n"
        "  cerevisor-tui replay run agentx.jsonl --sim --speed 10 --as-agents --mode auto --concurrency 64\n"
        "  cerevisor-tui replay run agentx.jsonl --sim --speed 10 --through-gateway --mode auto --concurrency 64",
        formatter_class=_formatter,
    )
    run_replay.add_argument("file", metavar="FILE", help="the replay file")
    target = run_replay.add_mutually_exclusive_group()
    target.add_argument("--endpoint", metavar="URL", help="the server's OpenAI base URL (…/v1)")
    target.add_argument("--sim", nargs="?", const="", metavar="PROFILE",
                        help="the built-in simulator (the default), with a model+GPU profile (see `sim --help`)")
    run_replay.add_argument("--model", metavar="ID", help="model id to request (default: the first of /v1/models)")
    run_replay.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    run_replay.add_argument("--concurrency", type=int, default=8, metavar="N",
                            help="sessions at once (default 8); with --as-agents or --through-gateway the run's cap")
    as_run = run_replay.add_mutually_exclusive_group()
    as_run.add_argument("--as-agents", action="store_true",
                        help="the sessions as the run's own agents: each an agent of a run (journal, report, "
                        "`cerevisor-tui attach` follows it) under its mode, cap, Auto, watchdog and retries; a "
                        "subagent is an agent of its own, queued after its parent's spawning answer")
    as_run.add_argument("--through-gateway", action="store_true",
                        help="send the sessions through a gateway of a run of their own, as harness traffic "
                        "arrives: each session a row under the run's mode, cap, Auto and watchdog")
    run_replay.add_argument("--mode", choices=MODES,
                            help="with --as-agents or --through-gateway: the run's mode (default parallel); the "
                            "report adds the run's cap changes and kills")
    run_replay.add_argument("--run-dir", metavar="DIR",
                            help="with --as-agents or --through-gateway: the run's directory (default: a new one under the "
                            "runs directory); `cerevisor-tui attach DIR` follows it")
    run_replay.add_argument("--release-after-s", type=float, metavar="S",
                            help="with --through-gateway: a session gives its slot back after S seconds without a "
                            "request, in the trace's seconds (default 60, the gateway's [gateway] release_after_s)")
    run_replay.add_argument("--speed", type=float, default=1.0, metavar="X",
                            help="divide the gaps between turns by X (and run the simulator X times faster)")
    run_replay.add_argument("--slo-interactivity", type=float, default=50.0, metavar="TOK_S",
                            help="goodput counts turns with at least this many output tokens/s per user (default 50)")
    run_replay.add_argument("--slo-ttft-s", type=float, default=30.0, metavar="S",
                            help="and, past a session's first turn, a TTFT of at most S seconds (default 30)")
    run_replay.add_argument("--report", metavar="PATH", help="also write the report, with each session's figures, "
                            "as JSON here")
    run_replay.add_argument("--json", action="store_true", help="print the report as one JSON object")

    est = sub.add_parser(
        "estimate",
        help="how many conversations fit in GPU KV memory",
        description="Estimate KV-cache capacity: bytes per token, tokens that fit, conversations that fit, zones.",
        epilog="examples:\n  cerevisor-tui estimate --model llama-3.1-70b --gpu h100 --gpus 4 --context 32768\n"
        "  cerevisor-tui estimate --model-config ./config.json --kv-memory-gib 12.5\n"
        "  cerevisor-tui estimate --model qwen3-32b --gpu h100 --cpu-offload-gib 200 --context 16384\n"
        "  cerevisor-tui estimate --list\n\n"
        "--kv-memory-gib is per GPU, as vLLM logs it ('Available KV cache memory: X GiB'); the tokens printed\n"
        "then match vLLM's own 'GPU KV cache size: N tokens'. docs/guide.md (\"Capacity\") explains the zones.",
        formatter_class=_formatter,
    )
    model = est.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", metavar="NAME", help="model preset (see --list)")
    model.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json")
    model.add_argument("--list", action="store_true", help="list model and GPU presets")
    est.add_argument("--gpu", metavar="NAME", help="GPU preset")
    est.add_argument("--gpus", type=int, default=1, metavar="N", help="number of GPUs (tensor parallel; default 1)")
    est.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="U", help="fraction of GPU memory the server may use (default 0.9)")
    est.add_argument("--kv-memory-gib", type=float, metavar="G",
                     help="KV memory per GPU the server reported (vLLM: 'Available KV cache memory: G GiB'), instead of --gpu")
    est.add_argument("--context", type=int, metavar="TOKENS", help="tokens per conversation (default: the model's max)")
    est.add_argument("--kv-dtype", default="auto", metavar="D", help="auto, fp16, bf16, fp8 (default auto: the model's dtype)")
    est.add_argument("--cpu-offload-gib", type=float, default=0.0, metavar="G", help="CPU KV tier size, all GPUs together (default 0)")
    est.add_argument("--runtime-reserve-gib", type=float, metavar="G",
                     help="memory per GPU for activations, CUDA graphs and the CUDA context (default 4)")
    est.add_argument("--weights-gib", type=float, metavar="G", help="model weights in all (default: from the preset or config.json)")
    est.add_argument("--block-size", type=int, metavar="N", help="KV block size in tokens (default 16; vLLM on CPU: 128)")
    est.add_argument("--reload-gb-per-s", type=float, metavar="X", help="host-to-GPU bandwidth per GPU for CPU-tier reloads")
    est.add_argument("--prefill-tokens-per-s", type=float, metavar="X", help="prefill throughput, for the recompute time")
    est.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def _add_sim_options(parser: argparse.ArgumentParser) -> None:
    """Flags for every SimSettings field, named after it (--tokens-per-s, --max-num-seqs, ...)."""
    from cerevisor_tui.config.models import SimSettings, field_doc

    for name, field in SimSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _inline_table if isinstance(field.default, dict) else type(field.default)
        parser.add_argument(flag, dest=name, type=kind, default=None, metavar=name.split("_")[-1].upper(),
                            help=f"{field_doc(SimSettings, name)} (default {field.default!r})")


def _inline_table(text: str) -> dict:
    """A TOML inline table, as a config file would write it: `{ get_current_time = { timezone = "UTC" } }`."""
    import tomllib

    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not a TOML inline table ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a TOML inline table: {text!r}")
    return value


_inline_table.__name__ = "inline table"  # argparse names the type in its error


PIPE_CLOSED = 141
"""The exit code of a command whose output was closed before it was all written (`ls | head -1`): as a Unix
tool ended by SIGPIPE (128 + 13), quietly. A run goes on past its own output and exits with its own code."""


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None
    argv = sys.argv[1:] if argv is None else argv
    try:
        # The simulator's flags are built from its pydantic settings model: importing pydantic would double the
        # time `--help` takes, so they are only built when the command line may name the sim subcommand.
        args = build_parser(sim_options="sim" in argv).parse_args(argv)
        # the process's own command line (the script, `python -m`), not a caller's argv run in its process: the
        # command may tune what is the process's alone (its collector: heap.py)
        args.own_process = own_process
        command = args.command or "console"
        module = importlib.import_module(f"cerevisor_tui.commands.{command}")
        code = int(module.main(args) or 0)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe is a traceback and exit 120
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # whoever read our output has gone (`| head`, a dead `tee`)
        _silence_stdout()
        return PIPE_CLOSED
    return code


def _silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so what is left in its buffer goes nowhere at exit instead of failing
    again (Python's own advice for SIGPIPE: https://docs.python.org/3/library/signal.html#note-on-sigpipe)."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
