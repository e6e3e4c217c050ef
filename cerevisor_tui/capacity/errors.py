"""The capacity layer's errors: one operator-facing message each, never a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class CapacityError(Exception):
    """A model, GPU or setting the estimate cannot use, explained for the operator."""


class UnknownPresetError(CapacityError):
    """A model or GPU name that is not a preset; the message lists the closest names."""

    def __init__(self, kind: str, name: str, known: Iterable[str]) -> None:
        known = sorted(known)
        close = difflib.get_close_matches(name.lower(), known, n=4, cutoff=0.4)
        hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(known)}"
        super().__init__(f"unknown {kind} preset {name!r}: {hint} (see `cerevisor-tui estimate --list`)")
        self.kind = kind
        self.name = name
        self.close_names = close


class ModelConfigError(CapacityError):
    """A Hugging Face config.json that lacks or garbles what the KV estimate needs."""
