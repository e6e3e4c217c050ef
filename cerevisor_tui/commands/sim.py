"""`cerevisor-tui sim`: serve a simulated vLLM-like endpoint until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

from pydantic import ValidationError

from cerevisor_tui.config.models import SimSettings, is_loopback

PROG = "cerevisor-tui sim"


def _settings(args: Any) -> SimSettings:
    given = {name: getattr(args, name) for name in SimSettings.model_fields if getattr(args, name, None) is not None}
    return SimSettings(**given)


def _validation_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        flag = "--" + "-".join(str(p) for p in err["loc"]).replace("_", "-")
        parts.append(f"{flag}: {err['msg']}")
    return "; ".join(parts)


def main(args: Any) -> int:
    from cerevisor_tui.sim import ProfileError, SimServer, resolve
    from cerevisor_tui.sim.server import bind_socket

    try:
        settings = _settings(args)
        spec = resolve(settings)
    except ValidationError as exc:
        print(f"{PROG}: error: {_validation_line(exc)}", file=sys.stderr)
        return 2
    except ProfileError as exc:
        print(f"{PROG}: error: --profile: {exc}", file=sys.stderr)
        return 2
    host, port = args.host, args.port
    if not 0 <= port <= 65535:
        print(f"{PROG}: error: --port: must be 0-65535 (0 picks a free one), got {port}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(host, port)
    except (OSError, UnicodeError, ValueError) as exc:  # an address that cannot be bound, or named a host
        reason = ("port already in use" if getattr(exc, "errno", None) in (98, 48, 10048)
                  else getattr(exc, "strerror", None) or exc)
        shown = host if host.isprintable() else repr(host)
        print(f"{PROG}: error: cannot listen on {shown}:{port}: {reason}", file=sys.stderr)
        return 2
    model = getattr(args, "model", None) or "sim-model"
    server = SimServer(settings, host=host, model=model, sock=sock)

    async def serve() -> None:
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        extra = f", profile {spec.profile}" if spec.profile else ""
        print(
            f"{PROG}: serving {model} on {server.base_url} (SIMULATED{extra}; "
            f"{spec.kv_cache_tokens} KV tokens, max_num_seqs {spec.params.max_num_seqs}, "
            f"speed x{settings.speed:g}); Ctrl-C stops it",
            file=sys.stderr, flush=True,
        )
        if not is_loopback(host):
            where = "all interfaces" if host in ("0.0.0.0", "::", "") else f"{host}, not loopback"
            print(f"{PROG}: warning: listening on {where}: anyone on the network can use it",
                  file=sys.stderr, flush=True)
        waiter = asyncio.ensure_future(stop.wait())
        done_task = asyncio.ensure_future(server.serve_forever())
        await asyncio.wait({waiter, done_task}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        await server.stop()

    asyncio.run(serve())
    return 0
