"""The console's probe of one of the run's endpoints: a sweep run in the run's own task group, on its open
connections, told through ProbeStarted, ProbeProgress and ProbeFinished. New admissions wait while it
measures (running agents go on), so it measures the server rather than the run's own growing load."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import anyio

from cerevisor_tui.config.models import EndpointConfig
from cerevisor_tui.contract import events as ev
from cerevisor_tui.endpoints.errors import EndpointError
from cerevisor_tui.engine.caps import Caps
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.connections import Connections
from cerevisor_tui.engine.roster import Roster, RunLife


class ConsoleProbes:
    """The run's probes, one at a time per endpoint. Handed its ports: the run's open connections, the roster
    (the endpoint's agents shape the probe) and life (its task group, whether it stops), the caps (admissions
    held while it measures), emit and the clock."""

    def __init__(self, connections: Connections, endpoints: Mapping[str, EndpointConfig], roster: Roster,
                 life: RunLife, caps: Caps, emit: Callable[[ev.Event], None], clock: Clock) -> None:
        self.connections = connections
        self.endpoints = endpoints
        self.roster = roster
        self.life = life
        self.caps = caps
        self.emit = emit
        self.clock = clock
        self.running: dict[str, anyio.CancelScope] = {}  # endpoint -> its running probe

    async def probe(self, endpoint: str, *, on_progress: Callable[[str], None] | None = None,
                    on_level: Callable[[Any], None] | None = None, max_concurrency: int | None = None) -> Any:
        """`cerevisor-tui probe` against one of the run's endpoints, on the run's own client; returns a
        ProbeResult. Only while the run is open. Raises EndpointError when the endpoint is unusable."""
        from cerevisor_tui.endpoints.probe import ProbeSettings, probe_conversations

        connections = self.connections
        if endpoint not in connections.clients:
            raise EndpointError(endpoint, "the run is not open: probe it with `cerevisor-tui probe URL`")
        ep = self.endpoints[endpoint]
        settings = ProbeSettings(max_concurrency=max_concurrency or max(2, ep.max_concurrency),
                                 extra_body=ep.extra_body)
        # shaped like this endpoint's agents (their prompts, turns, growing conversations); none: single requests
        agents = [st.config for st in self.roster.on.get(endpoint, ())]
        return await probe_conversations(
            connections.clients[endpoint], connections.base_urls[endpoint], agents,
            model=connections.models.get(endpoint) or None,
            settings=settings, on_progress=on_progress, on_level=on_level, endpoint=endpoint,
            save=ep.kind != "simulated")  # the built-in simulator's port is new every run: nothing to remember

    def start(self, endpoint: str, max_concurrency: int | None = None) -> None:
        """Sweep `endpoint` in the background; everything it finds is told through Probe* events."""
        bound = max_concurrency or max(2, self.endpoints[endpoint].max_concurrency)
        if endpoint in self.running:
            return  # one at a time per endpoint: the one running reports
        self.emit(ev.ProbeStarted(self.clock.now(), endpoint, bound, len(self.roster.on.get(endpoint, ()))))
        background = self.life.background
        if background is None or self.life.stopping or endpoint not in self.connections.clients:
            self.emit(ev.ProbeFinished(self.clock.now(), endpoint, error=(
                f"The run is not open: probe {endpoint} with `cerevisor-tui probe URL`.")))
            return
        scope = self.running[endpoint] = anyio.CancelScope()
        background.start_soon(self._task, endpoint, bound, scope)

    def cancel(self, endpoint: str) -> bool:
        """Cancel the endpoint's running probe (its requests are closed); returns whether one was running."""
        scope = self.running.get(endpoint)
        if scope is None:
            return False
        scope.cancel()
        return True

    async def _task(self, endpoint: str, bound: int, scope: anyio.CancelScope) -> None:
        scheduler, emit = self.caps.scheduler, self.emit
        held = not scheduler.paused
        if held:
            self.caps.pause()
        result: ev.ProbeSummary | None = None
        error = ""

        def progress(line: str) -> None:
            emit(ev.ProbeProgress(self.clock.now(), endpoint, line=line))

        def level(found: ev.ProbeLevelSummary) -> None:
            emit(ev.ProbeProgress(self.clock.now(), endpoint, level=found))

        try:
            with scope:
                found = await self.probe(endpoint, on_progress=progress, on_level=level, max_concurrency=bound)
                result = found.summary()
        except Exception as exc:  # noqa: BLE001 - a probe that fails says why; the run goes on
            error = self._failure(exc)
        finally:
            self.running.pop(endpoint, None)
            if held and scheduler.paused and not self.life.stopping:
                self.caps.pause(False)
            now = self.clock.now()
            if result is not None:
                emit(ev.ProbeFinished(now, endpoint, result=result))
            elif error:
                emit(ev.ProbeFinished(now, endpoint, error=error))
            elif scope.cancelled_caught:
                emit(ev.ProbeFinished(now, endpoint, cancelled=True))
            else:  # the run's own task group ended it
                emit(ev.ProbeFinished(now, endpoint, error=self._failure(None)))

    def _failure(self, error: BaseException | None) -> str:
        """What went wrong, in the operator's words (the innermost error of a task group)."""
        while isinstance(error, BaseExceptionGroup) and error.exceptions:
            error = error.exceptions[0]
        closed = isinstance(error, RuntimeError) and "closed" in str(error)  # httpx: the run closed its client
        if error is None or closed or self.life.stopping:
            return ("The run ended while probing, and its connections with it. "
                    "Probe the server alone with `cerevisor-tui probe URL`.")
        return str(error) or type(error).__name__
