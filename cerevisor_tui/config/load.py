"""Read and validate a TOML config; every problem becomes one ConfigError naming file and key."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.graph import wave_levels
from cerevisor_tui.config.models import Config


def _key_path(loc: tuple[Any, ...], data: Any) -> str:
    """Render a pydantic location as a TOML key path, naming list items by their `name` when they have one."""
    parts: list[str] = []
    node = data
    for item in loc:
        if isinstance(item, int):
            label = f"[{item}]"
            if isinstance(node, list) and 0 <= item < len(node):
                node = node[item]
                if isinstance(node, Mapping) and isinstance(node.get("name"), str):
                    label = f"[{item}] ({_shown(node['name'])})"
            parts.append(label)
        else:
            parts.append(("." if parts else "") + str(item))
            node = node.get(item) if isinstance(node, Mapping) else None
    return "".join(parts)


def _shown(name: str) -> str:
    """A name as one short line: an invalid one may hold a newline or run for pages."""
    shown = name if name.isprintable() else repr(name)
    return shown if len(shown) <= 60 else shown[:59] + "…"


def _message(err: ErrorDetails) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown key (check its spelling against config.example.toml)"
    if err["type"] == "missing":
        return "required key is missing"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def validate(data: Mapping[str, Any], *, file: str | None = None) -> Config:
    """Validate parsed TOML into a Config, with cross-references checked."""
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        more = len(exc.errors()) - 1
        problem = _message(err) + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")
        raise ConfigError(problem, file=file, key=_key_path(err["loc"], data) or None) from None
    check_references(config, file=file)
    return config


def check_references(config: Config, *, file: str | None = None) -> None:
    """Names must be unique and every reference must resolve; cycles are checked with the waves."""
    seen: set[str] = set()
    for i, ep in enumerate(config.endpoints):
        if ep.name in seen:
            raise ConfigError(f"duplicate endpoint name {ep.name!r}", file=file, key=f"endpoints[{i}].name")
        seen.add(ep.name)
    if config.agents and not config.endpoints:
        raise ConfigError("agents are defined but no [[endpoints]] table is", file=file, key="endpoints")
    pools: set[str] = set()
    for i, pool in enumerate(config.pools):
        key = f"pools[{i}] ({pool.name})"
        if pool.name in seen or pool.name in pools:
            raise ConfigError(f"pool name {pool.name!r} is already the name of an endpoint or pool: agents name "
                              "either in their endpoint", file=file, key=f"{key}.name")
        pools.add(pool.name)
        for j, member in enumerate(pool.endpoints):
            if member not in seen:
                raise ConfigError(f"unknown endpoint {member!r} (known: {', '.join(sorted(seen))})",
                                  file=file, key=f"{key}.endpoints[{j}]")
            if member in pool.endpoints[:j]:
                raise ConfigError(f"endpoint {member!r} is listed twice", file=file, key=f"{key}.endpoints[{j}]")
    for i, agent in enumerate(config.agents):
        if agent.endpoint and agent.endpoint not in seen and agent.endpoint not in pools:
            known = ", ".join(sorted(seen)) + (f"; pools: {', '.join(sorted(pools))}" if pools else "")
            raise ConfigError(
                f"unknown endpoint {agent.endpoint!r} (known: {known})",
                file=file,
                key=f"agents[{i}] ({agent.name}).endpoint",
            )
    servers: set[str] = set()
    for i, server in enumerate(config.mcp_servers):
        if server.name in servers:
            raise ConfigError(f"duplicate MCP server name {server.name!r}", file=file,
                              key=f"mcp_servers[{i}] ({server.name}).name")
        servers.add(server.name)
    for i, agent in enumerate(config.agents):
        for j, tool in enumerate(agent.tools):
            server_name = tool.split(".", 1)[0]
            if server_name not in servers:
                known = ", ".join(sorted(servers)) or "none: add an [[mcp_servers]] table"
                raise ConfigError(f"unknown MCP server {server_name!r} in {tool!r} (known: {known})",
                                  file=file, key=f"agents[{i}] ({agent.name}).tools[{j}]")
        choice = agent.tool_choice
        if choice and choice not in ("auto", "required", "none"):
            server_name, _, tool = choice.partition(".")
            if not tool or not any(t in (server_name, choice) for t in agent.tools):
                raise ConfigError(f"{choice!r} is not auto, required, none or a server.tool of this agent's tools",
                                  file=file, key=f"agents[{i}] ({agent.name}).tool_choice")
    gateway = config.gateway
    if gateway is not None:
        if not config.endpoints:
            raise ConfigError("a gateway needs an upstream: add an [[endpoints]] table", file=file, key="endpoints")
        if gateway.upstream and gateway.upstream not in seen and gateway.upstream not in pools:
            known = ", ".join(sorted(seen)) + (f"; pools: {', '.join(sorted(pools))}" if pools else "")
            raise ConfigError(f"unknown endpoint or pool {gateway.upstream!r} (known: {known})", file=file,
                              key="gateway.upstream")
    wave_levels(config.agents, file=file)


def load_config(path: str | Path) -> Config:
    """Load a config file, or raise ConfigError naming the file, the key and the problem."""
    path = Path(path)
    shown = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("file not found", file=shown) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a TOML file", file=shown) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}", file=shown) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", file=shown) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"invalid TOML: {exc}", file=shown) from None
    return validate(data, file=shown)
