"""One request, one answer: `n` and `best_of` are refused in config (a clear line, no traceback), and a server
that streams several choices anyway (index 0, 1, 2 interleaved) has only choice 0 read, whether the engine reads
its streams itself or through its stream worker."""

from __future__ import annotations

import json

import pytest

from cerevisor_tui.config import validate
from cerevisor_tui.engine.engine import Engine
from tests.conftest import RawServer, chunk, cli_here, http_head


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


@pytest.mark.parametrize("key", ["n", "best_of"])
@pytest.mark.parametrize("where", ["endpoints", "agents"])
def test_a_config_asking_for_several_answers_is_refused_in_one_line(tmp_path, capsys, key, where):
    path = tmp_path / "run.toml"
    extra = f"extra_body = {{ {key} = 3 }}\n"
    path.write_text('[[endpoints]]\nname = "e"\nkind = "simulated"\n' + (extra if where == "endpoints" else "")
                    + '[[agents]]\nname = "a"\nprompt = "p"\n' + (extra if where == "agents" else ""))
    proc = cli_here(capsys, "run", str(path))
    assert proc.returncode == 2
    assert f"{key}: asks the server for several answers per request" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.anyio
async def test_a_stream_of_several_choices_gives_the_answer_of_choice_0_only(stream_process):
    async def three(reader, writer):
        writer.write(http_head(200, "text/event-stream"))
        for word in ("one ", "two ", "three"):
            for index in (0, 1, 2):
                writer.write(chunk(event({"choices": [{"index": index, "delta": {"content": f"{index}:{word}"},
                                                       "finish_reason": None}]})))
        writer.write(chunk(event({"choices": [{"index": 1, "delta": {}, "finish_reason": "length"}]})))
        writer.write(chunk(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"},
                                              {"index": 2, "delta": {"content": "2:late"}, "finish_reason": "stop"}]})))
        writer.write(chunk(b"data: [DONE]\n\n") + chunk(b""))
        await writer.drain()

    async with RawServer(three) as srv:
        engine = Engine(validate({"endpoints": [{"name": "e", "base_url": srv.base_url, "model": "m"}],
                                  "agents": [{"name": "a", "prompt": "p", "retries": 0}]}),
                        stream_process=stream_process)
        seen: list = []
        engine.subscribe(seen.append)
        assert await engine.run() == 0
    assert engine.agents["a"].output == "0:one 0:two 0:three"
    turn = next(e for e in seen if e.kind == "TurnFinished")
    assert turn.finish_reason == "stop"
