"""Read a server's /metrics as fast as it answers, with the product's parser, until killed.

Run as a separate process (`python -m tests.integration.poll_metrics ROOT_URL OUT`) so that parsing
vLLM's large exposition text many times a second does not slow the engine under test, whose event loop
would otherwise share the CPU time with it. Each read appends one JSON line to OUT.
"""

from __future__ import annotations

import json
import sys
import time

import httpx

from cerevisor_tui.endpoints.metrics import parse_metrics


def main(root_url: str, out_path: str, interval_s: float = 0.005) -> None:
    with httpx.Client(timeout=5) as client, open(out_path, "a", encoding="utf-8") as out:
        while True:
            try:
                m = parse_metrics(client.get(f"{root_url}/metrics").text)
            except httpx.HTTPError:
                time.sleep(interval_s)
                continue
            out.write(json.dumps({"kv": m.kv_cache_usage, "waiting": m.requests_waiting,
                                  "running": m.requests_running, "preemptions": m.preemptions}) + "\n")
            out.flush()
            time.sleep(interval_s)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
