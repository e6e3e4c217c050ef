"""Pydantic models of the TOML config: `[run]`, `[stall]`, `[ui]`, `[[endpoints]]`, `[[pools]]`, `[[agents]]`.

Every model forbids unknown keys, so a typo is an error that names the key rather than a setting
silently ignored. The one-line docstring under each field is the user-facing documentation: the
settings screen and `config.example.toml` show it (`field_doc`).
"""

from __future__ import annotations

import ast
import functools
import inspect
import ipaddress
import json
import re
import sys
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cerevisor_tui.contract import events as ev
from cerevisor_tui.kinds import Mode
from cerevisor_tui.text import control_char

EndpointKind = Literal["local", "hosted", "simulated"]
Liveness = Literal["tokens", "bytes"]
PoolPolicy = Literal["least-loaded", "round-robin"]
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP header name (RFC 9110 token)

DEFAULT_FIRST_BYTE_S: dict[str, float] = {"hosted": 600.0, "local": 1800.0, "simulated": 1800.0}
MAX_AGENT_NAME_BYTES = 200  # transcripts/<name>.jsonl must fit a file name (255 bytes on most filesystems)
# names Windows keeps for devices, with any extension: a run directory copied there must still open
_RESERVED_NAMES = frozenset({"con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)),
                             *(f"lpt{i}" for i in range(1, 10))})
_HOST_CHARS = re.compile(r"[A-Za-z0-9._~-]+")


def agent_name_problem(name: str) -> str | None:
    """Why `name` cannot be an agent's name, or None. It names the agent's transcript file,
    `transcripts/<name>.jsonl`, so it must be a plain file name on any system, and a line on a terminal."""
    if not name.strip():
        return "must not be empty"
    if name != name.strip():
        return "must not begin or end with a space"
    bad = control_char(name)
    if bad is not None:
        return f"holds a control character (U+{ord(bad):04X}); it names a file and a line on the screen"
    if any(c in name for c in "/\\"):
        return "must hold no path separators (/ or \\): it names the agent's transcript file"
    if name.startswith("."):
        return "must not start with a dot (., .. and hidden files): it names the agent's transcript file"
    size = len(name.encode("utf-8"))
    if size > MAX_AGENT_NAME_BYTES:
        return f"is {size} bytes long; at most {MAX_AGENT_NAME_BYTES} (it names the agent's transcript file)"
    if name.split(".")[0].lower() in _RESERVED_NAMES:
        return f"{name.split('.')[0]!r} is a reserved device name on Windows; pick another"
    return None


OWN_BODY_KEYS = frozenset({"model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
                           "temperature", "tools", "tool_choice"})
"""A chat request's fields the run sets itself: an `extra_body` may not (an agent's own keys set the rest)."""


ONE_ANSWER_KEYS = frozenset({"n", "best_of"})
"""Fields that ask a server for several answers per request: an agent's turn has one answer."""


def _checked_extra_body(value: dict[str, Any]) -> dict[str, Any]:
    taken = sorted(OWN_BODY_KEYS & value.keys())
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the run itself (an agent's max_tokens, temperature or "
                         "tool_choice key sets what may be set)")
    several = sorted(ONE_ANSWER_KEYS & value.keys())
    if several:
        raise ValueError(f"{', '.join(several)}: asks the server for several answers per request (their streams "
                         "interleave), and an agent's turn takes one; remove it (run more agents instead)")
    for key, item in value.items():
        try:
            json.dumps(item, allow_nan=False)
        except (TypeError, ValueError):
            raise ValueError(f"{key}: {item!r} has no JSON form (a TOML date or time, or a NaN)") from None
    return value


def _checked_url(value: str) -> str:
    """A URL field's validator: `value` as it is, or a ValueError saying what is wrong with it ("" is no URL)."""
    problem = url_problem(value) if value else None
    if problem:
        raise ValueError(problem)
    return value


def shown_url(url: str) -> str:
    """`url` as a message may repeat it: a user:password@ in it becomes [redacted]@ (found by hand, as a URL
    that fails to parse may hold one too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    authority_end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, authority_end)
    if at < 0:
        return url
    return f"{scheme}{sep}[redacted]@{rest[at + 1:]}"


def url_problem(url: str) -> str | None:
    """Why `url` is not the base URL of a server (http[s]://host[:port][/path]), or None."""
    if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in url):
        return "must not hold spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:  # an out-of-range or non-numeric port, a broken [IPv6] literal
        text = str(exc)
        if "out of range" in text or "Port" in text or "port" in text:
            return "port must be a number from 1 to 65535"
        return f"is not a URL ({text})"
    if parts.scheme not in ("http", "https"):
        return "must start with http:// or https://"
    if parts.username is not None or parts.password is not None:
        return ("must not hold credentials (user:password@): put the key in an environment variable and name "
                "it in api_key_env")
    host = parts.hostname or ""
    if not host:
        return "names no host (e.g. http://127.0.0.1:8000/v1)"
    if port == 0:
        return "port must be a number from 1 to 65535"
    if not (_HOST_CHARS.fullmatch(host) or (":" in host and _is_ip(host)) or _is_idn(host)):
        return f"{host!r} is not a host name or an IP address"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return "must not have a query (?...) or a fragment (#...): request paths are appended to it"
    return None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_idn(host: str) -> bool:
    """A host name in another script (an internationalized domain name) that IDNA can encode."""
    if host.isascii():
        return False
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


class _Section(BaseModel):
    # no inf or nan anywhere: TOML allows them, and a deadline, a speed or a size of inf breaks the arithmetic
    # (not pydantic's use_attribute_docstrings: it reads every class's source as the class is made, ~40 ms of
    # every process's start, for text only the settings screen and `sim --help` show: field_doc reads it then)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def field_doc(model: type[BaseModel], key: str) -> str:
    """The docstring under field `key` of a config model (or of the model it inherits the field from), cleaned as
    a docstring is; "" where it has none."""
    for cls in model.__mro__:
        doc = _attribute_docs(cls).get(key)
        if doc is not None:
            return doc
    return ""


@functools.cache
def _attribute_docs(cls: type) -> dict[str, str]:
    """Each field of a class defined here with the string literal that follows it, read from this file's source."""
    if cls.__module__ != __name__:
        return {}
    node = next((n for n in _source_tree().body if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None)
    docs: dict[str, str] = {}
    body = node.body if node is not None else []
    for field, after in zip(body, body[1:]):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[field.target.id] = inspect.cleandoc(after.value.value)
    return docs


@functools.cache
def _source_tree() -> ast.Module:
    return ast.parse(inspect.getsource(sys.modules[__name__]))


class AutoConfig(_Section):
    """The `[run.auto]` table: how auto mode sets each endpoint's cap from what the server reports."""

    min_cap: int = Field(default=1, ge=1, le=4096)
    """Auto never sets an endpoint's cap below this."""
    max_cap: int = Field(default=0, ge=0, le=4096)
    """Auto never sets an endpoint's cap above this; 0: the endpoint's max_concurrency."""
    start_cap: int = Field(default=0, ge=0, le=4096)
    """Cap to start from; 0: the last probe's recommendation for the endpoint if one was saved, else a slow start from min_cap."""
    kv_target: float = Field(default=0.95, gt=0, le=1)
    """Fraction of the server's KV cache the agents' conversations may fill, at their projected full length."""
    min_interactivity_tokens_s: float = Field(default=0.0, ge=0, le=100000)
    """Output tokens/s each user must keep (the server's own time per output token where it exports vLLM's inter-token histogram, else the median answer's from its first token): Auto backs off below it and grows only above it; 0: throughput alone decides."""

    @model_validator(mode="after")
    def _order(self) -> AutoConfig:
        if self.max_cap and self.max_cap < self.min_cap:
            raise ValueError(f"max_cap ({self.max_cap}) is below min_cap ({self.min_cap})")
        return self


class RunConfig(_Section):
    mode: Mode = "parallel"
    """sequential (one agent at a time), parallel (up to max_concurrency) or auto (each endpoint's cap follows what its server sustains: queue, KV use, preemptions, prefix hits, throughput; +/- move its ceiling)."""
    max_concurrency: int = Field(default=4, ge=1, le=4096)
    """Most agents running at once in parallel mode (each endpoint's max_concurrency caps it further)."""
    run_dir: str = ""
    """Where run directories go (events, transcripts, report); empty: the user state dir."""
    metrics_interval_s: float = Field(default=2.0, gt=0)
    """How often each endpoint's /health and /metrics are read while a run is going."""
    stream_process: Literal["auto", "on", "off"] = "auto"
    """Read the agents' streams in a second process: auto = in the console when the machine has 2+ CPUs."""
    auto: AutoConfig = AutoConfig()
    """Auto mode's controller."""
    warmup: Literal["auto", "on", "off"] = "auto"
    """At the start, one short request to each endpoint the run uses; its time to first token is the endpoint's cold start, and that endpoint's agents are sent after it: auto = on for local endpoints (kind local or simulated, or on this machine)."""
    warmup_timeout_s: float = Field(default=30.0, gt=0, le=86400)
    """Longest a warm-up waits for its first token (never past the endpoint's first-byte window): a dead port or a server that never answers fails it then, with a notice, and its agents are sent."""
    budget_usd: float = Field(default=0.0, ge=0)
    """Most the run may spend on priced endpoints (price_in_per_mtok/price_out_per_mtok), in USD: once reached, no new agent is admitted (running ones finish); 0: no budget."""


class StallPolicy(_Section):
    """Stall settings that an endpoint may override one by one."""

    first_byte_timeout_s: float | None = Field(default=None, gt=0)
    """Cold-start grace: from sending a request to its first sign of life. Empty: 600 s hosted, 1800 s local."""
    idle_timeout_s: float | None = Field(default=None, gt=0)
    """Longest gap between signs of life once a stream has started (default 600 s)."""
    warn_at: list[float] | None = None
    """Fractions of a deadline at which a StallWarning is raised (default [0.5, 0.8, 0.95])."""
    liveness: Liveness | None = None
    """What counts as a sign of life: "tokens" (content, reasoning or tool calls) or "bytes" (anything, keep-alives too)."""
    extend_s: float | None = Field(default=None, gt=0)
    """How far an extension moves a deadline, by the operator (e) or because the server is busy (default 300 s)."""
    max_extensions: int | None = Field(default=None, ge=0)
    """Most automatic extensions per attempt when the server is busy (default 3)."""
    extend_when_server_busy: bool | None = None
    """At a deadline, extend instead of killing when /health says loading or /metrics shows requests waiting, or an estimated prefill (vLLM, SGLang) is still plausible with KV use climbing (default true)."""

    @field_validator("warn_at")
    @classmethod
    def _fractions(cls, value: list[float] | None) -> list[float] | None:
        if value is None:
            return value
        if any(not 0 < f < 1 for f in value):
            raise ValueError("each fraction must be between 0 and 1 (exclusive)")
        return sorted(set(value))


class StallConfig(StallPolicy):
    """The `[stall]` table: defaults for every endpoint."""

    idle_timeout_s: float | None = Field(default=600.0, gt=0)
    """Longest gap between signs of life once a stream has started."""
    warn_at: list[float] | None = [0.5, 0.8, 0.95]
    """Fractions of a deadline at which a StallWarning is raised."""
    liveness: Liveness | None = "tokens"
    """What counts as a sign of life: "tokens" (content, reasoning or tool calls) or "bytes" (anything, keep-alives too)."""
    extend_s: float | None = Field(default=300.0, gt=0)
    """How far an extension moves a deadline, by the operator (e) or because the server is busy."""
    max_extensions: int | None = Field(default=3, ge=0)
    """Most automatic extensions per attempt when the server is busy."""
    extend_when_server_busy: bool | None = True
    """At a deadline, extend instead of killing when /health says loading or /metrics shows requests waiting, or an estimated prefill (vLLM, SGLang) is still plausible with KV use climbing."""
    wedge_timeout_s: float = Field(default=45.0, ge=0, le=86_400)
    """A local server wedged behind a /health that says 200: no token counter and no KV use has moved on it for this long while our requests are open. Its requests are killed then, long before the first-byte deadline; 0: off."""
    preempt_limit: int = Field(default=6, ge=0, le=10_000)
    """A request preempted this many times before its first token (the server's preemption count while it waits, with requests waiting for KV room) is killed: its prompt does not fit beside the others; 0: off."""


class UiConfig(_Section):
    theme: str = "cerevisor-dark"
    """Colour theme: a name from the packaged themes or the user themes folder."""
    keys: dict[str, str] = {}
    """Key remaps, binding id = keys, e.g. toggle_mode = "M"."""
    refresh_hz: float = Field(default=12.0, ge=1, le=30)
    """How often visible panes are redrawn while tokens stream."""
    notify: bool = True
    """Ring the terminal when an agent needs you (approval, killed, failed, endpoint down, about to be killed):
    the bell and a desktop notification (OSC 9 and OSC 777, which most terminals show); once per agent per
    state change."""


class SimSettings(_Section):
    """Settings of the built-in simulator, for an endpoint of kind "simulated" or `cerevisor-tui sim`."""

    profile: str = ""
    """A model+GPU preset name (see `cerevisor-tui sim --help`); empty: a small generic server."""
    seed: int = 0
    """Seed of the deterministic output text."""
    speed: float = Field(default=1.0, gt=0)
    """Time scale: 10 runs ten times faster than real time."""
    tokens_per_s: float = Field(default=40.0, gt=0)
    """Decode speed of one sequence alone (the batch slows it as it grows)."""
    ttft_s: float = Field(default=0.3, ge=0)
    """Time to first token of a request that starts at once."""
    max_num_seqs: int = Field(default=16, ge=1)
    """Sequences the server runs at once; the rest wait in its queue."""
    cold_start_s: float = Field(default=0.0, ge=0)
    """Seconds /health answers 503 and requests wait, as while a server loads its weights."""
    stall_after_tokens: int = Field(default=-1, ge=-1)
    """Fault: stop sending tokens after N (keep-alive comments go on); -1: off."""
    keepalive_s: float = Field(default=0.0, ge=0)
    """Send an SSE comment this often while a request waits or stalls; 0: off."""
    drop_after_tokens: int = Field(default=-1, ge=-1)
    """Fault: drop the connection after N tokens; -1: off."""
    fail_first: int = Field(default=0, ge=0)
    """Fault: answer the first K chat requests with fail_status."""
    fail_status: int = Field(default=500, ge=400, le=599)
    """HTTP status of the injected failures (429 comes with Retry-After)."""
    malformed_after_tokens: int = Field(default=-1, ge=-1)
    """Fault: send one chunk of broken JSON after N tokens; -1: off."""
    max_tokens_default: int = Field(default=128, ge=1)
    """Completion length when a request gives no max_tokens."""
    max_model_len: int = Field(default=0, ge=0)
    """Longest prompt + completion a request may ask for (vLLM --max-model-len); 0: the profile's, else 32768."""
    kv_cache_tokens: int = Field(default=0, ge=0)
    """GPU KV cache size in tokens; 0: from the profile, else room for max_num_seqs full-length sequences."""
    block_size: int = Field(default=16, ge=1, le=1024)
    """Tokens per KV block; prefix reuse works in whole blocks."""
    kv_bytes_per_token: int = Field(default=0, ge=0)
    """KV bytes one token takes; 0: the profile's, else 131072 (Llama-3.1-8B in bf16). Sizes the CPU tier."""
    cpu_offload_gib: float = Field(default=0.0, ge=0)
    """Size of a CPU KV tier that keeps evicted prefix blocks for a fast reload; 0: none."""
    cpu_bandwidth_gib_s: float = Field(default=25.0, gt=0)
    """How fast blocks reload from the CPU tier (PCIe), in GiB/s; with a profile, its GPUs' host link unless set."""
    prefill_tokens_per_s: float = Field(default=0.0, ge=0)
    """Prompt tokens the server computes per second, shared by the batch (cached prefix tokens cost nothing, so a request's time to first token grows with its uncached ones); 0: the profile's, else 20000."""
    progress_every_tokens: int = Field(default=256, ge=1)
    """A streamed chat request that asks for "return_progress" gets llama-server's prompt_progress chunks: one as its prefill starts, one each time this many more prompt tokens are processed (llama's -b/-ub batch), one at the end."""
    wedge_after_s: float = Field(default=-1.0, ge=-1)
    """Fault: once the engine clock (seconds spent serving, idle gaps left out) reaches this, the engine stops for good: /health stays 200, no token, counter or KV use moves again, new requests hang; negative: off."""
    preempt_loop_tokens: int = Field(default=-1, ge=-1)
    """Fault: a prompt of at least this many tokens is preempted each time its prefill ends, waits as long as a prefill takes, and prefills again, never making a first token; -1: off."""
    batch_slowdown: float = Field(default=0.02, ge=0)
    """Each extra sequence in the batch slows every sequence's decode by this fraction."""
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    """Tokens one scheduler step computes: one per decoding sequence plus prompt chunks (chunked prefill)."""
    tool_steps: int = Field(default=1, ge=0)
    """When a request offers tools: answer with a tool call while the current turn holds fewer tool-calling answers than this, then in text; 0: never call tools."""
    tool_args: dict[str, dict[str, Any]] = {}
    """Arguments to call named tools with, e.g. { get_current_time = { timezone = "UTC" } }; when set, only these tools are called. Other arguments are made from each tool's schema."""


class CapacitySettings(_Section):
    """What the load pane's KV estimate assumes about an endpoint's box (see `cerevisor-tui estimate`)."""

    model: str = ""
    """Model preset name, or the path of the model's Hugging Face config.json; empty: no estimate."""
    gpu: str = ""
    """GPU preset name (h100, a100-80gb, l4, ...); or give kv_memory_gib."""
    gpus: int = Field(default=1, ge=1, le=1024)
    """GPUs the model is split across (tensor parallel)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of GPU memory the server may use (vLLM's --gpu-memory-utilization)."""
    kv_memory_gib: float = Field(default=0.0, ge=0)
    """KV memory per GPU the server reported (vLLM logs it at start-up); 0: derive it from the GPU."""
    context_tokens: int = Field(default=0, ge=0)
    """Tokens one agent conversation grows to; 0: the model's maximum context."""
    kv_dtype: str = "auto"
    """KV cache dtype: auto, fp16, bf16 or fp8."""
    cpu_offload_gib: float = Field(default=0.0, ge=0)
    """Size of a CPU KV tier (offloading), if the server has one."""


class EndpointConfig(StallPolicy):
    name: str
    """Name agents use to pick this endpoint."""
    base_url: str = ""
    """OpenAI-compatible base URL ending in /v1; not used for kind "simulated"."""
    kind: EndpointKind = "local"
    """local (a server on your box: long cold start, waits for the port), hosted (an API), or simulated (built in)."""
    model: str = ""
    """Model id to request; empty: the first of /v1/models."""
    api_key_env: str = ""
    """Name of the environment variable that holds the API key (the key itself never goes in a file)."""
    max_concurrency: int = Field(default=64, ge=1, le=4096)
    """Most requests this server carries at once; caps parallel mode."""
    allow_insecure_http: bool = False
    """Allow sending an API key over plain http:// to a host that is not loopback."""
    sim: SimSettings = SimSettings()
    """Simulator settings, for kind "simulated"."""
    capacity: CapacitySettings = CapacitySettings()
    """What the KV estimate of the load pane assumes about this endpoint's box."""
    metrics_urls: list[str] = []
    """When this endpoint is a router (vllm-router, llm-d, ...): the root URLs of the workers behind it (http://host:port); the load pane and the busy check read each one's /health and /metrics (without the API key) instead of the router's."""

    @field_validator("metrics_urls")
    @classmethod
    def _metrics_urls(cls, value: list[str]) -> list[str]:
        for i, url in enumerate(value):
            problem = url_problem(url)
            if problem:
                raise ValueError(f"[{i}] {shown_url(url)!r}: {problem}")
        if len(set(value)) < len(value):
            raise ValueError("a worker is listed twice")
        return value

    session_header: str = "X-Session-ID"
    """Header that carries each agent's stable session id (<run id>/<agent>), so a router keeps its turns on one worker; empty: not sent."""
    max_model_len: int = Field(default=0, ge=0)
    """The model's context length in tokens, for the context-fill meter; 0: what /v1/models says (vLLM's max_model_len)."""
    # at most a thousand dollars a token: past that it is a typo, and a cost summed from it could pass what
    # a float holds (an infinite cost is no number a journal or a report can keep)
    price_in_per_mtok: float = Field(default=0.0, ge=0, le=1e9)
    """Price of a million prompt tokens, in USD, for the cost meters and [run] budget_usd; 0: not priced."""
    price_out_per_mtok: float = Field(default=0.0, ge=0, le=1e9)
    """Price of a million completion tokens, in USD; 0: not priced."""
    prompt_progress: Literal["auto", "on", "off"] = "auto"
    """Ask each streamed request for the server's prefill progress ("return_progress", llama-server's prompt_progress), which the stall watchdog takes as a sign of life of a long prefill: auto asks a llama.cpp server (told by its /props or its metrics), on always (a proxy in front of one), off never."""
    extra_body: dict[str, Any] = {}
    """Fields added to every chat request's JSON body, for a server's own parameters: e.g. {chat_template_kwargs = {enable_thinking = false}} (Qwen3 on vLLM or SGLang), {top_k = 20}; an agent's extra_body adds to it."""

    @field_validator("extra_body")
    @classmethod
    def _extra_body(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked_extra_body(value)

    @field_validator("session_header")
    @classmethod
    def _session_header(cls, value: str) -> str:
        if value and not _HEADER_NAME.fullmatch(value):
            raise ValueError(f"{value!r} is not an HTTP header name (letters, digits and -, e.g. X-Session-ID)")
        return value

    @property
    def priced(self) -> bool:
        return bool(self.price_in_per_mtok or self.price_out_per_mtok)

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        """What a request's tokens cost at this endpoint's prices (0 when it has none)."""
        return (prompt_tokens * self.price_in_per_mtok + completion_tokens * self.price_out_per_mtok) / 1e6

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if (char := control_char(value)) is not None:  # it is shown in every line about the endpoint
            raise ValueError(f"holds a control character (U+{ord(char):04X})")
        return value

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, value: str) -> str:
        return _checked_url(value)

    @model_validator(mode="after")
    def _url(self) -> EndpointConfig:
        if self.kind != "simulated" and not self.base_url:
            raise ValueError(f'base_url is required for kind "{self.kind}"')
        if self.metrics_urls and self.kind == "hosted":  # hosted endpoints are never polled: they would go unread
            raise ValueError('metrics_urls are read only on a kind "local" endpoint (a hosted one is not polled): '
                             'a router you run is "local"')
        return self


class PoolConfig(_Section):
    """A `[[pools]]` table: endpoints that serve the same model, among which the run places each agent."""

    name: str
    """Name agents use in their `endpoint` to be placed on a member of this pool."""
    endpoints: list[str] = Field(min_length=1)
    """Names of the [[endpoints]] that serve the same model."""
    policy: PoolPolicy = "least-loaded"
    """How an agent's member is chosen when it starts: least-loaded (our running agents vs the member's cap, its queue, its KV use) or round-robin; every turn of the agent then stays on that member."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if (char := control_char(value)) is not None:
            raise ValueError(f"holds a control character (U+{ord(char):04X})")
        return value


_SERVER_NAME = re.compile(r"[A-Za-z0-9_-]{1,32}")


class McpServerConfig(_Section):
    """A `[[mcp_servers]]` table: an MCP tool server, started once per run and shared by the agents that list it."""

    name: str
    """Name agents use in their `tools` (letters, digits, _ and -; it prefixes the tools' names the model sees)."""
    command: str = ""
    """Program that serves MCP over stdio (e.g. "uvx", or a path); or give url."""
    args: list[str] = []
    """Its arguments, e.g. ["mcp-server-time"]."""
    env: list[str] = []
    """Names of environment variables passed through to it; it gets no others but PATH, HOME and the like (the MCP SDK's safe set)."""
    cwd: str = ""
    """Working directory of the command; empty: the run's."""
    url: str = ""
    """URL of an MCP server that speaks streamable HTTP, instead of a command."""
    allow: list[str] = []
    """Tool-name globs that run without asking (deny wins over ask over allow)."""
    ask: list[str] = []
    """Tool-name globs that wait for the operator's approval (headless: denied unless run --approve-all)."""
    deny: list[str] = []
    """Tool-name globs never run: the model is told the call was denied."""
    tool_timeout_s: float = Field(default=120.0, gt=0)
    """Longest one call of this server's tools may take; then it is cancelled and the model told why."""
    warn_at: list[float] = [0.5, 0.8, 0.95]
    """Fractions of tool_timeout_s at which a ToolCallWarning is raised."""
    start_timeout_s: float = Field(default=60.0, gt=0)
    """Longest the server may take to start and list its tools; then agents that use it fail, saying why."""
    max_result_chars: int = Field(default=16000, ge=100)
    """Longest tool result handed to the model; a longer one is cut, and the cut said in the result."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _SERVER_NAME.fullmatch(value):
            raise ValueError("must be 1-32 letters, digits, _ or - (it prefixes tool names the model sees)")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return _checked_url(value)

    @field_validator("warn_at")
    @classmethod
    def _fractions(cls, value: list[float]) -> list[float]:
        if any(not 0 < f < 1 for f in value):
            raise ValueError("each fraction must be between 0 and 1 (exclusive)")
        return sorted(set(value))

    @model_validator(mode="after")
    def _transport(self) -> McpServerConfig:
        if bool(self.command) == bool(self.url):
            raise ValueError("give either command (stdio) or url (streamable HTTP)")
        return self


class AgentConfig(_Section):
    name: str
    """Unique name; used in depends_on and in {{ name.output }}."""
    endpoint: str = ""
    """Endpoint or pool name; empty: the first endpoint."""
    system: str = ""
    """System prompt."""
    prompt: str
    """First user message; {{ other.output }} inserts a dependency's final answer."""
    turns: list[str] = []
    """Follow-up user messages, each sent after the previous answer."""
    depends_on: list[str] = []
    """Agents that must finish first; they set the agent's wave."""
    max_tokens: int = Field(default=256, ge=1)
    """Completion length limit per turn."""
    temperature: float = Field(default=0.7, ge=0, le=2)
    """Sampling temperature."""
    retries: int = Field(default=2, ge=0, le=20)
    """New attempts after a failed or killed one (429, 5xx, connection errors and stall kills)."""
    tools: list[str] = []
    """MCP tools it may call: a server's name (all its tools) or "server.tool"; empty: none."""
    max_steps: int = Field(default=10, ge=1, le=1000)
    """With tools: most model requests one turn may make (each answer that calls tools, and the last); past it the agent fails."""
    tool_choice: str = ""
    """With tools: "" (the server's default), "auto", "required", "none", or "server.tool": that tool is forced at the first request of each turn, and "none" sent after it."""
    extra_body: dict[str, Any] = {}
    """Fields added to its chat requests' JSON body, over its endpoint's extra_body (its keys win): e.g. {ignore_eos = true} or {min_tokens = 100} on vLLM."""

    @field_validator("extra_body")
    @classmethod
    def _extra_body(cls, value: dict[str, Any]) -> dict[str, Any]:
        return _checked_extra_body(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        problem = agent_name_problem(value)
        if problem:
            raise ValueError(problem)
        return value


DEFAULT_GATEWAY_LISTEN = "127.0.0.1:8100"


def split_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:8100` for IPv6) as (host, port); ValueError says what is wrong."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{listen!r} is not HOST:PORT (for example {DEFAULT_GATEWAY_LISTEN})")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{listen!r}: the port must be a number from 0 to 65535")
    if control_char(host) is not None or " " in host:
        raise ValueError(f"{listen!r}: the host holds a space or a control character")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1 bracketed or not, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class GatewayConfig(_Section):
    """The `[gateway]` table: the run also serves an OpenAI- and Anthropic-compatible front door, and every
    session of a harness pointed at it is an agent of the run (gateway/)."""

    listen: str = DEFAULT_GATEWAY_LISTEN
    """HOST:PORT the gateway serves on; loopback by default. Any other address needs keys_env."""
    upstream: str = ""
    """The endpoint or pool requests go to; empty: the first endpoint (a request's model may pick another: the one that serves it)."""
    keys_env: list[str] = []
    """Names of environment variables, each holding one client key the gateway accepts (Authorization: Bearer or x-api-key); the variable's name labels the sessions that use it. Empty: no key asked (loopback only)."""
    keepalive_s: float = Field(default=10.0, gt=0, le=300)
    """A streamed request waiting for its slot or its first byte gets an SSE comment this often (the first after this long, so quick errors keep their HTTP status)."""
    release_after_s: float = Field(default=60.0, ge=0, le=86400)
    """A session gives its slot back after this long without a request; 0: every request is admitted on its own."""
    max_body_mib: float = Field(default=32.0, gt=0, le=1024)
    """Largest request body accepted, in MiB (a larger one gets 413)."""
    down_after_s: float = Field(default=30.0, gt=0, le=86400)
    """A local upstream that has never answered and has refused its port this long is down: a request then gets 503 with Retry-After, naming it, instead of waiting out its first-byte window, and the header says it is down. A run without [gateway] uses this default for the header."""
    model_map: dict[str, str] = {}
    """Glob of a model name a harness asks for = the served model sent instead, e.g. "claude-*" = "qwen3-coder"; the first glob that matches wins."""
    header_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """A connection must send a request's whole header within this long (from its first byte, or from its opening), else it is closed: a client that sends half a request line and stops holds nothing."""
    body_timeout_s: float = Field(default=60.0, gt=0, le=3600)
    """A request's whole body must arrive within this long of its header, else the connection is closed."""
    max_connections: int = Field(default=1024, ge=1, le=65536)
    """Open client connections at most (lowered to fit the process's descriptor limit); past it, a new connection takes the place of the oldest one still waiting for its request, else it is closed."""
    max_connections_per_peer: int = Field(default=64, ge=1, le=65536)
    """Open connections at most from one client address, on a network listen (loopback: max_connections alone)."""
    max_sessions_per_key: int = Field(default=1024, ge=1, le=100000)
    """Open sessions at most per client key (or, with no keys, for all clients together); past it, a new session's request gets 429."""
    forget_after_s: float = Field(default=3600.0, ge=0, le=604800)
    """An idle session (no request, no slot) is forgotten after this long: its row ends, and a later request opens a new one under the same name; 0: never."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        split_listen(value)
        return value

    @field_validator("keys_env")
    @classmethod
    def _keys_env(cls, value: list[str]) -> list[str]:
        for name in value:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise ValueError(f"{name!r} is not an environment variable's name (the key itself never goes in a file)")
        return value

    @model_validator(mode="after")
    def _exposed(self) -> GatewayConfig:
        host, _ = split_listen(self.listen)
        if not is_loopback(host) and not self.keys_env:
            raise ValueError(f"listen {self.listen!r} is not loopback: set keys_env (client keys), or the gateway "
                             "would let anyone who can reach the port use the model")
        return self


class Config(_Section):
    run: RunConfig = RunConfig()
    """Run settings."""
    stall: StallConfig = StallConfig()
    """Stall watchdog defaults."""
    ui: UiConfig = UiConfig()
    """Console settings."""
    endpoints: list[EndpointConfig] = []
    """Model servers."""
    pools: list[PoolConfig] = []
    """Endpoints serving the same model, among which agents are placed."""
    mcp_servers: list[McpServerConfig] = []
    """MCP tool servers the agents may use."""
    agents: list[AgentConfig] = []
    """The workflow."""
    gateway: GatewayConfig | None = None
    """The run's gateway, if it serves one: harnesses' sessions become agents of the run."""

    def endpoint(self, name: str) -> EndpointConfig:
        for ep in self.endpoints:
            if ep.name == name:
                return ep
        raise KeyError(name)

    def pool(self, name: str) -> PoolConfig | None:
        return next((p for p in self.pools if p.name == name), None)

    def agent_pool(self, agent: AgentConfig) -> PoolConfig | None:
        """The pool an agent's `endpoint` names, if it names one."""
        return self.pool(agent.endpoint) if agent.endpoint and self.pools else None

    def agent_endpoint(self, agent: AgentConfig) -> EndpointConfig:
        """The agent's endpoint; for a pool agent, the pool's first member (the run places it on any member)."""
        pool = self.agent_pool(agent)
        if pool is not None:
            return self.endpoint(pool.endpoints[0])
        return self.endpoint(agent.endpoint) if agent.endpoint else self.endpoints[0]


ResolvedStall = ev.StallPolicy
"""The stall policy in force for one endpoint: its overrides on top of `[stall]`. The contract's record, so the
events and `set_stall` carry the engine's own value as it is."""


def resolve_stall(stall: StallConfig, endpoint: EndpointConfig) -> ResolvedStall:
    """Merge an endpoint's stall overrides over the `[stall]` defaults."""

    def pick(key: str) -> Any:
        value = getattr(endpoint, key)
        return value if value is not None else getattr(stall, key)

    first_byte = pick("first_byte_timeout_s")
    if first_byte is None:
        first_byte = DEFAULT_FIRST_BYTE_S[endpoint.kind]
    return ResolvedStall(
        first_byte_timeout_s=first_byte,
        idle_timeout_s=pick("idle_timeout_s"),
        warn_at=tuple(pick("warn_at")),
        liveness=pick("liveness"),
        extend_s=pick("extend_s"),
        max_extensions=pick("max_extensions"),
        extend_when_server_busy=pick("extend_when_server_busy"),
    )
