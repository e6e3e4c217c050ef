"""Checks that need the environment, made before any request is sent: keys present, keys not sent in clear."""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.models import Config


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def preflight(config: Config, *, file: str | None = None) -> None:
    """Every api_key_env is set, and no key would go over plain http to another host unless allowed."""
    for i, ep in enumerate(config.endpoints):
        key = f"endpoints[{i}] ({ep.name})"
        if ep.api_key_env and not os.environ.get(ep.api_key_env):
            raise ConfigError(f"environment variable {ep.api_key_env} is not set (export it, or clear api_key_env)",
                              file=file, key=f"{key}.api_key_env")
        if ep.api_key_env and ep.kind != "simulated":
            url = urlsplit(ep.base_url)
            if url.scheme == "http" and not is_loopback(url.hostname or "") and not ep.allow_insecure_http:
                raise ConfigError(
                    f"would send the API key in clear text over http:// to {url.hostname}; use https:// "
                    "or set allow_insecure_http = true", file=file, key=f"{key}.base_url")
