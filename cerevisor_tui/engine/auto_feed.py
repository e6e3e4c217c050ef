"""What Auto's controllers (engine/auto.py) are fed while a run goes on: each endpoint's signals, the run's own
figures with the server's last sample, once a tick; what a controller decides is applied by the caps
(engine/caps.py)."""

from __future__ import annotations

from collections.abc import Mapping

from cerevisor_tui.config.models import EndpointConfig
from cerevisor_tui.engine.attempt import TurnFigures
from cerevisor_tui.engine.auto import Signals
from cerevisor_tui.engine.caps import Caps
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.monitor import ServerMonitor
from cerevisor_tui.engine.roster import Roster, RunLife
from cerevisor_tui.kinds import FINAL


class AutoFeed:
    """Handed its ports: the caps (the controllers, the scheduler), the roster and the run's life, each
    endpoint's measured figures, the server monitor, and the clock it ticks on."""

    def __init__(self, caps: Caps, roster: Roster, life: RunLife, figures: Mapping[str, TurnFigures],
                 monitor: ServerMonitor, endpoints: Mapping[str, EndpointConfig], tick_s: float,
                 clock: Clock) -> None:
        self.caps = caps
        self.roster = roster
        self.life = life
        self.figures = figures
        self.monitor = monitor
        self.endpoints = endpoints
        self.tick_s = min(1.0, max(0.02, tick_s))
        self.clock = clock

    async def run(self, endpoint: str) -> None:
        """Feed the endpoint's controller while the run goes on; it acts only in auto mode."""
        ctl = self.caps.auto[endpoint]
        while True:
            await self.clock.sleep(self.tick_s)
            if self.caps.scheduler.mode == "auto" and not self.life.stopping:
                change = ctl.update(self.signals(endpoint))
                if change is not None:
                    self.caps.apply(endpoint, change)

    def signals(self, endpoint: str) -> Signals:
        """What the controller of `endpoint` sees now: the run's own figures and the server's last sample."""
        scheduler = self.caps.scheduler
        states = self.roster.on.get(endpoint, [])
        sample = self.monitor.last_sample.get(endpoint)
        figures = self.figures[endpoint]
        ttfts = sorted(figures.ttfts)
        watched = self.endpoints[endpoint].kind != "hosted"
        kv_tokens = sample.kv_cache_tokens if sample is not None else None
        if not kv_tokens and (load := self.monitor.load.get(endpoint)) is not None:
            kv_tokens = load.kv_capacity_tokens
        return Signals(
            t=self.clock.now(), tokens=sum(st.tokens for st in states),
            running=scheduler.running_by_endpoint.get(endpoint, 0), queued=scheduler.queued_for(endpoint),
            cold=sum(1 for st in states if st.started_at is not None and st.ttft_s is None and st.status not in FINAL),
            errors=figures.rejections, ttft_p50=ttfts[len(ttfts) // 2] if ttfts else None,
            sample=self.monitor.samples[endpoint],
            server_ok=(sample.healthy if sample is not None else False) if watched else None,
            waiting=sample.waiting if sample else None, server_running=sample.running if sample else None,
            kv_usage=sample.kv_cache_usage if sample else None, preemptions=sample.preemptions if sample else None,
            prefix_hit_rate=sample.prefix_hit_rate if sample else None, kv_tokens=kv_tokens,
            slots=sample.slots_total if sample else None,
            context_tokens=projected_context(self.roster, self.figures, self.life, endpoint),
            turn_tokens=figures.answer_length(), rates=tuple(figures.rates),
            decode_gaps=self.monitor.decode_gaps.get(endpoint),
        )


def projected_context(roster: Roster, figures_of: Mapping[str, TurnFigures], life: RunLife,
                      endpoint: str) -> float | None:
    """The mean full length, in tokens, of the conversations of `endpoint`'s agents still to run or running
    in the current wave: what each has sent so far by the server's own count, plus its turns to come (at
    the measured tokens per character) and their answers (at the measured answer length)."""
    figures = figures_of[endpoint]
    per_char = figures.tokens_per_char()
    measured = figures.answer_length()
    total, count = 0.0, 0
    for st in roster.on.get(endpoint, ()):
        if st.status in FINAL or st.status == "released" or (st.wave != life.wave and st.status == "pending"):
            continue
        if st.script is not None:  # a scripted agent knows its whole length (a replay's: its last prompt and answer)
            total += st.script.context_tokens()
            count += 1
            continue
        cfg = st.config
        answer = measured if measured is not None else cfg.max_tokens
        texts = [cfg.prompt, *cfg.turns]
        base: float  # tokens sent so far: the server's count, or the system prompt's estimated
        if st.turns_done:
            base = st.last_prompt_tokens + st.last_completion_tokens
            rest = texts[st.turns_done:]
        else:
            base, rest = len(cfg.system) * per_char, texts
        total += base + sum(map(len, rest)) * per_char + answer * len(rest)
        count += 1
    return total / count if count else None
