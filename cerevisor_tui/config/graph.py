"""The depends_on graph of a workflow: waves by depth, with cycles, unknown and duplicate names refused."""

from __future__ import annotations

import re
from collections.abc import Sequence

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.models import AgentConfig

# {{ name.output }} in a prompt or a turn: a dependency's final answer.
OUTPUT_REF = re.compile(r"\{\{\s*([^{}\s]+?)\.output\s*\}\}")


def wave_levels(agents: Sequence[AgentConfig], *, file: str | None = None) -> list[list[AgentConfig]]:
    """Group agents by the depth of their depends_on chain; wave 0 depends on nothing."""
    by_name: dict[str, AgentConfig] = {}
    for i, agent in enumerate(agents):
        if agent.name in by_name:
            raise ConfigError(f"duplicate agent name {agent.name!r}", file=file, key=f"agents[{i}].name")
        by_name[agent.name] = agent
    for i, agent in enumerate(agents):
        for dep in agent.depends_on:
            if dep not in by_name:
                raise ConfigError(
                    f"unknown agent {dep!r} in depends_on", file=file, key=f"agents[{i}] ({agent.name}).depends_on"
                )
            if dep == agent.name:
                raise ConfigError("an agent cannot depend on itself", file=file, key=f"agents[{i}] ({agent.name}).depends_on")
        for text in (agent.prompt, *agent.turns):
            for ref in OUTPUT_REF.findall(text):
                if ref not in agent.depends_on:
                    raise ConfigError(
                        f"{{{{ {ref}.output }}}} is used but {ref!r} is not in depends_on",
                        file=file,
                        key=f"agents[{i}] ({agent.name}).prompt",
                    )

    depth: dict[str, int] = {}
    visiting: list[str] = []

    def visit(name: str) -> int:
        if name in depth:
            return depth[name]
        if name in visiting:
            cycle = visiting[visiting.index(name):] + [name]
            raise ConfigError(f"depends_on has a cycle: {' -> '.join(cycle)}", file=file, key="agents")
        visiting.append(name)
        level = 1 + max((visit(dep) for dep in by_name[name].depends_on), default=-1)
        visiting.pop()
        depth[name] = level
        return level

    for agent in agents:
        visit(agent.name)
    levels: list[list[AgentConfig]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for agent in agents:
        levels[depth[agent.name]].append(agent)
    return levels
