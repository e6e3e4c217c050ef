"""Config: pydantic models, TOML load and save, paths."""

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

__all__ = [
    "AgentConfig",
    "Config",
    "ConfigError",
    "EndpointConfig",
    "ResolvedStall",
    "RunConfig",
    "SimSettings",
    "StallConfig",
    "UiConfig",
    "load_config",
    "resolve_stall",
    "validate",
]
