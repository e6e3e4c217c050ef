"""A request's prefill as its server tells it (llama-server's prompt_progress): how far it is, how fast it goes,
and when it last moved, for the stall watchdog (contract/deadlines.py: prefill_look) and the console; and, for a
server that tells nothing of it, an estimate from the endpoint's measured prefill rate (estimate_look)."""

from __future__ import annotations

from dataclasses import dataclass

from cerevisor_tui.contract import events as ev

PREFILL_EVENT_EVERY_S = 1.0
"""A PrefillProgress is told at most this often per attempt (and at the prefill's start and end): llama-server
sends one per batch, many a second on a fast box."""


@dataclass(slots=True)
class Prefill:
    """The latest prompt_progress of an attempt, and when its `processed` last passed its high-water mark on our
    clock (`processed` is that mark)."""

    total: int = 0
    cache: int = 0
    processed: int = 0
    time_ms: int = 0
    advanced_at: float = 0.0
    told_at: float = -1e18  # when the console was last told (PrefillProgress)

    def see(self, total: int, cache: int, processed: int, time_ms: int, now: float) -> bool:
        """Take one prompt_progress; whether the console should be told of it now."""
        # progress only past the high-water mark: a `processed` that wobbles (10, 11, 10, 11) or goes back (a
        # prefill started again after a preemption) shows no new work until it passes what was already done
        moved = processed > self.processed or not self.advanced_at
        self.total, self.cache, self.time_ms = total, cache, time_ms
        if moved:
            self.processed = processed
            self.advanced_at = now
        if moved and (now - self.told_at >= PREFILL_EVENT_EVERY_S or processed >= total or processed == cache):
            self.told_at = now
            return True
        return False

    @property
    def rate_tok_s(self) -> float | None:
        """Prompt tokens computed per second, by the server's own clock; None before it has measured any."""
        computed = self.processed - self.cache
        if computed <= 0 or self.time_ms <= 0:
            return None
        return computed * 1000.0 / self.time_ms

    def eta_s(self, now: float) -> float | None:
        """Seconds until the prefill ends at its rate, from now; None without a rate."""
        rate = self.rate_tok_s
        if rate is None:
            return None
        return max(0.0, self.advanced_at + (self.total - self.processed) / rate - now)

    def event(self, now: float, agent: str, attempt: int) -> ev.PrefillProgress:
        rate = self.rate_tok_s
        eta = self.eta_s(now)
        return ev.PrefillProgress(now, agent, attempt, self.total, self.cache, self.processed,
                                  round(rate, 1) if rate is not None else None,
                                  round(eta, 1) if eta is not None else None)


@dataclass(slots=True)
class PrefillEstimate:
    """A prompt's prefill as the endpoint's measured rate projects it: `total` prompt tokens (from its characters),
    `cached` of them expected from the prefix cache (the conversation so far), from `sent_at`."""

    total: int
    cached: int
    rate_tok_s: float
    sent_at: float
    looked_at: float = 0.0  # the watchdog's last look at the server's life for it

    def event(self, now: float, agent: str, attempt: int) -> ev.PrefillProgress:
        return ev.PrefillProgress(now, agent, attempt, self.total, self.cached, self.cached, round(self.rate_tok_s, 1),
                                  round((self.total - self.cached) / self.rate_tok_s, 1), estimated=True)
