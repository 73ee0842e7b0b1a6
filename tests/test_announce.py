"""Self-registration: announcements, leases, restarts and clean shutdowns.

The API rules run against the app with the real subscriber (engines publish
on local ports); the lease, kill -9 and restart cases run ``kvindex serve`` and
``kvindex sim --announce`` as processes, exactly as a fleet would.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from api import ApiSettings
from indexer.leases import LeaseRules
from producer.announce import Announcer, AnnounceRefused

from .apikit import LiveApi, engine
from .conftest import free_ports
from .test_e2e import until
from .test_scaleout import Process

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
FAST = LeaseRules(min_lease_seconds=0.2, default_lease_seconds=5, sweep_seconds=0.05)


def spec(name: str = "e", **fields) -> dict:
    return {"name": name, "endpoint": f"tcp://127.0.0.1:{free_ports()}", **fields}


def announcement(body: dict, instance: str = "i1", **fields) -> dict:
    return {"spec": body, "instance": instance, **fields}


@pytest.fixture
async def live() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(announce=FAST)) as api:
        yield api


@pytest.fixture
async def guarded() -> AsyncIterator[LiveApi]:
    async with LiveApi(ApiSettings(announce=FAST, auth_token=TOKEN)) as api:
        yield api


async def test_an_announcement_registers_renews_restarts_and_updates(live):
    body = spec(block_size=32)
    first = await live.client.post("/engines/announce", json=announcement(body))
    assert first.status_code == 200, first.text
    assert first.json() == {
        "name": "e",
        "instance": "i1",
        "lease_seconds": 5.0,
        "outcome": "registered",
    }
    assert [s.name for s in live.registry.all()] == ["e"]
    again = await live.client.post("/engines/announce", json=announcement(body))
    assert again.json()["outcome"] == "renewed"
    restarted = await live.client.post("/engines/announce", json=announcement(body, "i2"))
    assert restarted.json()["outcome"] == "restarted"
    changed = {**body, "block_size": 16}
    updated = await live.client.post("/engines/announce", json=announcement(changed, "i2"))
    assert updated.json()["outcome"] == "updated"
    assert live.registry.get("e").block_size == 16
    state = (await live.client.get("/engines/e")).json()
    assert state["lease"]["instance"] == "i2"
    assert 0 < state["lease"]["expires_in"] <= 5.0


async def test_the_lease_asked_for_is_clamped_to_the_configured_bounds(live):
    short = await live.client.post(
        "/engines/announce", json=announcement(spec("a"), lease_seconds=0.01)
    )
    long = await live.client.post(
        "/engines/announce", json=announcement(spec("b"), lease_seconds=1e9)
    )
    assert (short.json()["lease_seconds"], long.json()["lease_seconds"]) == (0.2, 300.0)


async def test_a_lapsed_lease_drops_the_engine_and_its_residency(live):
    from indexer import metrics

    expired = metrics.LEASES_EXPIRED._value.get()
    (publisher,) = await live.add_published("hand")  # hand-registered: never expires
    await live.client.post("/engines/announce", json=announcement(spec("e"), lease_seconds=0.2))
    await until(
        lambda: _names(live, {"hand"}), timeout=5, what="the announced engine to be dropped"
    )
    assert metrics.LEASES_EXPIRED._value.get() == expired + 1
    assert (await live.client.get("/engines/e")).status_code == 404
    assert (await live.client.get("/engines/hand")).json()["lease"] is None
    publisher.close()


async def _names(live: LiveApi, expected: set[str]) -> bool:
    return {s.name for s in live.registry.all()} == expected


async def test_a_new_spec_the_subscriber_refuses_leaves_the_old_registration(live):
    body = spec()
    await live.client.post("/engines/announce", json=announcement(body))
    with socket.socket() as taken:  # the subscriber must bind this port, but it is taken
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = {**body, "endpoint": f"tcp://127.0.0.1:{taken.getsockname()[1]}", "bind": True}
        refused = await live.client.post("/engines/announce", json=announcement(bad))
    assert refused.status_code == 422, refused.text
    assert "cannot consume engine 'e'" in refused.json()["error"]
    assert live.registry.get("e").endpoint == body["endpoint"]
    renewed = await live.client.post("/engines/announce", json=announcement(body))
    assert renewed.json()["outcome"] == "renewed"


async def test_deregistration_is_immediate_and_refuses_a_stale_instance(live):
    await live.client.post("/engines/announce", json=announcement(spec(), "new"))
    stale = await live.client.delete("/engines/announce/e", params={"instance": "old"})
    assert stale.status_code == 409 and "'new'" in stale.json()["error"]
    assert [s.name for s in live.registry.all()] == ["e"]
    gone = await live.client.delete("/engines/announce/e", params={"instance": "new"})
    assert gone.json()["outcome"] == "deregistered"
    assert live.registry.all() == []
    unknown = await live.client.delete("/engines/announce/e", params={"instance": "new"})
    assert unknown.status_code == 404


async def test_a_leased_engine_removed_by_hand_is_registered_again_by_its_renewal(live):
    await live.client.post("/engines/announce", json=announcement(spec()))
    assert (await live.client.delete("/engines/e")).status_code == 200
    again = await live.client.post("/engines/announce", json=announcement(spec()))
    assert again.json()["outcome"] == "registered"
    assert [s.name for s in live.registry.all()] == ["e"]


async def test_a_hand_registered_engine_is_not_taken_over(live):
    await live.registry.add(engine("hand"))
    took = await live.client.post("/engines/announce", json=announcement(spec("hand")))
    removed = await live.client.delete("/engines/announce/hand", params={"instance": "i1"})
    assert (took.status_code, removed.status_code) == (409, 409)
    assert "by hand" in took.json()["error"]
    assert live.registry.get("hand").endpoint == "tcp://127.0.0.1:1"


async def test_a_hash_seed_needs_an_authenticated_request(live, guarded):
    seeded = announcement(spec(hash_algo="xxhash", hash_seed="42"))
    refused = await live.client.post("/engines/announce", json=seeded)
    assert refused.status_code == 403 and "spec.hash_seed" in refused.json()["error"]
    assert live.registry.all() == []
    # Saying a seed is in force without sending it: kvindex matches it as learned.
    unsent = announcement(spec(hash_algo="xxhash"), seeded=True)
    assert (await live.client.post("/engines/announce", json=unsent)).status_code == 200
    assert live.registry.get("e").hash_algo is None

    no_token = await guarded.client.post("/engines/announce", json=seeded)
    assert no_token.status_code == 401
    taken = await guarded.client.post("/engines/announce", json=seeded, headers=AUTH)
    assert taken.status_code == 200, taken.text
    assert (guarded.registry.get("e").hash_algo, guarded.registry.get("e").hash_seed) == (
        "xxhash",
        "42",
    )
    anonymous = await guarded.client.delete("/engines/announce/e", params={"instance": "i1"})
    assert anonymous.status_code == 401


async def test_malformed_announcements_name_the_field(live):
    cases = {
        "instance": announcement(spec(), ""),
        "lease_seconds": announcement(spec(), lease_seconds=-1),
        "spec.block_size": announcement(spec(block_size=0)),
        "colour": {**announcement(spec()), "colour": "red"},
    }
    for field, body in cases.items():
        answer = await live.client.post("/engines/announce", json=body)
        assert answer.status_code == 422, (field, answer.text)
        assert field.split(".")[-1] in answer.json()["error"], (field, answer.text)
    assert live.registry.all() == []


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
            self.proc.wait(timeout=10)

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
        self.proc.wait(timeout=10)


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
