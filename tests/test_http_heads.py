"""Unfinished request heads cannot exhaust the server's memory.

A real ``kvindex serve`` process takes many connections that each send a
long head and never finish it; its resident memory (``/proc/PID/status``)
grows by what the settings promise (``api.head_bytes`` across connections,
nothing for connections beyond ``api.max_connections``), not by what the
clients send, and falls back near where it was once they are gone. Unbounded,
120 heads of 1 MB cost about 130 MB, and a fifth of it stayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import served
from .conftest import wait_until
from .served import healthy, memory, reset_peak

MB = 1 << 20
CONNECTIONS = 120
HEAD = b"GET /healthz HTTP/1.1\r\nHost: kvindex\r\nX-Pad: " + b"a" * MB  # never ended
#: Write a head in pieces, as a client on a real network does.
PIECE = 64 << 10
#: The server's growth besides the heads: h11's buffers round up (an eighth),
#: a socket read in hand, the connections' own objects, allocator slack.
SLACK = 24 * MB
#: What may stay once every connection is gone: near the baseline.
LEFT = 8 * MB


@contextlib.contextmanager
def serve(tmp_path: Path, **api: int) -> Iterator[tuple[int, int]]:
    """``kvindex serve`` with these ``api`` settings: its port and pid."""
    config = tmp_path / "kvindex.yaml"
    config.write_text("api:\n" + "".join(f"  {k}: {v}\n" for k, v in api.items()))
    with served.serve(config) as running:
        yield running


async def slow_head(port: int, writers: list[asyncio.StreamWriter]) -> None:
    """Send most of a head, piece by piece, until the server stops taking it."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writers.append(writer)
    with contextlib.suppress(OSError, TimeoutError):
        for start in range(0, len(HEAD), PIECE):
            writer.write(HEAD[start : start + PIECE])
            await asyncio.wait_for(writer.drain(), 10)


def unread(port: int) -> int:
    """Bytes sent to ``port`` over loopback that its server has not read yet: its
    sockets' receive queues and its clients' send queues (``/proc/net/tcp``)."""
    total, suffix = 0, f":{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, remote, _, queues = line.split()[1:5]
        sent, received = (int(q, 16) for q in queues.split(":"))
        total += received if local.endswith(suffix) else sent if remote.endswith(suffix) else 0
    return total


async def attack(port: int, pid: int) -> tuple[int, int]:
    """Growth of the server's peak memory during the attack, and of its memory after."""
    before = reset_peak(pid)
    writers: list[asyncio.StreamWriter] = []
    await asyncio.gather(*(slow_head(port, writers) for _ in range(CONNECTIONS)))
    await wait_until(lambda: unread(port) == 0, 30, "the server to read what was sent")
    grew = memory(pid, "VmHWM") - before
    for writer in writers:
        writer.close()
    deadline = time.monotonic() + 10  # the server frees each as it sees it closed
    while memory(pid, "VmRSS") - before >= LEFT and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return grew, memory(pid, "VmRSS") - before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("api", "promised"),
    [
        ({"head_bytes": 16 * MB}, 16 * MB),  # the budget across connections
        ({"max_connections": 12}, 12 * len(HEAD)),  # beyond the limit nothing is buffered
    ],
    ids=["head_bytes", "max_connections"],
)
async def test_unfinished_heads_hold_what_the_settings_promise(
    tmp_path: Path, api: dict[str, int], promised: int
) -> None:
    with serve(tmp_path, header_timeout=30, **api) as (port, pid):
        grew, left = await attack(port, pid)
        await wait_until(lambda: healthy(port), 10, "serving as before")
    assert grew < promised + SLACK, (
        f"peak grew {grew / MB:.0f} MB for {CONNECTIONS} heads of 1 MB; the settings"
        f" promise {promised / MB:.0f} MB (+{SLACK / MB:.0f} MB slack)"
    )
    assert left < LEFT, f"{left / MB:.0f} MB still held after the connections closed"


async def test_a_connection_beyond_the_limit_is_answered_before_it_sends(tmp_path: Path) -> None:
    with serve(tmp_path, max_connections=2) as (port, _):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 10)  # up to EOF, having sent nothing
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too many connections" in answer
        for _, other in [*held, (reader, writer)]:
            other.close()
        await wait_until(lambda: healthy(port), 10, "a connection is free again")


async def test_with_the_budget_full_whole_heads_are_served_and_partial_ones_refused(
    tmp_path: Path,
) -> None:
    with serve(tmp_path, head_bytes=MB, header_timeout=30) as (port, _):
        _, holder = await asyncio.open_connection("127.0.0.1", port)
        holder.write(HEAD[: MB - 1024])  # holds the budget but for 1 KiB
        await holder.drain()
        await wait_until(lambda: unread(port) == 0, 30, "the server to read the head")
        assert healthy(port)  # a whole head in one read: parsed at once, never held
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(HEAD[: 4 << 10])  # would take the heads over the budget
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too many request heads" in answer
        for other in (holder, writer):
            other.close()
