"""The fixed sets of names the layers share, each defined once: run modes, agent statuses, stream item kinds.

Dependency-free (the standard library's `typing` only), so `cli.py` can offer the modes without importing
pydantic or the engine. Modes and statuses are `Literal` types, so their values stay the very strings the
config, the journal and the report hold; a typo is a type error, and a new name shows every place to update.
"""

from __future__ import annotations

from typing import Final, Literal, NewType, get_args

Mode = Literal["sequential", "parallel", "auto"]
"""How many agents run at once: one, up to the cap, or as many as each endpoint's server sustains."""
MODES: Final[tuple[Mode, ...]] = get_args(Mode)

ActiveStatus = Literal["waiting", "prefill", "streaming", "stalling", "retrying", "tool", "approval", "idle",
                       "wedged"]
"""The statuses of an agent holding a running slot ("waiting": a local endpoint still loading; "tool": one of
its MCP tool calls is executing; "approval": a tool call waits for the operator, shown as "needs approval";
"idle": a gateway session between its requests, its harness thinking or running tools, its slot kept;
"wedged": its attempt was killed, or waits, on a server that is wedged, engine/wedge.py)."""
FinalStatus = Literal["completed", "failed", "killed", "skipped", "cancelled"]
"""The statuses an agent ends in (AgentFinished.status, the report's `status`)."""
Status = Literal["pending", "queued", ActiveStatus, "released", FinalStatus]
"""An agent's status, as the engine keeps it and its events tell it ("released": a gateway session that gave
its slot back after `release_after_s` without a request; its next request waits for one again)."""
STATUSES: Final[tuple[Status, ...]] = get_args(Status)
FINAL_STATUSES: Final[tuple[FinalStatus, ...]] = get_args(FinalStatus)  # in the report's order
FINAL: Final[frozenset[str]] = frozenset(FINAL_STATUSES)
ACTIVE: Final[frozenset[str]] = frozenset(get_args(ActiveStatus))
FORGOTTEN: Final = "forgotten after "
"""How the reason of a gateway session the run forgot begins (idle for [gateway] forget_after_s: its row ended, and
its name may open a new session, which the report lists beside it)."""

WedgeRule = Literal["frozen", "hung", "preempt_loop"]
"""Which wedge a server is in (engine/wedge.py): nothing moves at all behind a /health of 200; requests run
and nothing is generated server-wide (a hung kernel); a prompt preempted again and again before its first token."""

EndpointStateName = Literal["up", "loading", "down", "wedged"]
"""What an endpoint is, as the header and the load pane say it (engine/endpoint_state.py): answering and ready; saying
it is loading; refusing (or failing its health check) past the grace; answering while nothing in it moves."""

# What a chat stream yields: (kind, payload). Plain ints at run time: they are compared once a token, and
# the stream worker's pipe (`marshal`) carries them, which takes no IntEnum.
StreamItemKind = NewType("StreamItemKind", int)
KEEPALIVE: Final = StreamItemKind(0)  # payload None: an SSE comment or a chunk with nothing in it
DELTA: Final = StreamItemKind(1)  # payload (content, reasoning, tool_text, chunks): `chunks` consecutive chunks' text
USAGE: Final = StreamItemKind(2)  # payload (prompt_tokens, completion_tokens)
FINISH: Final = StreamItemKind(3)  # payload finish_reason
# the stream worker's own, on its pipe only (endpoints/worker.py)
BYTES: Final = StreamItemKind(4)  # payload None: bytes arrived (a partial line) that made no item yet
END: Final = StreamItemKind(5)  # payload None: the stream ended cleanly
ERROR: Final = StreamItemKind(6)  # payload (error class name, problem, status, retry_after_s, retryable)
# after the worker's own, so their numbers stay: a chunk's tool_calls pieces, for the agent loop to put together
TOOL_CALLS: Final = StreamItemKind(7)  # payload ((index, id, name, arguments), ...): each piece, None where absent
TIMINGS: Final = StreamItemKind(8)  # payload (prompt_ms, predicted_per_token_ms): llama.cpp's `timings`, None where absent
# llama-server's prompt_progress (asked with "return_progress"): a sign of life of the prefill, never a token
PROGRESS: Final = StreamItemKind(9)  # payload (total, cache, processed, time_ms): prompt tokens, as the server counts
