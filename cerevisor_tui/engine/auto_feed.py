"""What Auto's controllers (engine/auto.py) are fed while a run goes on: each endpoint's signals, the engine's
own figures with the server's last sample, once a tick; and what a controller decides, applied to the
scheduler's live cap and told as ConcurrencyChanged."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.auto import Change, Signals
from cerevisor_tui.kinds import FINAL

if TYPE_CHECKING:
    from cerevisor_tui.engine.engine import Engine


class AutoFeed:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def run(self, endpoint: str) -> None:
        """Feed the endpoint's controller while the run goes on; it acts only in auto mode."""
        e = self.engine
        ctl = e.auto[endpoint]
        tick = min(1.0, max(0.02, e.config.run.metrics_interval_s / 2))
        while True:
            await anyio.sleep(tick)
            if e.scheduler.mode == "auto" and not e.stopping:
                change = ctl.update(self.signals(endpoint))
                if change is not None:
                    self.apply(endpoint, change)

    def signals(self, endpoint: str) -> Signals:
        """What the controller of `endpoint` sees now: the engine's own figures and the server's last sample."""
        e = self.engine
        states = e.agents_on.get(endpoint, [])
        sample = e.last_sample.get(endpoint)
        figures = e.figures[endpoint]
        ttfts = sorted(figures.ttfts)
        watched = e.endpoints[endpoint].kind != "hosted"
        kv_tokens = sample.kv_cache_tokens if sample is not None else None
        if not kv_tokens and (load := e.load.get(endpoint)) is not None:
            kv_tokens = load.kv_capacity_tokens
        return Signals(
            t=time.monotonic(), tokens=sum(st.tokens for st in states),
            running=e.scheduler.running_by_endpoint.get(endpoint, 0), queued=e.scheduler.queued_for(endpoint),
            cold=sum(1 for st in states if st.started_at is not None and st.ttft_s is None and st.status not in FINAL),
            errors=figures.rejections, ttft_p50=ttfts[len(ttfts) // 2] if ttfts else None,
            sample=e.monitor.samples[endpoint],
            server_ok=(sample.healthy if sample is not None else False) if watched else None,
            waiting=sample.waiting if sample else None, server_running=sample.running if sample else None,
            kv_usage=sample.kv_cache_usage if sample else None, preemptions=sample.preemptions if sample else None,
            prefix_hit_rate=sample.prefix_hit_rate if sample else None, kv_tokens=kv_tokens,
            slots=sample.slots_total if sample else None, context_tokens=self.projected_context(endpoint),
            turn_tokens=figures.answer_length(),
        )

    def projected_context(self, endpoint: str) -> float | None:
        """The mean full length, in tokens, of the conversations of `endpoint`'s agents still to run or running
        in the current wave: what each has sent so far by the server's own count, plus its turns to come (at
        the measured tokens per character) and their answers (at the measured answer length)."""
        e = self.engine
        figures = e.figures[endpoint]
        per_char = figures.tokens_per_char()
        measured = figures.answer_length()
        total, count = 0.0, 0
        for st in e.agents_on.get(endpoint, ()):
            if st.status in FINAL or st.status == "released" or (st.wave != e.wave and st.status == "pending"):
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

    def apply(self, endpoint: str, change: Change) -> None:
        e = self.engine
        s = e.scheduler
        s.set_endpoint_cap(endpoint, change.cap)
        e.emit(ev.ConcurrencyChanged(time.monotonic(), s.max_concurrency, change.cap, s.paused,
                                     endpoint=endpoint, reason=change.reason, ceiling=e.auto_ceiling,
                                     total_cap=s.effective_cap, by="auto"))
        e.refresh_load(endpoint)
