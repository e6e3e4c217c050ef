"""`cerevisor-tui probe [URL]`: measure what an endpoint sustains and recommend a mode and a cap.

Progress goes to stderr as the sweep runs; the table (or, with --json, one JSON object) goes to stdout.
Exit codes: 0 measured, 1 the endpoint is unusable, 2 a usage or config error.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, TextIO
from urllib.parse import urlsplit

import anyio

from cerevisor_tui.config import ConfigError, SimSettings, load_config
from cerevisor_tui.config.checks import is_loopback
from cerevisor_tui.config.paths import find_config

PROG = "cerevisor-tui probe"


class _Target:
    """What to probe: a base URL (or a simulator to start), its key and model."""

    def __init__(self, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 sim: SimSettings | None = None, label: str = "") -> None:
        self.base_url, self.api_key, self.model, self.sim, self.label = base_url, api_key, model, sim, label


def main(args: Any) -> int:
    from cerevisor_tui.endpoints.probe import ProbeSettings

    try:
        target = _target(args)
        settings = ProbeSettings(
            max_concurrency=args.max_concurrency,
            max_tokens=args.max_tokens,
            max_requests=getattr(args, "max_requests", ProbeSettings.max_requests),
            max_seconds=getattr(args, "max_seconds", ProbeSettings.max_seconds),
            level_s=getattr(args, "level_seconds", ProbeSettings.level_s),
        )
    except (ConfigError, ValueError) as exc:
        print(f"{PROG}: error: {_flag_text(exc)}", file=sys.stderr)
        return 2
    return anyio.run(_main, target, settings, bool(args.json))


def _flag_text(exc: Exception) -> str:
    text = str(exc)
    for name, flag in (("max_concurrency", "max-concurrency"), ("max_tokens", "max-tokens"),
                       ("max_requests", "max-requests"), ("max_seconds", "max-seconds"), ("level_s", "level-seconds")):
        text = text.replace(name, "--" + flag)
    return text


def _target(args: Any) -> _Target:
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
    ep = config.endpoints[0]
    model = args.model or ep.model or None
    key_env = key_env or ep.api_key_env
    if ep.kind == "simulated" and not ep.base_url:
        return _Target("", model=model, sim=ep.sim, label=f"endpoint {ep.name!r} (built-in simulator)")
    url = _normalize(ep.base_url)
    key = _key(key_env, url, allow_insecure=ep.allow_insecure_http) if key_env else None
    return _Target(url, api_key=key, model=model, label=f"endpoint {ep.name!r} from {path}")


def _normalize(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"URL must start with http:// or https:// and name a host (got {url!r})")
    if parts.path in ("", "/"):
        url = url.rstrip("/") + "/v1"
        print(f"{PROG}: no path in the URL; probing {url}", file=sys.stderr)
    return url.rstrip("/")


def _key(env: str, url: str, *, allow_insecure: bool) -> str:
    value = os.environ.get(env)
    if not value:
        raise ConfigError(f"environment variable {env} (--api-key-env) is not set")
    host = urlsplit(url).hostname or ""
    if urlsplit(url).scheme == "http" and not is_loopback(host) and not allow_insecure:
        raise ConfigError(f"would send the API key in clear text over http:// to {host}; use https://")
    return value


async def _main(target: _Target, settings: Any, as_json: bool) -> int:
    from contextlib import AsyncExitStack

    from cerevisor_tui.endpoints.client import build_client
    from cerevisor_tui.endpoints.probe import EndpointUnusable, probe

    out, err = sys.stdout, sys.stderr
    table = _Table(out) if not as_json else None
    async with AsyncExitStack() as stack:
        base_url = target.base_url
        if target.sim is not None:
            from cerevisor_tui.sim import SimServer

            server = await stack.enter_async_context(SimServer(target.sim, port=0))
            base_url = server.base_url
        if target.label:
            print(f"probing {target.label}: {base_url}", file=err)
        client = await stack.enter_async_context(build_client(settings.max_concurrency, target.api_key))
        try:
            result = await probe(
                client, base_url, model=target.model, settings=settings,
                on_progress=lambda line: print(f"  {line}", file=err, flush=True),
                on_level=table.row if table else None,
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
    """The sweep as a table, one row printed as each level completes."""

    HEAD = (f"{'conc':>5} {'requests':>8} {'failed':>6} {'tokens/s':>10} {'gain':>6} {'TTFT p50':>9} "
            f"{'TTFT p95':>9} {'running':>7} {'waiting':>7} {'KV use':>6}")

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.previous: float | None = None
        self.started = False

    def row(self, level: Any) -> None:
        if not self.started:
            print(self.HEAD, file=self.out)
            self.started = True
        gain = "-" if not self.previous else f"{level.output_tokens_per_s / self.previous - 1:+.0%}"
        self.previous = level.output_tokens_per_s
        print(
            f"{level.concurrency:>5} {level.requests:>8} {level.failed:>6} {level.output_tokens_per_s:>10,.1f} "
            f"{gain:>6} {_s(level.ttft_p50_s):>9} {_s(level.ttft_p95_s):>9} {_n(level.server_running_max):>7} "
            f"{_n(level.server_waiting_max):>7} {_ratio(level.kv_cache_usage_max):>6}"
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
