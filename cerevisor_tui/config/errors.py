"""The config error: one message that names the file, the key and the problem."""

from __future__ import annotations


class ConfigError(Exception):
    """A config file (or a flag) that cannot be used, explained for the operator."""

    def __init__(self, problem: str, *, file: str | None = None, key: str | None = None) -> None:
        self.file = file
        self.key = key
        self.problem = problem
        where = ": ".join(part for part in (file, key) if part)
        super().__init__(f"{where}: {problem}" if where else problem)
