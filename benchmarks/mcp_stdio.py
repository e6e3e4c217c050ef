"""What a large stdio tool result costs the run to read, side by side: the MCP SDK's `stdio_client` and our
transport (cerevisor_tui/tools/stdio.py), each under the SDK's `ClientSession`, calling the test server's
`flood` tool (tests/fixtures/mcp_fake.py --sdk, the SDK's own server side) for results of rising size.

The SDK's reader joins each 64 KiB chunk to all it holds of the line and splits the whole again, so one
message costs time quadratic in its length; ours appends to one buffer and looks for the line feed only in
the new chunk. The figure that matters is the client's CPU (this process's, the server's own work left out)
and the wall time of the call; rounds interleave (SDK, ours, then ours, SDK, ...). A result of N MB of text is
a message of about 2N MB (the SDK's server sends it as text and as structured content).

    python benchmarks/mcp_stdio.py                     # 1, 4 and 10 MB of text, 3 rounds
    python benchmarks/mcp_stdio.py --megabytes 10 20 --repeats 5

Measured on the 2-core dev box (2026-12-02, shared with other work), medians of 3 rounds:

    result   SDK cpu s  ours cpu s   ratio  SDK wall s  ours wall s
     1 MB        0.03        0.01    2.2x        0.03         0.02
     4 MB        0.34        0.03   13.3x        0.38         0.07
    10 MB        2.04        0.04   47.6x        4.01         0.18
    20 MB        6.29        0.16   40.1x       26.17         1.02   (a 40 MB message; --megabytes 20)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FAKE = str(ROOT / "tests" / "fixtures" / "mcp_fake.py")


async def open_session(stack: AsyncExitStack, which: str):
    from mcp import ClientSession

    if which == "sdk":
        from mcp.client.stdio import StdioServerParameters, stdio_client

        devnull = stack.enter_context(open(os.devnull, "w"))
        streams = await stack.enter_async_context(
            stdio_client(StdioServerParameters(command=sys.executable, args=[FAKE, "--sdk"]), errlog=devnull)
        )
    else:
        from cerevisor_tui.config.secrets import Scrubber
        from cerevisor_tui.tools.stdio import ServerLog, StdioServer

        server = StdioServer(
            sys.executable, [FAKE, "--sdk"], {}, None, log=ServerLog(None), scrub=Scrubber(), max_message_bytes=1 << 31
        )
        streams = await stack.enter_async_context(server.connect())
    session = await stack.enter_async_context(ClientSession(*streams))
    await session.initialize()
    return session


async def one_call(session, megabytes: int) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = await session.call_tool("flood", {"megabytes": megabytes})
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert len(result.content[0].text) == megabytes * 1_000_000, "the whole result arrived"
    return cpu, wall


async def main(sizes: list[int], repeats: int) -> None:
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    async with AsyncExitStack() as stack:
        sessions = {which: await open_session(stack, which) for which in ("sdk", "ours")}
        for megabytes in sizes:
            for r in range(repeats):
                order = ("sdk", "ours") if r % 2 == 0 else ("ours", "sdk")
                for which in order:
                    figures.setdefault((which, megabytes), []).append(
                        await one_call(sessions[which], megabytes)
                    )
    print(
        f"{'result':>8}  {'SDK cpu s':>10}  {'ours cpu s':>10}  {'ratio':>6}  {'SDK wall s':>10}  {'ours wall s':>11}"
    )
    for megabytes in sizes:
        sdk, ours = figures[("sdk", megabytes)], figures[("ours", megabytes)]
        sdk_cpu, ours_cpu = statistics.median(c for c, _ in sdk), statistics.median(c for c, _ in ours)
        sdk_wall, ours_wall = statistics.median(w for _, w in sdk), statistics.median(w for _, w in ours)
        print(
            f"{megabytes:>5} MB  {sdk_cpu:>10.2f}  {ours_cpu:>10.2f}  {sdk_cpu / ours_cpu:>5.1f}x  "
            f"{sdk_wall:>10.2f}  {ours_wall:>11.2f}"
        )
    print(f"(medians of {repeats} rounds; cpu: this client process only)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--megabytes", type=int, nargs="+", default=[1, 4, 10], help="result sizes, MB of text"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    anyio.run(main, args.megabytes, args.repeats)
