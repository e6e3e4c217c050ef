"""Config: pydantic models, TOML load and save, paths.

Its names are loaded when first asked for (PEP 562): a process that needs only `config.secrets` or `config.errors`
(the streaming worker, `--help`) does not pay for building the pydantic models (~150 ms)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cerevisor_tui.config.errors import ConfigError
    from cerevisor_tui.config.load import load_config, validate
    from cerevisor_tui.config.models import (
        AgentConfig,
        Config,
        EndpointConfig,
        ResolvedStall,
        RunConfig,
        SimSettings,
        StallConfig,
        UiConfig,
        resolve_stall,
    )

_WHERE = {"ConfigError": "errors", "load_config": "load", "validate": "load", **dict.fromkeys((
    "AgentConfig", "Config", "EndpointConfig", "ResolvedStall", "RunConfig", "SimSettings", "StallConfig", "UiConfig",
    "resolve_stall"), "models")}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
