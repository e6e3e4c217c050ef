"""Checks shared by the vLLM and llama.cpp tests."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from tests.integration.conftest import cerevisor, jsonl, workflow, write_config
from tests.integration.servers import ServerProcess
from tests.integration.usage_proxy import UsageProxy


def run_workflow_through_proxy(server: ServerProcess, tmp_path: Path,
                               counters: Callable[[], tuple[float, float]], *,
                               stream_process: bool = False) -> dict[str, Any]:
    """Run the two-wave workflow headless through a recording proxy; check the report against the wire.

    `counters()` reads the server's own (prompt tokens, generation tokens) counters from /metrics, a
    second witness next to the usage chunks. `stream_process`: the streams read by the worker process.
    """
    with UsageProxy(server.root_url) as proxy:
        config = workflow(proxy.base_url)
        config["run"]["stream_process"] = "on" if stream_process else "off"
        path = write_config(tmp_path / "workflow.toml", config)
        prompt_before, generated_before = counters()
        proc = cerevisor("run", str(path), "--report", str(tmp_path / "report.json"), "--jsonl",
                         "--run-dir", str(tmp_path / "run"), timeout=600)
        prompt_after, generated_after = counters()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    events = jsonl(proc.stdout)
    agents = {a["name"]: a for a in report["agents"]}
    configured = {a["name"]: a for a in config["agents"]}

    # every agent completed every turn, in two waves, some of them at the same time
    assert {name: a["status"] for name, a in agents.items()} == dict.fromkeys(configured, "completed")
    assert {name: a["wave"] for name, a in agents.items()} == {
        "scout_a": 0, "scout_b": 0, "scout_c": 0, "judge": 1, "writer": 1}
    turns = {name: 1 + len(a.get("turns", [])) for name, a in configured.items()}
    assert {name: a["turns"] for name, a in agents.items()} == turns
    assert report["totals"]["max_running"] >= 2
    order = [e["event"] + ":" + str(e.get("wave", "")) for e in events if e["event"] in ("WaveStarted", "WaveFinished")]
    assert order == ["WaveStarted:0", "WaveFinished:0", "WaveStarted:1", "WaveFinished:1"]

    # the report's token counts are what the server's usage chunks said, agent by agent
    seen = proxy.by_agent()
    assert set(seen) == set(configured)
    for name, agent in agents.items():
        chunks, prompt, completion = seen[name]
        assert chunks == turns[name], (name, chunks)
        assert (agent["prompt_tokens"], agent["completion_tokens"]) == (prompt, completion), name
        # the tiny model never ends early: each turn runs to max_tokens
        assert completion == turns[name] * configured[name]["max_tokens"], name
    finished = [e for e in events if e["event"] == "TurnFinished"]
    assert Counter(e["agent"] for e in finished) == Counter(turns)
    assert all(e["finish_reason"] == "length" for e in finished)
    totals = report["totals"]
    total_prompt = sum(u.prompt_tokens for u in proxy.usages)
    total_completion = sum(u.completion_tokens for u in proxy.usages)
    assert totals["output_tokens"] == total_completion == sum(a["completion_tokens"] for a in agents.values())

    # and what the server counted itself
    assert generated_after - generated_before == total_completion
    assert prompt_after - prompt_before == total_prompt
    return report


def engine_for(config: dict[str, Any], *, stream_process: bool = False) -> Engine:
    return Engine(validate(config), stream_process=stream_process)


async def run_engine(engine: Engine, on_event: Callable[[Any], None] | None = None,
                     timeout_s: float = 300) -> tuple[int, list[Any]]:
    seen: list[Any] = []

    def subscriber(event: Any) -> None:
        seen.append(event)
        if on_event is not None:
            on_event(event)

    engine.subscribe(subscriber)
    with anyio.move_on_after(timeout_s) as bound:
        code = await engine.run()
    if bound.cancelled_caught:  # a run that never ended: where it stopped is the only clue the failure leaves
        raise AssertionError(f"the run did not end within {timeout_s:g} s; its events but tokens and samples:\n"
                             + "\n".join(story(seen)))
    return code, seen


def story(seen: list[Any]) -> list[str]:
    """A run's events, one a line, timed from its first, without the many (tokens, samples, keep-alives)."""
    start = seen[0].t if seen else 0.0
    return [f"{e.t - start:8.2f} {e.kind} {getattr(e, 'agent', '')} {getattr(e, 'attempt', '')} "
            f"{getattr(e, 'reason', '') or getattr(e, 'cause', '') or getattr(e, 'why', '')}".rstrip()
            for e in seen if e.kind not in ("TokenDelta", "ServerSample", "KeepAlive", "MessageRecorded")]


def timed_busy_check(engine: Engine, log: list[tuple[float, str | None]]):
    """The engine's own busy check, recording how long each call took and what it said (for failures)."""
    busy_check = engine.monitor.busy

    async def timed(endpoint: str, since: float) -> str | None:
        started, answer = time.monotonic(), None
        try:
            answer = await busy_check(endpoint, since)
            return answer
        finally:
            log.append((round(time.monotonic() - started, 2), answer))
    return timed


class RanToItsEnd:
    """For a kill test on vLLM: whether vLLM could have acted on the kill.

    vLLM notices a client gone only when its API server next waits for its engine, and two things keep it from
    waiting; its own figures tell both, read once the request has ended:
    - It had run the answer to its end before the kill (about 1,000 tokens/s here, its threads on both cores, it
      sometimes answers a stream's first token only as the whole answer is done): nothing is left to abort. A
      request that finished by length, whose end-to-end latency from its arrival is shorter than the time from our
      sending it to our kill.
    - Its API server was behind its engine: on a loaded host (its engine, its API server and this test on two
      cores) the answer's tokens wait queued in the API server, which then streams them to the closed socket
      without waiting and the request runs to its length, no abort logged. Reproduced with two busy loops beside
      vLLM (2 kills of 8: the engine made its first token 0.01 s after the request came, we read it 3.5 s and 4.7 s
      after sending; CI saw 2.2 s and 4.4 s). A request that finished by length, whose first token the engine made
      (queue and prefill time after its arrival) more than BEHIND_S before we read it.
    A kill that failed to stop a request vLLM was keeping pace with reads the other way round, and fails.
    """

    BEHIND_S = 1.0

    def __init__(self, *servers: ServerProcess) -> None:
        self.servers = servers
        self.before = self._figures()
        self.generated_before = self.generated_tokens()
        self.sent_at = self.killed_at = 0.0
        self.finished = self.latency_s = self.first_token_s = 0.0

    def _figures(self) -> tuple[float, float, float]:
        def total(name: str, **labels: str) -> float:
            return sum(s.metric(name, **labels) for s in self.servers)

        return (total("vllm:request_success_total", finished_reason="length"),
                total("vllm:e2e_request_latency_seconds_sum"),
                total("vllm:request_queue_time_seconds_sum") + total("vllm:request_prefill_time_seconds_sum"))

    def generated_tokens(self) -> float:
        """The servers' output tokens so far (since this was made: less `generated_before`)."""
        return sum(s.metric("vllm:generation_tokens_total") for s in self.servers)

    async def why_vllm_could_not_act(self) -> str:
        """Once the servers run nothing (the request ended, by its abort or its length): why vLLM could not have
        acted on the kill (it had run the answer to its end before it, or was behind on it), or "" if it could."""
        from tests.conftest import until

        await until(lambda: all(s.metric("vllm:num_requests_running") == 0 for s in self.servers),
                    "vLLM to run nothing (the killed request still running)", timeout=30, interval=0.2)
        finished, latency, first_token = self._figures()
        self.finished, self.latency_s = finished - self.before[0], latency - self.before[1]
        self.first_token_s = first_token - self.before[2]
        kill_after = self.killed_at - self.sent_at
        if self.finished != 1:
            return ""
        if 0 < self.latency_s < kill_after:
            return f"vLLM had run the answer to its end before the kill ({self})"
        if kill_after - self.first_token_s > self.BEHIND_S:
            return (f"vLLM's API server was behind its engine at the kill: it streamed queued tokens to the closed "
                    f"socket without waiting, so could not see it closed ({self})")
        return ""

    def __str__(self) -> str:
        return (f"kill {self.killed_at - self.sent_at:.3f} s after sending; requests that ran to their length: "
                f"{self.finished:.0f}, their first token made {self.first_token_s:.3f} s and their end "
                f"{self.latency_s:.3f} s after they came")


KILL_TRIES = 3


async def killed_where_vllm_could_act(servers: tuple[ServerProcess, ...], config: dict[str, Any], *,
                                      stream_process: bool = False) -> tuple[Engine, list[Any], RanToItsEnd]:
    """A run of `config`'s one agent, killed by the operator at its first token; tried again (up to KILL_TRIES runs)
    while the kill landed where vLLM could not act on it (RanToItsEnd), the test skipped with each reason if none
    did. Returns the run whose kill vLLM could act on, its events and its figures, once `servers` run nothing."""
    import pytest

    from cerevisor_tui.contract import commands as cmd

    could_not: list[str] = []
    for _ in range(KILL_TRIES):
        engine = engine_for(config, stream_process=stream_process)
        agent = engine.config.agents[0].name
        ran_out = RanToItsEnd(*servers)

        def on_event(event: Any, engine: Engine = engine, ran_out: RanToItsEnd = ran_out) -> None:
            if event.kind == "AgentStarted":
                ran_out.sent_at = event.t
            elif event.kind == "TokenDelta" and not ran_out.killed_at:  # at once: vLLM may run well ahead
                ran_out.killed_at = time.monotonic()
                engine.handle(cmd.Kill(agent=agent, reason="killed by the test"))

        code, seen = await run_engine(engine, on_event)
        assert code == 1, [e for e in seen if e.kind in ("AgentKilled", "AgentFinished")]
        killed = [e for e in seen if e.kind == "AgentKilled"]
        assert len(killed) == 1 and killed[0].deadline == "operator" and killed[0].reason == "killed by the test"
        why = await ran_out.why_vllm_could_not_act()
        if not why:
            return engine, seen, ran_out
        could_not.append(why)
    pytest.skip("; ".join(could_not))
