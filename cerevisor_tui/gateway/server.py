"""The gateway's HTTP face: an ASGI app (served by uvicorn inside the run's process) that passes the three APIs
through to the run's endpoints, each request an attempt of its session, governed by the run.

Here a request is checked once, at the entry: its path (gateway/paths.py), its key, its size and JSON, its
model and route; every byte to the client goes through one scrubbing send (gateway/outbound.py). A governed
request then lives in its `Exchange` (gateway/exchange.py); any other /v1/* request is passed through.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hmac
import os
from typing import Any

import anyio
import httpx
import msgspec

from cerevisor_tui.config.models import GatewayConfig
from cerevisor_tui.gateway import apis
from cerevisor_tui.gateway.apis import Api
from cerevisor_tui.gateway.edge import (
    RETRY_AFTER_S,
    Receive,
    Refusal,
    Scope,
    Send,
    answer,
    problem_of,
    upstream_headers,
)
from cerevisor_tui.gateway.exchange import Exchange, RunPorts
from cerevisor_tui.gateway.outbound import ClientSend, log_line
from cerevisor_tui.gateway.paths import PathProblem, check_path
from cerevisor_tui.text import control_char, printable


class GatewayError(Exception):
    """The gateway cannot start: one line says why."""


def client_keys(settings: GatewayConfig) -> list[tuple[str, bytes]]:
    """The accepted client keys, each with the name of the variable that holds it. Raises GatewayError for a
    variable that is not set."""
    keys = []
    for name in settings.keys_env:
        value = os.environ.get(name, "")
        if not value.strip():
            raise GatewayError(f"[gateway] keys_env: environment variable {name} is not set")
        keys.append((name, value.strip().encode()))
    return keys


class Gateway:
    """The ASGI app. `run`: the ports of the run that governs it (gateway/serve.py); `model` (`--model`) sends every request to one model."""

    def __init__(self, run: RunPorts, settings: GatewayConfig, *, model: str = "") -> None:
        self.run = run
        self.settings = settings
        self.model = model
        self.keys = client_keys(settings)
        self.max_body = int(settings.max_body_mib * (1 << 20))
        self.upstream = settings.upstream or run.config.endpoints[0].name
        self.passed = 0  # other /v1/* requests passed through ungoverned
        self.refused = 0  # requests the gateway answered itself (401, 400, 404, 405, 413, 503)
        self.failed = 0  # requests that met an error nobody foresaw (answered 500 in the API's shape, logged)

    # ---- ASGI ---------------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan, websockets: nothing to serve
            return
        if not self.run.sessions.ready.is_set():  # (a set anyio Event's wait still yields a loop turn)
            await self.run.sessions.ready.wait()  # the run's connections are open (a request may come before)
        client = ClientSend(send, self.run.scrub)  # every byte to the client goes through it: no run key in it
        raw = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        api: Api | None = next((a for suffix, a in apis.PATHS.items() if raw.endswith(suffix.encode())), None)
        try:
            try:  # the one path rule, before any routing: what is routed on is what the upstream is sent
                path, label = check_path(raw)
            except PathProblem as exc:
                log_line(self.run.scrub, f"refused {scope['method']} {raw[:200]!r}: {exc}")
                raise Refusal(400, f"cerevisor gateway: {exc}") from None
            if not path.startswith("/v1/"):
                raise Refusal(404, f"no such path {path!r}: the gateway serves /v1/*")
            api = apis.PATHS.get(path[3:])
            if api is not None and scope["method"] != "POST":
                raise Refusal(405, f"{path} takes POST, not {printable(scope['method'])}", {"allow": "POST"})
            key = self._check_key(scope)
            if api is None:
                await self._pass(scope, receive, client, path)
                return
            body = await self._body(scope, receive, api)
            await Exchange(self, scope, receive, client, api, body, label=label, key=key).run()
        except Refusal as exc:
            self.refused += 1
            if not client.started:
                await answer(client, exc.status, apis.error_body(api, exc.status, exc.message), exc.headers)
        except Exception as exc:  # an error nobody foresaw: an answer in the API's shape and a line in the log
            self.failed += 1
            log_line(self.run.scrub, f"{scope['method']} {raw[:200]!r} failed: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):  # the client may be gone: nothing more to tell it
                await client.error(api, 500, "cerevisor gateway: the request met an internal error (the run's log "
                                             "says which); nothing more was sent upstream")

    def _check_key(self, scope: Scope) -> str:
        """The name of the client key the request carries; "" when none is asked. Refusal 401 otherwise."""
        if not self.keys:
            return ""
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
            elif name == b"x-api-key" and not given:
                given = value.strip()
        found = ""
        for name, key in self.keys:  # each compared in constant time, and every one compared
            if hmac.compare_digest(given, key) and not found:
                found = name
        if not found:
            raise Refusal(401, "missing or wrong API key for this gateway (send Authorization: Bearer KEY or "
                               "x-api-key: KEY, with a key from its keys_env)")
        return found

    async def _body(self, scope: Scope, receive: Receive, api: Api) -> tuple[bytes, dict[str, Any]]:
        limit = self.max_body
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise Refusal(413, f"request body of {int(value):,} bytes is over the gateway's limit of "
                                   f"{limit:,} ([gateway] max_body_mib)")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Refusal(499, "the client went away")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise Refusal(413, f"request body over the gateway's limit of {limit:,} bytes "
                                   "([gateway] max_body_mib)")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        raw = b"".join(chunks)
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise Refusal(400, f"the request body is not JSON: {exc}") from None
        except RecursionError:  # nested past msgspec's own depth
            body = None
            problem: str | None = f"the request body nests deeper than {apis.MAX_DEPTH} levels"
        else:
            problem = "the request body must be a JSON object" if not isinstance(body, dict) else \
                apis.request_problem(api, body)
        if problem is not None:
            log_line(self.run.scrub, f"refused a {api} request: {problem}")
            raise Refusal(400, f"the request is not one of the {api} API: {problem}")
        assert isinstance(body, dict)
        return raw, body

    # ---- models and routes --------------------------------------------------------------------------------
    def served_models(self) -> dict[str, str]:
        """Each model the run's endpoints serve, with the endpoint (or the pool) that serves it."""
        models = self.run.connections.models
        served: dict[str, str] = {}
        for pool in self.run.config.pools:
            for member in pool.endpoints:
                if member in models:
                    served.setdefault(models[member], pool.name)
        for name, model in models.items():
            served.setdefault(model, name)
        return served

    def route(self, asked: str) -> tuple[str, str]:
        """The model sent upstream for `asked` and the endpoint or pool that serves it. Refusal 404 when it is
        neither served nor mapped, 400 when it holds a control character (it is shown on the operator's screen)."""
        bad = control_char(asked)
        if bad is not None:
            raise Refusal(400, f"the model name holds a control character (U+{ord(bad):04X}): "
                               f"{printable(asked[:100])!r}")
        glob = next((glob for glob in self.settings.model_map if fnmatch.fnmatchcase(asked, glob)), None)
        model = self.model or (self.settings.model_map[glob] if glob is not None else asked)
        served = self.served_models()
        if model in served:
            return model, served[model]
        default_known = any(name in self.run.connections.models for name in self._members(self.upstream))
        if not default_known:  # its model is not known yet (a server still loading): it goes there as asked
            return model, self.upstream
        listed = ", ".join(sorted(served)) or "none"
        if model != asked:  # the gateway's own mapping (or --model) is the problem, not the client's model
            raise Refusal(404, f"model {asked!r} goes to {model!r} (the gateway's --model or [gateway] model_map), "
                               f"which its upstream does not serve (served: {listed}); restart the gateway with "
                               "one of those")
        raise Refusal(404, f"model {asked!r} is not served here (served: {listed}); map it with [gateway] model_map "
                           "or start the gateway with --model")

    def model_problem(self) -> str:
        """Which models the gateway sends requests to (its --model, its model_map) the upstream does not serve, once
        the upstream has said what it serves; "" when it serves them all (or has not answered yet)."""
        served = self.served_models()
        known = any(name in self.run.connections.models for name in self._members(self.upstream))
        targets = sorted({self.model} if self.model else set(self.settings.model_map.values()))
        missing = [target for target in targets if target not in served]
        if not known or not missing:
            return ""
        return (f"{', '.join(repr(m) for m in missing)} (its --model or [gateway] model_map) not served by the upstream "
                f"(served: {', '.join(sorted(served)) or 'none'}): requests sent there are refused with 404 until the "
                "gateway is restarted with one of those")

    def _members(self, name: str) -> list[str]:
        pool = self.run.config.pool(name)
        return list(pool.endpoints) if pool is not None else [name]

    def _pass_order(self) -> list[str]:
        """The members a pass-through request is offered to, in turn while each refuses the connection: those up
        and not degraded first, then those degraded, then those down (engine/placement.py), each in pool order."""
        placement, now = self.run.placement, self.run.clock.now()
        return sorted(self._members(self.upstream),
                      key=lambda m: (placement.is_down(m, now), placement.is_degraded(m, now)))

    async def resolve_models(self) -> None:
        """Ask each endpoint once which model it serves (those the config does not name), so routes know."""
        connections = self.run.connections
        for ep in self.run.config.endpoints:
            if ep.name not in connections.models:
                with contextlib.suppress(Exception), self.run.clock.move_on_after(5):
                    await connections.model(ep)

    # ---- everything else under /v1 -------------------------------------------------------------------------
    async def _pass(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """A /v1/* request the gateway does not govern (GET /v1/models among them): passed to the upstream
        and back as it is, as it comes (a streamed /v1/completions streams), counted; a client that goes away
        ends it."""
        self.passed += 1
        connections = self.run.connections
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if sum(map(len, chunks)) > self.max_body:
                raise Refusal(413, "request body over the gateway's limit ([gateway] max_body_mib)")
            if not message.get("more_body"):
                break
        query = scope.get("query_string", b"").decode("latin-1")
        headers = upstream_headers(scope["headers"])
        problem = ""
        gone = anyio.Event()
        async with anyio.create_task_group() as group:

            async def watch_client() -> None:  # from the start: a client gone before the upstream answers ends it too
                while (await receive())["type"] != "http.disconnect":
                    pass
                gone.set()
                group.cancel_scope.cancel()

            group.start_soon(watch_client)
            response: httpx.Response | None = None
            for endpoint in self._pass_order():
                url = connections.base_urls[endpoint].rstrip("/") + path[3:]
                client = connections.clients[endpoint]
                request = client.build_request(scope["method"], url + (f"?{query}" if query else ""),
                                               content=b"".join(chunks), headers=headers)
                try:
                    response = await client.send(request, stream=True)
                    break
                except httpx.HTTPError as exc:
                    problem = f"{endpoint} is not answering: {problem_of(exc)}"
                    if not isinstance(exc, httpx.ConnectError):  # it may have reached the server: never sent twice
                        break
            if response is not None:
                try:
                    content_type = response.headers.get("content-type", "application/json")
                    await send({"type": "http.response.start", "status": response.status_code,
                                "headers": [(b"content-type", content_type.encode("latin-1"))]})
                    with contextlib.suppress(httpx.HTTPError):  # cut short upstream: the client sees it cut short
                        async for chunk in response.aiter_raw():
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b""})
                finally:
                    with anyio.CancelScope(shield=True):
                        await response.aclose()
            group.cancel_scope.cancel()
        if response is None and not gone.is_set():
            raise Refusal(503, f"upstream {problem}", {"retry-after": str(RETRY_AFTER_S)})

