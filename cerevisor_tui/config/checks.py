"""Checks that need the environment, made before any request is sent: keys present and usable in a header,
keys not sent in clear."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from cerevisor_tui.config.errors import ConfigError
from cerevisor_tui.config.models import Config, is_loopback
from cerevisor_tui.config.secrets import key_problem


def check_key(env: str, value: str, *, file: str | None = None, key: str | None = None) -> None:
    """A key value httpx cannot send (a control character, say a CRLF key file's trailing \\r; non-ASCII) is
    a config error that names the variable and never shows the value."""
    problem = key_problem(value)
    if problem:
        raise ConfigError(f"environment variable {env} {problem}; fix the value (it is never shown)",
                          file=file, key=key)


def preflight(config: Config, *, file: str | None = None) -> None:
    """Every api_key_env is set and usable in a header, and no key would go over plain http to another host
    unless allowed."""
    for i, ep in enumerate(config.endpoints):
        key = f"endpoints[{i}] ({ep.name})"
        if ep.api_key_env and not os.environ.get(ep.api_key_env):
            raise ConfigError(f"environment variable {ep.api_key_env} is not set (export it, or clear api_key_env)",
                              file=file, key=f"{key}.api_key_env")
        if ep.api_key_env:
            check_key(ep.api_key_env, os.environ[ep.api_key_env], file=file, key=f"{key}.api_key_env")
        if ep.api_key_env and ep.kind != "simulated":
            url = urlsplit(ep.base_url)
            if url.scheme == "http" and url.hostname and not is_loopback(url.hostname) and not ep.allow_insecure_http:
                raise ConfigError(
                    f"would send the API key in clear text over http:// to {url.hostname}; use https:// "
                    "or set allow_insecure_http = true", file=file, key=f"{key}.base_url")
