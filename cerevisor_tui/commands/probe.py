"""`cerevisor-tui probe [URL] [--workflow FILE]`: measure what an endpoint sustains and recommend a mode and a cap.

With --workflow, the sweep replays conversations shaped like the workflow's agents (conversation mode)
and the cap is where their prefixes survive between turns; without it, short single-turn requests.
Progress goes to stderr as the sweep runs; the table (or, with --json, one JSON object) goes to stdout.
Exit codes: 0 measured, 1 the endpoint is unusable, 2 a usage or config error.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import anyio

from cerevisor_tui.config import AgentConfig, Config, ConfigError, EndpointConfig, SimSettings, load_config
from cerevisor_tui.config.checks import check_key, is_loopback
from cerevisor_tui.config.models import shown_url, url_problem
from cerevisor_tui.config.paths import find_config

PROG = "cerevisor-tui probe"
SINGLE_TURN_MAX_SECONDS = 180.0
CONVERSATION_MAX_SECONDS = 600.0  # conversations of real agent turns take longer than short requests


class _Target:
    """What to probe: a base URL (or a simulator to start), its key and model, and (conversation mode)
    the agents whose conversations to replay."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 sim: SimSettings | None = None, label: str = "", agents: list[AgentConfig] | None = None,
                 extra_body: dict[str, Any] | None = None) -> None:
        self.base_url, self.api_key, self.model, self.sim, self.label = base_url, api_key, model, sim, label
        self.agents = agents or []
        self.extra_body = extra_body or {}  # the endpoint's own request parameters, sent as the run sends them
        self.note = ""  # said on stderr once the probe starts


def main(args: Any) -> int:
    from cerevisor_tui.endpoints.probe import ProbeSettings

    try:
        target = _target(args)
        conversation = bool(target.agents)
        max_tokens = getattr(args, "max_tokens", None)
        max_seconds = getattr(args, "max_seconds", None)
        settings = ProbeSettings(
            max_concurrency=args.max_concurrency,
            max_tokens=ProbeSettings.max_tokens if max_tokens is None else max_tokens,
            turn_max_tokens=max_tokens if conversation else None,
            max_requests=getattr(args, "max_requests", ProbeSettings.max_requests),
            max_seconds=max_seconds if max_seconds is not None else (
                CONVERSATION_MAX_SECONDS if conversation else SINGLE_TURN_MAX_SECONDS),
            level_s=getattr(args, "level_seconds", ProbeSettings.level_s),
            port_wait_s=getattr(args, "port_wait_seconds", ProbeSettings.port_wait_s),
            extra_body=target.extra_body,
        )
    except (ConfigError, ValueError) as exc:
        print(f"{PROG}: error: {_flag_text(exc)}", file=sys.stderr)
        return 2
    return anyio.run(_main, target, settings, bool(args.json))


def _flag_text(exc: Exception) -> str:
    text = str(exc)
    for name, flag in (("max_concurrency", "max-concurrency"), ("turn_max_tokens", "max-tokens"),
                       ("max_tokens", "max-tokens"), ("max_requests", "max-requests"), ("max_seconds", "max-seconds"),
                       ("level_s", "level-seconds"), ("port_wait_s", "port-wait-seconds")):
        text = text.replace(name, "--" + flag)
    return text


def _target(args: Any) -> _Target:
    workflow = getattr(args, "workflow", None)
    if workflow:
        return _workflow_target(args, Path(workflow))
    key_env = args.api_key_env
    if args.url:
        url = _normalize(args.url)
        key = _key(key_env, url, allow_insecure=False) if key_env else None
        return _Target(url, api_key=key, model=args.model)
    path = find_config(getattr(args, "config", None))
    if path is None:
        raise ConfigError("no URL given and no config file found (pass a URL such as http://127.0.0.1:8000/v1, "
                          "or --config FILE with an [[endpoints]] table)")
    config = load_config(path)
    if not config.endpoints:
        raise ConfigError("no URL given and the config has no [[endpoints]] to probe", file=str(path),
                          key="endpoints")
    return _endpoint_target(args, config.endpoints[0], f"endpoint {config.endpoints[0].name!r} from {path}")


def _workflow_target(args: Any, path: Path) -> _Target:
    """Conversation mode: the workflow's agents, against URL or else the endpoint most of them use."""
    config = load_config(path)
    if not config.agents:
        raise ConfigError("no [[agents]] to shape the probe's conversations (--workflow needs a workflow)",
                          file=str(path), key="agents")
    if args.url:
        url = _normalize(args.url)
        key = _key(args.api_key_env, url, allow_insecure=False) if args.api_key_env else None
        return _Target(url, api_key=key, model=args.model, agents=list(config.agents),
                       label=f"{_agents(len(config.agents))} of {path}")
    name = _busiest_endpoint(config)
    agents = [a for a in config.agents if config.agent_endpoint(a).name == name]
    target = _endpoint_target(args, config.endpoint(name), f"endpoint {name!r}, {_agents(len(agents))} of {path}",
                              agents)
    others = len(config.agents) - len(agents)
    if others:
        target.note = (f"{_agents(others)} on other endpoints left out; probe them with "
                       f"`{PROG} URL --workflow {path}`")
    return target


def _busiest_endpoint(config: Config) -> str:
    """The endpoint most agents use (the first of them on a tie)."""
    counts = Counter(config.agent_endpoint(a).name for a in config.agents)
    return max(counts, key=lambda name: counts[name])


def _endpoint_target(args: Any, ep: EndpointConfig, label: str, agents: list[AgentConfig] | None = None) -> _Target:
    model = args.model or ep.model or None
    key_env = args.api_key_env or ep.api_key_env
    if ep.kind == "simulated" and not ep.base_url:
        return _Target("", model=model, sim=ep.sim, label=f"{label} (built-in simulator)", agents=agents,
                       extra_body=ep.extra_body)
    url = _normalize(ep.base_url)
    key = _key(key_env, url, allow_insecure=ep.allow_insecure_http) if key_env else None
    return _Target(url, api_key=key, model=model, label=label, agents=agents, extra_body=ep.extra_body)


def _agents(n: int) -> str:
    return f"{n} agent{'s' * (n != 1)}"


def _normalize(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"URL must start with http:// or https:// and name a host (got {shown_url(url)!r})")
    problem = url_problem(url)  # the rule a config's base_url follows: port 1-65535, no spaces, no credentials
    if problem:
        raise ConfigError(f"URL {problem}" + ("" if "@" in url else f" (got {url!r})"))
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/v1"
        print(f"{PROG}: no path in the URL; probing {url}", file=sys.stderr)
    return url.rstrip("/")


def _key(env: str, url: str, *, allow_insecure: bool) -> str:
    value = os.environ.get(env)
    if not value:
        raise ConfigError(f"environment variable {env} (--api-key-env) is not set")
    check_key(env, value, key="--api-key-env")
    host = urlsplit(url).hostname or ""
    if urlsplit(url).scheme == "http" and not is_loopback(host) and not allow_insecure:
        raise ConfigError(f"would send the API key in clear text over http:// to {host}; use https://")
    return value


async def _main(target: _Target, settings: Any, as_json: bool) -> int:
    from contextlib import AsyncExitStack

    from cerevisor_tui.endpoints.client import build_client
    from cerevisor_tui.endpoints.probe import EndpointUnusable, probe_conversations

    out, err = sys.stdout, sys.stderr
    table = _Table(out, conversation=bool(target.agents)) if not as_json else None
    async with AsyncExitStack() as stack:
        base_url = target.base_url
        if target.sim is not None:
            from cerevisor_tui.sim import SimServer

            server = await stack.enter_async_context(SimServer(target.sim, port=0))
            base_url = server.base_url
        if target.label:
            print(f"probing {target.label}: {base_url}", file=err)
        if target.note:
            print(f"  {target.note}", file=err)
        client = await stack.enter_async_context(build_client(settings.max_concurrency, target.api_key))
        try:
            # no agents: the single-turn probe; a simulator started here has no address worth remembering
            result = await probe_conversations(
                client, base_url, target.agents, model=target.model, settings=settings,
                on_progress=lambda line: print(f"  {line}", file=err, flush=True),
                on_level=table.row if table else None, save=target.sim is None,
            )
        except EndpointUnusable as exc:
            print(f"{PROG}: {base_url}: {exc.problem}", file=err)
            return 1
    if as_json:
        json.dump(result.to_dict(), out, indent=2)
        out.write("\n")
    else:
        assert table is not None
        table.summary(result)
    out.flush()
    return 0


class _Table:
    """The sweep as a table, one row printed as each level completes; conversation mode adds how many
    conversations ran, the server's prefix-cache hit rate and its preemptions."""

    HEAD = (f"{'conc':>5} {'requests':>8} {'failed':>6} {'tokens/s':>10} {'gain':>6} {'TTFT p50':>9} "
            f"{'TTFT p95':>9} {'running':>7} {'waiting':>7} {'KV use':>6}")
    CONVERSATION_HEAD = f"{'convs':>5} {'prefix hits':>11} {'preempt':>7}"

    def __init__(self, out: TextIO, *, conversation: bool = False) -> None:
        self.out = out
        self.conversation = conversation
        self.previous: float | None = None
        self.started = False

    def row(self, level: Any) -> None:
        if not self.started:
            print(self.HEAD + (" " + self.CONVERSATION_HEAD if self.conversation else ""), file=self.out)
            self.started = True
        gain = "-" if not self.previous else f"{level.output_tokens_per_s / self.previous - 1:+.0%}"
        self.previous = level.output_tokens_per_s
        extra = ""
        if self.conversation:
            hits = "-" if level.prefix_hit_rate is None else f"{level.prefix_hit_rate:.0%}"
            extra = f" {_n(level.conversations):>5} {hits:>11} {_n(level.preemptions):>7}"
        print(
            f"{level.concurrency:>5} {level.requests:>8} {level.failed:>6} {level.output_tokens_per_s:>10,.1f} "
            f"{gain:>6} {_s(level.ttft_p50_s):>9} {_s(level.ttft_p95_s):>9} {_n(level.server_running_max):>7} "
            f"{_n(level.server_waiting_max):>7} {_ratio(level.kv_cache_usage_max):>6}{extra}"
            + ("  (cut short by --max-seconds)" if not level.complete else ""),
            file=self.out, flush=True,
        )

    def summary(self, result: Any) -> None:
        out = self.out
        facts = [f"server {result.server_kind}", f"model {result.model}"]
        if result.max_model_len:
            facts.append(f"max_model_len {result.max_model_len:,}")
        if result.kv_cache_tokens:
            facts.append(f"KV cache {result.kv_cache_tokens:,} tokens")
        print(f"\n{', '.join(facts)}; {result.total_requests} requests in {result.elapsed_s:.1f} s", file=out)
        if result.mode == "conversation":
            print(f"conversations shaped like the workflow's {_agents(result.agents)}", file=out)
        cap = result.recommended_concurrency
        print(f"recommended: {result.recommended_mode}, max_concurrency = {cap}", file=out)
        print(f"why: {result.reason}", file=out)
        print(f'configure: [[endpoints]] max_concurrency = {cap}; [run] mode = "{result.recommended_mode}"',
              file=out)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _n(value: int | None) -> str:
    return "-" if value is None else str(value)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
