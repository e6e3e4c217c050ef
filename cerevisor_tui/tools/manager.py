"""The run's MCP tool servers, spoken to with the official `mcp` SDK (client side): each server an agent
uses is started once when the run opens, shared by its agents, and ended with the run.

A stdio server is its own process (the SDK starts it in a session of its own and, on the way out, closes
its stdin, then terminates its process tree); it gets only the variables its config names, over the SDK's
safe set (PATH, HOME, ...). Should the run die at once (SIGKILL), the server's stdin closes with it and it
ends. A server that fails to start, or exits later, is a problem of its own agents: the run goes on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import anyio

from cerevisor_tui.config.models import AgentConfig, McpServerConfig
from cerevisor_tui.tools.schemas import function_name, openai_tool


class ToolSetupError(Exception):
    """An agent's tools cannot be offered (a server did not start, a tool it names does not exist)."""


class ToolCallError(Exception):
    """A call did not reach a result: the server is gone, or the SDK refused; the message is for the model."""


@dataclass(eq=False)
class ToolServer:
    """One configured server, once the run has tried to start it."""

    config: McpServerConfig
    session: Any = None  # mcp.ClientSession, once started
    tools: dict[str, Any] = field(default_factory=dict)  # name -> mcp Tool
    problem: str = ""  # why it cannot be used now ("" while it can)
    ready: anyio.Event | None = None  # made when the run opens (in its event loop); set once started, or failed

    @property
    def name(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class Toolset:
    """What one agent may call: the OpenAI `tools` it is offered and, by function name, the server and tool."""

    tools: list[dict[str, Any]]
    names: dict[str, tuple[str, str]]


class McpServers:
    """The run's tool servers: `open` starts those that `used` names (in parallel), `toolset` gives an agent
    its tools, `call` runs one. `log_dir`: where each stdio server's stderr goes (`mcp-<name>.log`)."""

    def __init__(self, configs: Iterable[McpServerConfig], used: set[str], log_dir: str = "") -> None:
        self.servers = {c.name: ToolServer(c) for c in configs if c.name in used}
        self.log_dir = log_dir

    def __bool__(self) -> bool:
        return bool(self.servers)

    async def open(self, stack: AsyncExitStack) -> None:
        """Start every server, all at once, each in a task of its own that holds its session open until
        `stack` closes; returns at once (the run begins while they start: `toolset` waits for those an
        agent needs). Never raises for a server: its `problem` says why."""
        if not self.servers:
            return
        group = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(group.cancel_scope.cancel)  # runs first on the way out: every session closes
        for server in self.servers.values():
            server.ready = anyio.Event()
            group.start_soon(self._serve, server)

    async def _serve(self, server: ToolServer) -> None:
        cfg = server.config
        started = False
        try:
            from mcp import ClientSession

            # one scope over the session's whole life (the SDK's task groups live inside it): its deadline
            # bounds the start and is lifted once the tools are listed
            with anyio.CancelScope(deadline=anyio.current_time() + cfg.start_timeout_s) as scope:
                async with AsyncExitStack() as stack:
                    read, write = await stack.enter_async_context(self._transport(cfg, stack))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    listed = await session.list_tools()
                    scope.deadline = math.inf
                    server.session = session
                    server.tools = {tool.name: tool for tool in listed.tools}
                    started = True
                    if server.ready is not None:
                        server.ready.set()
                    await anyio.sleep_forever()
            if scope.cancelled_caught and not started:
                server.problem = (f"MCP server {cfg.name} did not start within {cfg.start_timeout_s:g} s "
                                  "(start_timeout_s)")
        except Exception as exc:  # noqa: BLE001 - a server that fails is its agents' problem, never the run's
            what = "stopped" if started else "did not start"
            server.problem = f"MCP server {cfg.name} {what}: {_reason(exc)}"
        finally:
            server.session = None
            if server.ready is not None:
                server.ready.set()

    def _transport(self, cfg: McpServerConfig, stack: AsyncExitStack) -> Any:
        if cfg.url:
            from mcp.client.streamable_http import streamable_http_client

            return _pair(streamable_http_client(cfg.url))
        from mcp.client.stdio import StdioServerParameters, stdio_client

        env = {name: os.environ[name] for name in cfg.env if name in os.environ}
        params = StdioServerParameters(command=cfg.command, args=list(cfg.args), env=env, cwd=cfg.cwd or None)
        return stdio_client(params, errlog=self._errlog(cfg, stack))

    def _errlog(self, cfg: McpServerConfig, stack: AsyncExitStack) -> TextIO:
        """The server's stderr: a log file in the run directory, never the run's own terminal."""
        if self.log_dir:
            try:
                Path(self.log_dir).mkdir(parents=True, exist_ok=True)
                return stack.enter_context(open(Path(self.log_dir) / f"mcp-{cfg.name}.log", "a", encoding="utf-8"))
            except OSError:
                pass
        return stack.enter_context(open(os.devnull, "w", encoding="utf-8"))

    async def toolset(self, agent: AgentConfig) -> Toolset:
        """The tools `agent` lists, offered as OpenAI tools (a tool its server denies is not offered), once
        their servers have started; raises ToolSetupError, in the operator's words, when one cannot be."""
        from cerevisor_tui.tools.permissions import rule_for

        tools: list[dict[str, Any]] = []
        names: dict[str, tuple[str, str]] = {}
        for entry in agent.tools:
            server_name, _, tool_name = entry.partition(".")
            server = self.servers[server_name]
            if server.ready is not None:
                await server.ready.wait()
            if server.problem or server.session is None:
                raise ToolSetupError(server.problem or f"MCP server {server_name} is not running")
            if tool_name and tool_name not in server.tools:
                listed = ", ".join(sorted(server.tools)) or "none"
                raise ToolSetupError(f"MCP server {server_name} has no tool {tool_name!r} (it has: {listed})")
            for tool in ([server.tools[tool_name]] if tool_name else server.tools.values()):
                if rule_for(server.config, tool.name) == "deny":
                    continue
                fname = function_name(server_name, tool.name)
                if fname in names:
                    continue
                names[fname] = (server_name, tool.name)
                tools.append(openai_tool(fname, tool.description, tool.input_schema))
        return Toolset(tools, names)

    async def call(self, server_name: str, tool: str, arguments: dict[str, Any]) -> tuple[Any, bool]:
        """Run one call; returns (the MCP result, whether the server said it is an error). Raises
        ToolCallError when no result came (the server is gone or broke the protocol)."""
        server = self.servers[server_name]
        if server.session is None:
            raise ToolCallError(server.problem or f"MCP server {server_name} is not running")
        try:
            result = await server.session.call_tool(tool, arguments)
        except Exception as exc:  # noqa: BLE001 - whatever the SDK raises is this call's error, told to the model
            raise ToolCallError(f"MCP server {server_name}: {_reason(exc)}") from None
        return result, bool(getattr(result, "is_error", False))


class _pair:
    """A streamable HTTP client's context (read, write, ...) as the (read, write) stdio gives."""

    def __init__(self, cm: Any) -> None:
        self.cm = cm

    async def __aenter__(self) -> tuple[Any, Any]:
        streams = await self.cm.__aenter__()
        return streams[0], streams[1]

    async def __aexit__(self, *exc: Any) -> Any:
        return await self.cm.__aexit__(*exc)


def _reason(exc: BaseException) -> str:
    """The innermost error of a task group, in one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = " ".join(str(exc).split())
    if isinstance(exc, FileNotFoundError):
        text = f"command not found ({exc.filename or text})"
    return text or type(exc).__name__
