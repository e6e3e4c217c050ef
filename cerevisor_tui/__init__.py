"""cerevisor-tui: a terminal operator console for many AI agents on OpenAI-compatible servers."""

import sys

__version__ = "0.1.0"

# httpx imports its own command line (click, rich, pygments) whenever those are installed, as Textual's rich and
# pygments are: ~0.09 s of CPU, a fifth of what every run, simulator, gateway and stream worker imports, for an
# `httpx.main` nothing here calls. Without that module httpx puts a stub in its place. tests/test_startup.py checks.
sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]  # None: "no such module", to import
