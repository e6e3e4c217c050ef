"""The gateway: an OpenAI- and Anthropic-compatible front door that a run serves, so that harnesses the console
did not write (Claude Code, Codex CLI, opencode, aider, scripts on the SDKs) are governed as agents of the run.

`server.py` is the ASGI app (the checks at its entry, routing, pass-through), `exchange.py` one governed
request, `sse.py` the frames relayed, `edge.py` what both share; `paths.py` the one path rule and `outbound.py` the
one send to a client; `apis.py` knows the three APIs, `identity.py` names sessions and harnesses, and `serve.py`
runs the app under uvicorn in the run's own loop. The run's side of a session (its slot) is `engine/sessions.py`;
its requests' life is the attempt owner's, `engine/attempt.py`.
"""

from cerevisor_tui.gateway.serve import GatewayServer, serve_gateway
from cerevisor_tui.gateway.server import Gateway, GatewayError

__all__ = ["Gateway", "GatewayError", "GatewayServer", "serve_gateway"]
