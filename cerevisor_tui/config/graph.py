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
        for key, text in (("prompt", agent.prompt), *((f"turns[{j}]", t) for j, t in enumerate(agent.turns))):
            for ref in OUTPUT_REF.findall(text):
                if ref not in agent.depends_on:
                    raise ConfigError(
                        f"{{{{ {ref}.output }}}} is used but {ref!r} is not in depends_on",
                        file=file,
                        key=f"agents[{i}] ({agent.name}).{key}",
                    )

    # Depth by an explicit stack, not recursion: a chain of thousands of agents listed dependents-first
    # would pass Python's recursion limit (about 350 agents deep with a frame per level and the rest).
    depth: dict[str, int] = {}
    on_path: dict[str, int] = {}  # name -> its place on the current path, to name a cycle
    path: list[str] = []
    for root in agents:
        if root.name in depth:
            continue
        stack: list[tuple[str, int]] = [(root.name, 0)]  # (agent, index of the next dependency to visit)
        on_path[root.name] = 0
        path.append(root.name)
        while stack:
            name, next_dep = stack[-1]
            deps = by_name[name].depends_on
            if next_dep < len(deps):
                stack[-1] = (name, next_dep + 1)
                dep = deps[next_dep]
                if dep in depth:
                    continue
                if dep in on_path:
                    cycle = path[on_path[dep]:] + [dep]
                    raise ConfigError(f"depends_on has a cycle: {' -> '.join(cycle)}", file=file, key="agents")
                on_path[dep] = len(path)
                path.append(dep)
                stack.append((dep, 0))
                continue
            depth[name] = 1 + max((depth[d] for d in deps), default=-1)
            stack.pop()
            path.pop()
            del on_path[name]
    levels: list[list[AgentConfig]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for agent in agents:
        levels[depth[agent.name]].append(agent)
    return levels
