"""Each endpoint's state, said rather than waited on: one owner (`EndpointStates`) that the server monitor's looks,
the connections of requests (the gateway's and the workflow's) and the wedge rules feed, and that tells an
`EndpointState` event only when a state changes, with why and since when.

The rules (issue 30):
- a look that finds the server ready is `up`; one where it says it is loading (/health 503, llama.cpp's "Loading
  model") is `loading`, for as long as it says so;
- a port that has never answered and refuses (or a look that cannot reach it) for `down_after_s` is `down`, the
  grace counted from its first refusal: vLLM keeps its port closed while it loads, a mistyped address forever;
- a server seen answering once that then fails `DOWN_AFTER_CHECKS` looks in a row is `down` (one failed look is a
  blip, three at the monitor's pace are a restart or a crash), from its first failed look;
- a server the wedge rules judged wedged (engine/wedge.py) is `wedged` while its looks say it is up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.metrics import ServerStatus
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.kinds import EndpointStateName

DOWN_AFTER_CHECKS = 3
"""Failed looks in a row that make a server seen answering once `down`."""


def address(base_url: str) -> str:
    """Where an endpoint listens, as an operator types it: `127.0.0.1:8399` (the URL itself when it has no host)."""
    parts = urlsplit(base_url)
    if not parts.hostname:
        return base_url
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{host}:{port}"


class EndpointStates:
    """The run's one owner of each endpoint's state: fed by the monitor (`looked`), by requests' connections
    (`answered`, `refused`) and by the wedge rules (`wedged`, `moves_again`); emits each change once."""

    def __init__(self, emit: Callable[[ev.Event], None], clock: Clock, base_urls: Mapping[str, str],
                 down_after_s: float) -> None:
        self.emit = emit
        self.clock = clock
        self.base_urls = base_urls  # the run's live map: the simulator's URL once it is started
        self.down_after_s = down_after_s
        self.state: dict[str, ev.EndpointState] = {}  # each endpoint's last told
        self.answered_ever: set[str] = set()
        self.refused_since: dict[str, float] = {}  # since when a port that never answered refuses
        self.failed_looks: dict[str, tuple[int, float, str]] = {}  # failed looks in a row: how many, since, why
        self.wedged_why: dict[str, str] = {}

    # ---- what feeds it ------------------------------------------------------------------------------------
    def looked(self, endpoint: str, status: ServerStatus) -> None:
        """One of the monitor's looks at `endpoint` (its /health, or a router's)."""
        now = self.clock.now()
        if not status.reachable:
            why = self._where((status.error or "not reachable").removeprefix("health: ").removeprefix(
                "router health: "), endpoint)
            count, since, _ = self.failed_looks.get(endpoint, (0, now, why))
            self.failed_looks[endpoint] = (count + 1, since, why)
            if endpoint not in self.answered_ever:
                self._refusing(endpoint, why, now)
            elif count + 1 >= DOWN_AFTER_CHECKS:
                self._set(endpoint, "down", f"{why} ({DOWN_AFTER_CHECKS} checks in a row)", since)
            return
        self.failed_looks.pop(endpoint, None)
        self._answering(endpoint)
        if status.loading:
            self._set(endpoint, "loading", status.loading_message or "its /health says it is not ready", now)
        elif (status.health_status or 0) >= 400:
            self._set(endpoint, "down", status.error or f"health: HTTP {status.health_status}", now)
        else:
            self._up(endpoint, now)

    def answered(self, endpoint: str) -> None:
        """A request's connection to `endpoint` was taken: its port is open."""
        self._answering(endpoint)
        told = self.state.get(endpoint)
        if told is None or told.state == "down" and endpoint not in self.failed_looks:
            self._up(endpoint, self.clock.now())

    def refused(self, endpoint: str) -> float | None:
        """A request's connection to `endpoint` was refused (its port is closed). Returns how long it has refused
        once it is down for having never answered (a request then gets told so at once); None while it is not."""
        now = self.clock.now()
        if endpoint in self.answered_ever:
            return None  # seen answering: a restart, judged by the monitor's looks
        since = self._refusing(endpoint, self._where("connection refused", endpoint), now)
        return now - since if now - since >= self.down_after_s else None

    def down_at(self, endpoint: str) -> float | None:
        """When an endpoint that never answered and refuses now is down; None when that rule does not hold it."""
        if endpoint in self.answered_ever or endpoint not in self.refused_since:
            return None
        return self.refused_since[endpoint] + self.down_after_s

    def wedged(self, endpoint: str, reason: str) -> None:
        self.wedged_why[endpoint] = reason
        told = self.state.get(endpoint)
        if told is None or told.state == "up":
            self._set(endpoint, "wedged", reason, self.clock.now())

    def moves_again(self, endpoint: str) -> None:
        if self.wedged_why.pop(endpoint, None) is not None:
            told = self.state.get(endpoint)
            if told is not None and told.state == "wedged":
                self._set(endpoint, "up", "", self.clock.now())

    # ---- the rules --------------------------------------------------------------------------------------
    def _answering(self, endpoint: str) -> None:
        self.answered_ever.add(endpoint)
        self.refused_since.pop(endpoint, None)

    def _refusing(self, endpoint: str, why: str, now: float) -> float:
        """A port that never answered refuses: down once it has for `down_after_s`. Returns since when."""
        since = self.refused_since.setdefault(endpoint, now)
        if now - since >= self.down_after_s:
            self._set(endpoint, "down", f"{why}; it has never answered", since)
        return since

    def _up(self, endpoint: str, now: float) -> None:
        if endpoint in self.wedged_why:
            self._set(endpoint, "wedged", self.wedged_why[endpoint], now)
        else:
            self._set(endpoint, "up", "", now)

    def _where(self, problem: str, endpoint: str) -> str:
        where = address(self.base_urls.get(endpoint, ""))
        return f"{problem} at {where}" if where and where not in problem else problem

    def _set(self, endpoint: str, state: EndpointStateName, why: str, since: float) -> None:
        told = self.state.get(endpoint)
        if told is not None and told.state == state:
            return  # told once, with the words it began with
        event = ev.EndpointState(self.clock.now(), endpoint, state, why, since)
        self.state[endpoint] = event
        self.emit(event)
