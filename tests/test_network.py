"""Our httpx clients read through endpoints/network.py's asyncio backend: TLS, bursts far larger than its
read buffer, and connections the server closes, all over real loopback sockets (both stream transports)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.endpoints.client import build_client, list_models
from cerevisor_tui.engine.engine import Engine
from tests.conftest import RawServer, chunk, http_head, read_request, sse_chunk, until

DONE = sse_chunk("", finish="stop") + b"data: [DONE]\n\n"


def one_agent(url: str, stream_process: bool, *, kind: str = "local", turns: int = 1) -> Engine:
    return Engine(validate({
        "stall": {"idle_timeout_s": 10, "first_byte_timeout_s": 10},
        "endpoints": [{"name": "box", "base_url": url, "kind": kind, "model": "m"}],
        "agents": [{"name": "a", "prompt": "hi", "turns": [f"more {i}" for i in range(turns - 1)], "retries": 0}],
    }), stream_process=stream_process)


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


async def three_words(reader, writer):
    writer.write(http_head(200, "text/event-stream"))
    for word in ("alpha ", "beta ", "gamma"):
        writer.write(chunk(sse_chunk(word)))
        await writer.drain()
    writer.write(chunk(DONE) + chunk(b""))
    await writer.drain()


@pytest.mark.anyio
async def test_an_https_endpoint_streams_over_tls(tmp_path, monkeypatch, stream_process):
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trusted by this test's clients (and a worker's, inherited)
    async with RawServer(three_words, ssl=context) as srv:
        engine = one_agent(srv.base_url, stream_process, kind="hosted", turns=2)
        assert await engine.run() == 0, engine.agents["a"].error
    assert engine.agents["a"].output == "alpha beta gamma" and srv.requests == 2


@pytest.mark.anyio
async def test_a_client_loads_the_trusted_cas_only_for_https_and_once(tmp_path, monkeypatch):
    """Loading them takes ~30 ms of CPU: a client of loopback servers (plain http) never pays it."""
    made: list[ssl.SSLContext] = []

    def create_ssl_context(**kwargs):
        made.append(real(**kwargs))
        return made[-1]

    real = httpx.create_ssl_context
    monkeypatch.setattr(httpx, "create_ssl_context", create_ssl_context)
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    async with RawServer(three_words) as plain, RawServer(three_words, ssl=context) as tls, \
            build_client(4) as client:
        for _ in range(2):  # each on a connection of its own: the server closes each after its answer
            assert (await client.post(plain.base_url + "/chat/completions", json={})).status_code == 200
        assert made == []
        for _ in range(2):
            assert (await client.post(tls.base_url + "/chat/completions", json={})).status_code == 200
        assert len(made) == 1 and tls.requests == 2


@pytest.mark.anyio
async def test_an_untrusted_certificate_is_a_clear_error(tmp_path, stream_process):
    cert, key = self_signed(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    async with RawServer(three_words, ssl=context) as srv:
        engine = one_agent(srv.base_url, stream_process, kind="hosted")
        assert await engine.run() == 1
    error = engine.agents["a"].error
    assert error.startswith("endpoint box: cannot connect") and "CERTIFICATE_VERIFY_FAILED" in error, error


@pytest.mark.anyio
async def test_a_burst_far_larger_than_the_read_buffer_arrives_whole(stream_process):
    """20,000 chunks (about 2 MiB) written at once: reading pauses and resumes the socket, nothing is lost."""
    words = [f"w{i} " for i in range(20_000)]

    async def burst(reader, writer):
        writer.write(http_head(200, "text/event-stream") + b"".join(chunk(sse_chunk(w)) for w in words)
                     + chunk(DONE) + chunk(b""))
        await writer.drain()

    async with RawServer(burst) as srv:
        engine = one_agent(srv.base_url, stream_process)
        assert await engine.run() == 0, engine.agents["a"].error
    st = engine.agents["a"]
    assert st.output == "".join(words) and st.tokens == len(words)


@pytest.mark.anyio
async def test_an_idle_connection_the_server_closed_is_not_reused():
    """A whole answer (content-length) leaves its connection idle in the pool; the server then closes it.
    The next request must open a new connection, not fail on the dead one."""
    connections: list[int] = []
    closed: list[int] = []

    async def serve(reader, writer):
        connections.append(1)
        await read_request(reader)
        body = b'{"data": [{"id": "m"}]}'
        writer.write(http_head(200, "application/json", length=len(body)) + body)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()  # after the answer, without a "connection: close"
        await writer.wait_closed()
        closed.append(1)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with build_client(4) as client:
            for _ in range(3):
                assert [m["id"] for m in await list_models(client, "box", url)] == ["m"]
                await until(lambda: len(closed) == len(connections), "the server to close the idle connection")
    finally:
        server.close()
    assert len(connections) == 3


@pytest.mark.anyio
async def test_connections_the_server_closed_after_each_answer_are_not_reused(stream_process):
    """The server closes every connection after its answer (without saying so): each turn opens a new one
    instead of failing on the dead one."""
    async with RawServer(three_words) as srv:
        engine = one_agent(srv.base_url, stream_process, turns=4)
        assert await engine.run() == 0, engine.agents["a"].error
    assert srv.requests == 4 and engine.agents["a"].output == "alpha beta gamma"
