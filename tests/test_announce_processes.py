"""Self-registration as a fleet does it: ``kvindex serve``, ``kvindex sim
--announce`` and API replicas over Redis as real processes, since leases,
kill -9, restarts and clean shutdowns only show between processes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from producer.announce import Announcer, AnnounceRefused

from .announce_kit import announcement, spec
from .conftest import EXIT_WITHIN, free_ports
from .test_e2e import until
from .test_scaleout import Process

# -- processes: kvindex serve and kvindex sim --announce -----------------------------


class Serve:
    """``kvindex serve`` on a free port with short leases; restartable on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_ports()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = workdir / "kvindex.yaml"
        self.config.write_text("api:\n  announce: {min_lease_seconds: 0.5, sweep_seconds: 0.1}\n")
        self.log_path = workdir / "serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvindex.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--config",
                    str(self.config),
                    "--log-level",
                    "info",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=EXIT_WITHIN)

    def log(self) -> str:
        return self.log_path.read_text()


class Sim:
    """``kvindex sim --announce`` for one engine on fixed ports (so it can come back)."""

    def __init__(self, url: str, workdir: Path, lease: float) -> None:
        self.args = [
            sys.executable,
            "-m",
            "kvindex.cli",
            "sim",
            "--engines",
            "1",
            "--base-port",
            str(free_ports(2)),
            "--announce",
            url,
            "--lease",
            str(lease),
            "--rate",
            "20",
            "--tick",
            "0.02",
        ]
        self.out = workdir / "sim.out"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.out, "a") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.DEVNULL)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        self.proc.wait(timeout=EXIT_WITHIN)


@pytest.fixture
def serve(tmp_path) -> Iterator[Serve]:
    server = Serve(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def sims(tmp_path) -> Iterator[list[Sim]]:
    started: list[Sim] = []
    yield started
    for sim in started:
        if sim.proc is not None and sim.proc.poll() is None:
            sim.kill()


async def _engine(client: httpx.AsyncClient, name: str = "sim-0") -> dict | None:
    try:
        answer = await client.get(f"/engines/{name}")
    except httpx.TransportError:
        return None
    return answer.json() if answer.status_code == 200 else None


def _gpu(state: dict | None) -> int:
    return sum(r["blocks"]["GPU"] for r in state["ranks"]) if state else 0


async def _holding(client: httpx.AsyncClient, instance: str | None = None) -> bool:
    state = await _engine(client)
    return _gpu(state) > 0 and (instance is None or state["lease"]["instance"] != instance)


async def _started(serve: Serve, sims: list[Sim], tmp_path: Path, lease: float, *extra: str) -> Sim:
    sim = Sim(serve.url, tmp_path, lease)
    sim.args += extra
    sims.append(sim)
    async with httpx.AsyncClient(base_url=serve.url, timeout=5) as client:
        await until(lambda: _ready(client), 20, "kvindex serve to be ready")
    sim.start()
    return sim


async def _ready(client: httpx.AsyncClient) -> bool:
    try:
        return (await client.get("/readyz")).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow
async def test_a_killed_engine_is_gone_after_its_lease_and_counted(serve, sims, tmp_path):
    sim = await _started(serve, sims, tmp_path, lease=1.5)
    async with httpx.AsyncClient(base_url=serve.url, timeout=5) as client:
        await until(lambda: _holding(client), 20, "the announced sim to publish blocks")
        assert (await _engine(client))["lease"]["lease_seconds"] == 1.5
        sim.kill()  # kill -9: no deregistration
        killed = time.monotonic()
        assert await _engine(client) is not None  # still leased
        await until(lambda: _absent(client), 5, "the killed engine to be dropped after its lease")
        assert time.monotonic() - killed >= 1.0  # its lease, not the kill, ended it
        stats = (await client.get("/stats")).json()
        metrics = (await client.get("/metrics")).text
    assert stats["stored_ranks"] == 0 and stats["blocks"]["GPU"] == 0  # residency dropped
    assert "kvindex_engine_leases_expired_total 1.0" in metrics
    assert serve.log().count("engine lease expired") == 1


async def _absent(client: httpx.AsyncClient) -> bool:
    return await _engine(client) is None


@pytest.mark.slow
async def test_a_restarted_engine_is_reannounced_and_its_residency_rebuilt(serve, sims, tmp_path):
    samples = tmp_path / "served.json"
    sim = await _started(serve, sims, tmp_path, 30, "--samples", str(samples))
    async with httpx.AsyncClient(base_url=serve.url, timeout=5) as client:
        await until(lambda: _served(samples), 20, "the first instance to serve prompts")
        old_prompt = json.loads(samples.read_text())["sim-0"][-1]
        await until(lambda: _holds(client, old_prompt), 20, "kvindex to hold its blocks")
        before = await _engine(client)
        sim.kill()  # kill -9, then the same engine comes back with other traffic
        sim.args = [*sim.args[: sim.args.index("--samples")], "--seed", "2"]
        sim.start()
        await until(
            lambda: _holding(client, before["lease"]["instance"]),
            20,
            "the restarted sim to be re-announced and hold blocks again",
        )
        # What the dead instance held is gone: residency is the new process's only.
        assert not await _holds(client, old_prompt)
        after = await _engine(client)
    assert after["lease"]["instance"] != before["lease"]["instance"]
    assert "restarted" in sim.out.read_text()
    assert _gpu(after) > 0


async def _served(samples: Path) -> bool:
    try:
        return bool(json.loads(samples.read_text()).get("sim-0"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


async def _holds(client: httpx.AsyncClient, tokens: list[int]) -> bool:
    answer = (await client.post("/prefix-match", json={"tokens": tokens})).json()
    return any(row["engine"] == "sim-0" and row["gpu_blocks"] > 0 for row in answer["engines"])


@pytest.mark.slow
async def test_a_clean_shutdown_deregisters_at_once(serve, sims, tmp_path):
    sim = await _started(serve, sims, tmp_path, lease=30)
    async with httpx.AsyncClient(base_url=serve.url, timeout=5) as client:
        await until(lambda: _holding(client), 20, "the announced sim to publish blocks")
        sim.kill(signal.SIGTERM)
        assert sim.proc.returncode == 0
        assert await _engine(client) is None  # gone before the sim exited, lease or not
        assert "kvindex_engine_leases_expired_total 0.0" in (await client.get("/metrics")).text


@pytest.mark.slow
async def test_an_announcer_registers_again_after_kvindex_restarts(serve, tmp_path):
    async with httpx.AsyncClient(base_url=serve.url, timeout=5) as client:
        await until(lambda: _ready(client), 20, "kvindex serve to be ready")
        body = spec("renewing")
        async with Announcer(serve.url, body, lease_seconds=0.6) as announcer:
            assert announcer.outcome == "registered"
            serve.stop()
            serve.start()  # forgets every announced engine
            await until(lambda: _named(client, "renewing"), 20, "the renewal to register again")
            assert announcer.outcome == "registered"
        assert await _engine(client, "renewing") is None  # closing deregistered it


async def _named(client: httpx.AsyncClient, name: str) -> bool:
    return await _engine(client, name) is not None


@pytest.mark.slow
async def test_an_announcer_is_refused_at_once_on_a_4xx(tmp_path):
    server = Serve(tmp_path)
    server.start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            await until(lambda: _ready(client), 20, "kvindex serve to be ready")
        with (
            pytest.raises(AnnounceRefused, match="block_size"),
            Announcer(server.url, spec(block_size=0)),
        ):
            pass
        # the sync form: renewals on a thread keep it past its lease, deregistered on exit
        with Announcer(server.url, spec("sync"), lease_seconds=0.5) as sync:
            assert sync.outcome == "registered"
            await asyncio.sleep(2.0)  # four leases
            assert sync.outcome == "renewed"
            async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
                assert await _named(client, "sync")
        async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
            assert not await _named(client, "sync")
    finally:
        server.stop()


def test_without_a_token_the_announcer_keeps_the_seed_and_says_seeded():
    keeps = Announcer("http://kvindex", {"name": "e", "hash_seed": "42"})
    sends = Announcer("http://kvindex", {"name": "e", "hash_seed": "42"}, token="t")
    assert keeps._body["spec"]["hash_seed"] is None and keeps._body["seeded"] is True
    assert sends._body["spec"]["hash_seed"] == "42" and sends._body["seeded"] is True
    assert keeps.instance != sends.instance


# -- scale-out: kvindex api replicas and a kvindex indexer worker over redis-server -----


@pytest.mark.slow
async def test_replicas_share_the_leases_and_one_of_them_expires_each(redis_server, tmp_path):
    config = tmp_path / "kvindex.yaml"
    config.write_text("api:\n  announce: {min_lease_seconds: 0.5, sweep_seconds: 0.1}\n")
    redis = ("--redis-url", redis_server.url, "--redis-prefix", f"ann-{uuid.uuid4().hex[:8]}")
    common = (*redis, "--config", str(config))
    ports = [free_ports(), free_ports()]
    worker = Process(tmp_path / "worker.log", "indexer", *common, "--worker-id", "w1")
    apis = [Process(tmp_path / f"api{p}.log", "api", *common, "--port", str(p)) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    clients = [httpx.AsyncClient(base_url=url, timeout=10) for url in urls]
    sims: list[Sim] = []
    try:
        for client in clients:
            await until(lambda c=client: _ready(c), 30, "both replicas")
        # one engine renews through whichever replica it reaches
        body = announcement(spec("roaming"), "r1", lease_seconds=30)
        first = await clients[0].post("/engines/announce", json=body)
        again = await clients[1].post("/engines/announce", json=body)
        assert (first.json()["outcome"], again.json()["outcome"]) == ("registered", "renewed")
        stale = await clients[1].delete("/engines/announce/roaming", params={"instance": "r0"})
        assert stale.status_code == 409
        gone = await clients[1].delete("/engines/announce/roaming", params={"instance": "r1"})
        assert gone.status_code == 200
        await until(lambda: _absent_on(clients, "roaming"), 10, "both replicas to forget it")

        sim = Sim(urls[0], tmp_path, lease=1.5)
        sims.append(sim)
        sim.start()
        await until(lambda: _holding(clients[1]), 30, "the worker to consume the announced sim")
        await until(lambda: _leased(clients[1]), 10, "replica 1 to show replica 0's lease")
        sim.kill()
        await until(lambda: _absent_on(clients, "sim-0"), 10, "the lapsed engine to be dropped")
        expired = [await _expired(client) for client in clients]
        assert sum(expired) == 1, expired  # one replica took the lapsed lease
        assert sum(p.log.read_text().count("engine lease expired") for p in apis) == 1
    finally:
        for sim in sims:
            if sim.proc.poll() is None:
                sim.kill()
        for client in clients:
            await client.aclose()
        for process in [*apis, worker]:
            process.stop()


async def _absent_on(clients: list[httpx.AsyncClient], name: str) -> bool:
    return all([await _engine(client, name) is None for client in clients])


async def _leased(client: httpx.AsyncClient) -> bool:
    state = await _engine(client)
    return bool(state and state["lease"] and state["lease"]["lease_seconds"] == 1.5)


async def _expired(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("kvindex_engine_leases_expired_total "):
            return float(line.split()[1])
    raise AssertionError("no kvindex_engine_leases_expired_total")
