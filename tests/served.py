"""A real ``kvindex serve`` process for memory tests: its port, its pid, its memory.

Its own process, so that what the test's clients and engines hold does not
count in the memory measured (``/proc/PID/status``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from .conftest import free_ports


def memory(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since :func:`reset_peak`) of ``pid``, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak(pid: int) -> int:
    """Start measuring ``pid``'s peak from now; its resident memory now."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory(pid, "VmRSS")


def get(port: int, path: str) -> Any:
    """The JSON answer of ``GET path`` (a server applying a flood may take seconds to
    get to it on a loaded machine)."""
    answer = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)
    answer.raise_for_status()
    return answer.json()


def poll(port: int, path: str, ready: Callable[[Any], bool], what: str, within: float = 300) -> Any:
    """The JSON answer of ``GET path`` once ``ready`` holds of it. A server applying a
    flood on a busy machine can take longer than any one request's timeout to answer: an
    answer that timed out is not one yet, until ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        with contextlib.suppress(httpx.TimeoutException):
            if ready(answer := get(port, path)):
                return answer
        assert time.monotonic() < deadline, f"{what}: not within {within:.0f} s"
        time.sleep(0.05)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def serve(config: Path, *args: str) -> Iterator[tuple[int, int]]:
    """``kvindex serve --config config`` until the block ends: its port and pid."""
    port = free_ports()
    argv = [sys.executable, "-m", "kvindex.cli", "serve", "--port", str(port), *args]
    proc = subprocess.Popen([*argv, "--config", str(config)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not healthy(port):
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)
        yield port, proc.pid
    finally:
        proc.terminate()
        proc.wait(15)
