"""The `[gateway]` keys that apply while the run serves (the settings screen's `set_gateway`): how long an idle
session keeps its slot, how many sessions a key may open, the keep-alive pace, and the grace before a port that
never answered is down. Each is set where it is read, so the next look at it takes the new value; the rest of
`[gateway]` (where it listens, its keys, its bounds on connections and bodies, when idle sessions are forgotten,
whose task starts with the run) takes a new run.
"""

from __future__ import annotations

from collections.abc import Callable

from cerevisor_tui.config.models import GatewayConfig
from cerevisor_tui.contract import commands as cmd
from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.endpoint_state import EndpointStates
from cerevisor_tui.engine.sessions import Sessions

LIVE_KEYS: tuple[str, ...] = cmd.SetGateway.__struct_fields__
"""The `[gateway]` keys that apply live: those `SetGateway` carries."""


def live_values(settings: GatewayConfig) -> cmd.SetGateway:
    """The command that sets `settings`' live keys."""
    return cmd.SetGateway(**{key: getattr(settings, key) for key in LIVE_KEYS})


def apply_gateway(command: cmd.SetGateway, settings: GatewayConfig, sessions: Sessions, states: EndpointStates,
                  emit: Callable[[ev.Event], None], clock: Clock) -> str:
    """Set the live keys: in `settings` (the gateway reads its keep-alive pace there per request), in `sessions`
    (the release, the cap per key) and in `states` (the down grace). A shorter `release_after_s` gives idle
    sessions' slots back at once. Returns the keys that changed, comma-separated, and tells them as a RunNotice."""
    changed = [key for key in LIVE_KEYS if getattr(command, key) != getattr(settings, key)]
    if not changed:
        return ""
    for key in changed:
        setattr(settings, key, getattr(command, key))
    sessions.release_after_s = settings.release_after_s
    sessions.max_per_key = settings.max_sessions_per_key
    states.down_after_s = settings.down_after_s
    if "release_after_s" in changed:
        for session in sessions.by_name.values():
            session.poke()  # its hold reads the new release time now, not when its old one ends
    said = ", ".join(f"{key} {getattr(command, key):g}" for key in changed)
    emit(ev.RunNotice(clock.now(), f"gateway settings applied: {said}", "information", "Gateway"))
    return ", ".join(changed)
