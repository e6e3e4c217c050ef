"""cerevisor-tui: a terminal operator console for many AI agents on OpenAI-compatible servers."""

__version__ = "0.1.0"
