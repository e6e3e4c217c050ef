"""What a server says in numbers, read as absent when it cannot be true: non-finite, negative, or beyond a bound no
real server reaches. A `/metrics` line of `1e308` or a `prompt_progress.total` of `1e999` is a lie or a bug, and
taken as such it would overflow the figures built on it (the run's Auto, wedge and load rules) and end the run;
read as absent, the rules go on as for a server that does not tell."""

from __future__ import annotations

import math
from typing import Any

MAX_METRIC = 1e15
"""The largest metric value believed: a counter of a billion tokens a second for ten days is 1e15."""
MAX_PROMPT_TOKENS = 1 << 27
"""The largest prompt believed (134M tokens, ten times the longest context a model serves today)."""
MAX_PREFILL_MS = 1e9
"""The longest prefill time believed (11 days)."""


def metric(value: object) -> float | None:
    """A metric sample's value, or None when it cannot be a count, a gauge or a ratio a server keeps."""
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0 <= value <= MAX_METRIC:
        return None
    return float(value)


def prompt_progress(total: Any, cache: Any, processed: Any, time_ms: Any) -> tuple[int, int, int, int] | None:
    """llama-server's prompt_progress as (total, cache, processed, time_ms), or None when it cannot be one: a value
    not a finite number, negative or past its bound, or cached or processed tokens beyond the prompt."""
    for value, bound in ((total, MAX_PROMPT_TOKENS), (cache, MAX_PROMPT_TOKENS), (processed, MAX_PROMPT_TOKENS),
                         (time_ms, MAX_PREFILL_MS)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= bound:
            return None  # (a NaN fails the comparison too)
    if cache > total or processed > total:
        return None
    return int(total), int(cache), int(processed), int(time_ms)
