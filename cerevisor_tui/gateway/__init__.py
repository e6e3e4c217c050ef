"""The gateway: an OpenAI- and Anthropic-compatible front door that a run serves, so that harnesses the console
did not write (Claude Code, Codex CLI, opencode, aider, scripts on the SDKs) are governed as agents of the run.

`apis.py` knows the three APIs, `identity.py` names sessions and harnesses, `server.py` is the ASGI app, and
`serve.py` runs it under uvicorn in the run's own loop. The run's side of a session (its slot, its attempts,
their watchdog) is `engine/sessions.py`.
"""

from cerevisor_tui.gateway.serve import GatewayServer, serve_gateway
from cerevisor_tui.gateway.server import Gateway, GatewayError

__all__ = ["Gateway", "GatewayError", "GatewayServer", "serve_gateway"]
