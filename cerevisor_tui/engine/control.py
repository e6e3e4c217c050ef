"""The operator's commands to a run, by name and with JSON-able keyword arguments: what a console sends
(over the run's control socket, or in-process here) and the engine carries out.

Every command returns at once, with at most a small JSON-able value that says what it did; what it
changes the console learns from the events that follow (a probe reports through ProbeStarted,
ProbeProgress and ProbeFinished). `apply` checks a command's name and arguments before it calls it, so
a client's mistake is one `ValueError` line, never a traceback in the run.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from cerevisor_tui.config.models import ResolvedStall
from cerevisor_tui.kinds import MODES

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine


class LocalControl:
    """The commands of one in-process Engine. Call them from the engine's event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def set_mode(self, mode: str) -> str:
        """sequential | parallel | auto, now; running agents are never stopped by it."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        self.engine.set_mode(mode)
        return mode

    def cycle_mode(self) -> str:
        """The next mode (sequential -> parallel -> auto -> sequential); returns it."""
        return self.engine.cycle_mode()

    def set_concurrency(self, cap: int) -> int:
        """The parallel cap (at least 1); lowering it only holds admissions. Returns the cap in force."""
        self.engine.set_concurrency(cap)
        return self.engine.scheduler.max_concurrency

    def nudge_cap(self, delta: int) -> int:
        """`+`/`-`: the parallel cap, or in auto mode its ceiling, moved by `delta`; returns the new value."""
        return self.engine.nudge_cap(delta)

    def pause(self) -> None:
        """Hold new admissions; running agents go on."""
        self.engine.pause()

    def resume(self) -> None:
        """Admit again."""
        self.engine.resume()

    def kill(self, agent: str, reason: str = "killed by operator") -> bool:
        """Close the agent's running request (no retry follows) or drop it from the queue; False: it had ended.
        While the agent is in a tool call, the call is cancelled instead and the model told so."""
        return self.engine.kill(self._agent(agent), reason)

    def extend(self, agent: str, seconds: float | None = None) -> bool:
        """Move the running attempt's deadline later (default [stall].extend_s), or the running tool call's
        tool deadline; False: nothing runs."""
        return self.engine.extend(self._agent(agent), seconds)

    def retry(self, agent: str) -> str:
        """Restart the running attempt, or run a failed/killed agent of the current wave again; says which."""
        return self.engine.retry(self._agent(agent))

    def approve(self, agent: str, call_id: str, scope: str = "once") -> str:
        """Let a tool call that waits for approval run: "once" (this call) or "run" (this tool, for the rest of
        the run, kept by --resume). Returns the scope."""
        if scope not in ("once", "run"):
            raise ValueError(f"approve: scope must be once or run, not {scope!r}")
        self.engine.approve(self._agent(agent), call_id, scope)
        return scope

    def deny(self, agent: str, call_id: str) -> None:
        """Refuse a tool call that waits for approval: the model gets a result saying the operator denied it."""
        self.engine.deny(self._agent(agent), call_id)

    def set_stall(self, endpoint: str, policy: dict[str, Any]) -> bool:
        """The endpoint's whole stall policy (the keys of RunStarted's `stall`); returns whether it changed."""
        self._endpoint(endpoint)
        try:
            resolved = ResolvedStall.model_validate(policy)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "policy"
            raise ValueError(f"set_stall: {where}: {first['msg']}") from None
        return self.engine.set_stall_policy(endpoint, resolved)

    def stop(self, reason: str = "run stopped") -> None:
        """Stop the run: no more admissions; running and queued agents are cancelled (RunStopping, then RunFinished)."""
        self.engine.stop(reason)

    def probe(self, endpoint: str, max_concurrency: int | None = None) -> None:
        """Sweep an endpoint of the run in the background; it reports through Probe* events."""
        self.engine.start_probe(self._endpoint(endpoint), max_concurrency)

    def cancel_probe(self, endpoint: str) -> bool:
        """Cancel the endpoint's running probe (its requests are closed); False: none was running."""
        return self.engine.cancel_probe(self._endpoint(endpoint))

    # ---- checks -------------------------------------------------------------------------------------
    def _agent(self, name: str) -> str:
        if name not in self.engine.agents:
            raise ValueError(f"no agent named {name!r} in this run")
        return name

    def _endpoint(self, name: str) -> str:
        if name not in self.engine.endpoints:
            raise ValueError(f"no endpoint named {name!r} in this run")
        return name


COMMANDS: frozenset[str] = frozenset(
    name for name, member in vars(LocalControl).items() if not name.startswith("_") and callable(member))
"""The commands a client may send, by name."""

_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
                                       "dict[str, Any]": (dict,)}


def apply(control: LocalControl, name: str, args: dict[str, Any]) -> Any:
    """Call command `name` with keyword arguments `args`, checked first against its signature; raises
    ValueError (one line, for the client) for an unknown command, a missing, unknown or mistyped argument."""
    if name not in COMMANDS:
        raise ValueError(f"unknown command {name!r} (known: {', '.join(sorted(COMMANDS))})")
    if not isinstance(args, dict):
        raise ValueError(f"{name}: arguments must be an object of names and values")
    method = getattr(control, name)
    params = inspect.signature(method).parameters
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ValueError(f"{name}: unknown argument {', '.join(unknown)} (takes: {', '.join(params) or 'none'})")
    for param in params.values():
        if param.name not in args:
            if param.default is inspect.Parameter.empty:
                raise ValueError(f"{name}: missing argument {param.name}")
            continue
        value = args[param.name]
        annotation = str(param.annotation)
        optional = annotation.endswith(" | None")
        if value is None and optional:
            continue
        allowed = _TYPES.get(annotation.removesuffix(" | None"))
        if allowed is not None and (not isinstance(value, allowed) or (bool not in allowed and isinstance(value, bool))):
            raise ValueError(f"{name}: {param.name} must be {annotation.removesuffix(' | None')}, not {value!r}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{name}: {param.name} must be a finite number")
    return method(**args)
