"""The run's MCP tool servers, spoken to with the official `mcp` SDK (client side): each server an agent
uses is started once when the run opens, shared by its agents, and ended with the run.

A stdio server is its own process (tools/stdio.py starts it in a session of its own and, on the way out,
closes its stdin, then terminates its process tree; it reads each message under a bound, and puts the
server's stderr through the run's scrubber into `mcp-<name>.log`); it gets only the variables its config
names, over the SDK's safe set (PATH, HOME, ...). Should the run die at once (SIGKILL), the server's stdin
closes with it and it ends. A server that fails to start, or exits later, is a problem of its own agents: the
run goes on; what is said about it names its exit status and its log.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from cerevisor_tui.config.models import AgentConfig, McpServerConfig
from cerevisor_tui.config.secrets import Scrubber
from cerevisor_tui.tools.schemas import function_name, openai_tool
from cerevisor_tui.tools.stdio import ServerLog, StdioServer, message_max_bytes


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
    process: StdioServer | None = None  # a stdio server's process, once started

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
    its tools, `call` runs one. `log_dir`: where each stdio server's stderr goes (`mcp-<name>.log`), through
    `scrub`."""

    def __init__(self, configs: Iterable[McpServerConfig], used: set[str], log_dir: str = "",
                 scrub: Scrubber | None = None) -> None:
        self.servers = {c.name: ToolServer(c) for c in configs if c.name in used}
        self.log_dir = log_dir
        self.scrub = scrub or Scrubber()

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
            group.start_soon(self._start_deadline, server)

    async def _start_deadline(self, server: ToolServer) -> None:
        """Tells a server's agents that it did not start, at its start_timeout_s: not once its process has been
        wound down, which takes seconds more (the grace before its process group is terminated)."""
        assert server.ready is not None
        with anyio.move_on_after(server.config.start_timeout_s):
            await server.ready.wait()
            return
        server.problem = server.problem or self._timeout_text(server.config)
        server.ready.set()

    @staticmethod
    def _timeout_text(cfg: McpServerConfig) -> str:
        return f"MCP server {cfg.name} did not start within {cfg.start_timeout_s:g} s (start_timeout_s)"

    async def _serve(self, server: ToolServer) -> None:
        cfg = server.config
        started = False
        try:
            from mcp import ClientSession

            # one scope over the session's whole life (the SDK's task groups live inside it): its deadline
            # bounds the start and is lifted once the tools are listed
            with anyio.CancelScope(deadline=anyio.current_time() + cfg.start_timeout_s) as scope:
                async with AsyncExitStack() as stack:
                    read, write = await stack.enter_async_context(self._transport(server))
                    session = await stack.enter_async_context(ClientSession(read, write))
                    await session.initialize()
                    listed = await session.list_tools()
                    if server.ready is not None and server.ready.is_set():
                        return  # too late: its agents were told it did not start (_start_deadline)
                    scope.deadline = math.inf
                    server.session = session
                    server.tools = {tool.name: tool for tool in listed.tools}
                    started = True
                    if server.ready is not None:
                        server.ready.set()
                    await anyio.sleep_forever()
            if scope.cancelled_caught and not started:
                server.problem = server.problem or self._timeout_text(cfg)
        except Exception as exc:  # noqa: BLE001 - a server that fails is its agents' problem, never the run's
            what = "stopped" if started else "did not start"
            server.problem = server.problem or f"MCP server {cfg.name} {what}: {self._why(server, exc)}"
        finally:
            server.session = None
            if server.ready is not None:
                server.ready.set()

    def _transport(self, server: ToolServer) -> Any:
        cfg = server.config
        if cfg.url:
            from mcp.client.streamable_http import streamable_http_client

            return _pair(streamable_http_client(cfg.url))
        env = {name: os.environ[name] for name in cfg.env if name in os.environ}
        # the server's stderr: a log file in the run directory, never the run's own terminal
        log = ServerLog(Path(self.log_dir) / f"mcp-{cfg.name}.log" if self.log_dir else None)
        server.process = StdioServer(cfg.command, list(cfg.args), env, cfg.cwd or None, log=log, scrub=self.scrub,
                                     max_message_bytes=message_max_bytes(cfg.max_result_chars))
        return server.process.connect()

    @staticmethod
    def _why(server: ToolServer, exc: BaseException) -> str:
        """Why a server's session ended or a call got no result: how its process ended, once it has."""
        exited = server.process.exit_text() if server.process is not None else ""
        return exited or _reason(exc)

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
            raise ToolCallError(f"MCP server {server_name}: {self._why(server, exc)}") from None
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
