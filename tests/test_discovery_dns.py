"""DNS discovery against a real DNS server process whose records the test changes.

The server (``python -m tests.test_discovery_dns PORT ZONE``, built on dnslib)
answers from a JSON zone file it reads at every query, so rewriting the file
changes the answers at once. Engines are real publishers on loopback
addresses 127.0.0.2 and 127.0.0.3 (Linux routes all of 127/8 to lo), fed by
simulated engines, and consumed by the real subscriber.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from indexer.announcements import Announcement, LeaseRules, Leases
from indexer.core.events import GPU
from indexer.discovery import Discovery
from indexer.discovery.dns import DnsSource, LookupFailed
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores.memory import MemoryStore
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine

from .conftest import free_ports, wait_until

ROOT = Path(__file__).resolve().parent.parent
NAME = "engines.test"


class DnsServer:
    """A dnslib server on a free UDP port of 127.0.0.1, answering from a zone file."""

    def __init__(self, zone: Path) -> None:
        self.zone = zone
        self.set()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.test_discovery_dns", str(self.port), str(zone)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline().strip() == "ready"

    def set(self, servfail: bool = False, **records: dict[str, list]) -> None:
        """Replace the zone: ``A={name: [address, ...]}``, ``AAAA=...``,
        ``SRV={name: [[priority, weight, port, target], ...]}``."""
        self.zone.write_text(json.dumps({"servfail": servfail, **records}))

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(5)


@pytest.fixture
def dns_server(tmp_path: Path) -> Iterator[DnsServer]:
    server = DnsServer(tmp_path / "zone.json")
    yield server
    server.stop()


def failures(source: str) -> float:
    labels = {"source": source, "outcome": "failed"}
    return REGISTRY.get_sample_value("kvindex_discovery_lookups_total", labels) or 0.0


class SimRank:
    """One simulated engine publishing where vLLM would, on its own loopback address."""

    def __init__(self, host: str, port: int) -> None:
        self.engine = SimEngine(SimConfig(block_size=16, cpu_chunks=0))
        self.publisher = Publisher(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", bind=True)
        self.prompts = 0

    def publish(self) -> None:
        """Submit a new prompt and publish the step's batch (the PUB drops what
        precedes a subscriber's connection: the consumer replays it)."""
        self.prompts += 1
        self.engine.submit([self.prompts, *range(1000, 1064)])
        batch = self.engine.step()
        if batch is not None:
            self.publisher.publish(batch)

    def close(self) -> None:
        self.publisher.close()


@pytest.mark.slow
async def test_addresses_become_engines_gone_ones_leave_after_the_grace_failures_drop_nothing(
    dns_server: DnsServer,
) -> None:
    port = free_ports(2)
    hosts = ("127.0.0.2", "127.0.0.3")
    sims = {host: SimRank(host, port) for host in hosts}
    names = {host: f"{NAME}-{host}:{port}" for host in hosts}
    dns_server.set(A={NAME: list(hosts)})
    url = (
        f"dns://{NAME}:{port}?replay_port={port + 1}&model=m&block_size=16&blocks_per_chunk=4"
        f"&interval=0.1&grace=1.5&timeout=0.3&nameserver={dns_server.nameserver}"
    )
    store = MemoryStore()
    registry = EngineRegistry()
    subscriber = Subscriber(store, registry, SubscriberSettings(replay_timeout=0.5))
    await subscriber.start()
    source = DnsSource(url)
    leases = Leases(registry)  # discovery announces as self-registering engines do
    found = Discovery([source], leases)
    try:
        await wait_until(lambda: {s.name for s in registry.all()} == set(names.values()), 5)
        spec = registry.get(names["127.0.0.3"])
        assert spec.endpoint == f"tcp://127.0.0.3:{port}"
        assert spec.replay_endpoint == f"tcp://127.0.0.3:{port + 1}"
        assert (spec.model, spec.block_size, spec.blocks_per_chunk) == ("m", 16, 4)
        lease = leases.lease(spec.name)
        assert lease is not None and lease.lease_seconds == 30.0

        # consumed: each engine's batches reach the store under its discovered name
        for _ in range(200):
            for sim in sims.values():
                sim.publish()
            counts = [await store.block_counts((n, 0)) for n in names.values()]
            if all(c.get(GPU) for c in counts):
                break
            await asyncio.sleep(0.05)
        assert all(c.get(GPU) for c in counts), counts

        # an address disappears: still registered within the grace, gone after it
        dns_server.set(A={NAME: ["127.0.0.2"]})
        gone_at = time.monotonic()
        await asyncio.sleep(0.6)
        assert names["127.0.0.3"] in {s.name for s in registry.all()}
        await wait_until(lambda: len(registry.all()) == 1, 5)
        assert time.monotonic() - gone_at >= 1.5
        assert [s.name for s in registry.all()] == [names["127.0.0.2"]]
        # the registry drops the name first, then the subscriber stops the rank and forgets it
        for _ in range(100):
            if not (await store.block_counts((names["127.0.0.3"], 0))).get(GPU):
                break
            await asyncio.sleep(0.05)
        assert not (await store.block_counts((names["127.0.0.3"], 0))).get(GPU)

        # resolution fails (SERVFAIL, then no server at all): nothing is dropped
        before = failures(source.url.label)
        dns_server.set(servfail=True)
        await asyncio.sleep(2.0)
        dns_server.stop()
        await asyncio.sleep(2.0)
        assert failures(source.url.label) >= before + 5
        assert [s.name for s in registry.all()] == [names["127.0.0.2"]]
        assert (await store.block_counts((names["127.0.0.2"], 0))).get(GPU)
    finally:
        await found.stop()
        await leases.close()
        await subscriber.stop()
        await store.close()
        for sim in sims.values():
            sim.close()


@pytest.mark.slow  # starts the DNS server process
async def test_srv_records_give_targets_and_ports_and_aaaa_addresses_are_bracketed(
    dns_server: DnsServer,
) -> None:
    dns_server.set(
        SRV={"_kv._tcp.pool.test": [[0, 0, 6001, "a.pool.test"], [0, 0, 6002, "b.pool.test"]]},
        A={"a.pool.test": ["10.0.0.7"]},
        AAAA={"b.pool.test": ["fd00::9"]},
    )
    ns = dns_server.nameserver
    source = DnsSource(f"dns://_kv._tcp.pool.test?hash_algo=xxhash&nameserver={ns}")
    engines = await source.engines()
    assert {n: s.endpoint for n, s in engines.items()} == {
        "pool.test-10.0.0.7:6001": "tcp://10.0.0.7:6001",
        "pool.test-fd00::9:6002": "tcp://[fd00::9]:6002",
    }
    assert {s.hash_algo for s in engines.values()} == {"xxhash"}

    # no SRV and no port: nothing to connect to, said as a failed lookup
    dns_server.set(A={"plain.test": ["10.0.0.8"]})
    with pytest.raises(LookupFailed, match="no port"):
        await DnsSource(f"dns://plain.test?nameserver={ns}").engines()
    # an unknown name is a failed lookup too (the last good answer stands), not "no engines"
    with pytest.raises(LookupFailed, match="no address"):
        await DnsSource(f"dns://missing.test:1?nameserver={ns}").engines()


def changes(source: str, change: str) -> float:
    labels = {"source": source, "change": change}
    return REGISTRY.get_sample_value("kvindex_discovery_changes_total", labels) or 0.0


@pytest.mark.slow
async def test_leases_are_renewed_while_discovery_runs_and_lapse_when_it_stops_others_names_kept(
    dns_server: DnsServer,
) -> None:
    dns_server.set(A={"lapse.test": ["127.0.0.7", "127.0.0.8", "127.0.0.9"]})
    registry = EngineRegistry()
    # short leases: 0.6 s, so a renewal every 0.2 s is what keeps the engine
    rules = LeaseRules(min_lease_seconds=0.1, default_lease_seconds=0.6, sweep_seconds=0.05)
    leases = Leases(registry, rules)
    mine, theirs = "lapse.test-127.0.0.8:7000", "lapse.test-127.0.0.9:7000"
    by_hand = EngineSpec(theirs, "tcp://127.0.0.1:7999")
    await registry.add(by_hand)
    announced = EngineSpec("lapse.test-127.0.0.7:7000", "tcp://127.0.0.7:7000", block_size=32)
    await leases.announce(Announcement(announced, "vllm-plugin-1", lease_seconds=300))
    source = DnsSource(f"dns://lapse.test:7000?interval=0.1&nameserver={dns_server.nameserver}")
    taken = changes(source.url.label, "name_taken")
    found = Discovery([source], leases)
    try:
        await wait_until(lambda: mine in {s.name for s in registry.all()}, 5)
        await asyncio.sleep(2.0)  # three lease lengths
        assert {s.name for s in registry.all()} == {mine, theirs, announced.name}
        assert registry.get(theirs) == by_hand  # an operator's engine is never taken over
        assert registry.get(announced.name) == announced  # nor a self-announced one
        assert leases.lease(announced.name).instance == "vllm-plugin-1"
        assert changes(source.url.label, "name_taken") > taken
    finally:
        await found.stop()
    await wait_until(lambda: {s.name for s in registry.all()} == {theirs, announced.name}, 3)
    await leases.close()


async def test_a_source_loop_that_crashes_says_so_in_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    found = Discovery([DnsSource("dns://x.test:1?nameserver=127.0.0.1:9")], None)  # no leases
    await asyncio.sleep(0.05)
    await found.stop()
    (record,) = [r for r in caplog.records if r.message == "discovery stopped"]
    assert record.source == "discover dns://x.test:1" and "AttributeError" in record.error


@pytest.mark.parametrize(
    "url, says",
    [
        ("dns://x.test:5557?blocksize=16", "unknown field 'blocksize'"),
        ("dns://x.test:5557?block_size=0", "block_size"),
        ("dns://x.test:5557?endpoint=tcp://a:1", "unknown field 'endpoint'"),
        ("dns://x.test:5557?grace=soon", "grace must be a number"),
        ("dns://x.test:5557?replay_port=70000", "replay_port must be a port"),
        ("dns://x.test:5557?nameserver=dns.example", "nameserver must be IP"),
        ("dns://x.test:99999", "Port out of range"),
        ("dns://x.test:1?model=a&model=b", "model is given twice"),
    ],
)
def test_bad_urls_are_refused_naming_the_field(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        DnsSource(url)


@pytest.mark.slow
def test_kvindex_serve_discovers_from_its_config_file_and_flag(
    dns_server: DnsServer, tmp_path: Path
) -> None:
    dns_server.set(A={"a.test": ["127.0.0.2"], "b.test": ["127.0.0.3", "127.0.0.4"]})
    ns = dns_server.nameserver
    config = tmp_path / "kvindex.yaml"
    config.write_text(f"discover:\n  - dns://a.test:7001?interval=0.1&nameserver={ns}\n")
    http = free_ports()
    kvindex = [sys.executable, "-m", "kvindex.cli", "serve", "--port", str(http)]
    flag = f"dns://b.test:7002?block_size=32&interval=0.1&nameserver={ns}"
    with subprocess.Popen([*kvindex, "--config", str(config), "--discover", flag]) as serve:
        try:
            deadline = time.monotonic() + 30
            names: set[str] = set()
            while time.monotonic() < deadline and len(names) < 3:
                try:
                    body = httpx.get(f"http://127.0.0.1:{http}/engines", timeout=1).json()
                    names = {e["name"] for e in body}
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
            assert names == {
                "a.test-127.0.0.2:7001",
                "b.test-127.0.0.3:7002",
                "b.test-127.0.0.4:7002",
            }
            detail = httpx.get(f"http://127.0.0.1:{http}/engines/b.test-127.0.0.4:7002").json()
            assert (detail["endpoint"], detail["block_size"]) == ("tcp://127.0.0.4:7002", 32)
            assert detail["lease"]["lease_seconds"] == 30.0  # the API's leases: one upsert path
        finally:
            serve.terminate()
        assert serve.wait(10) == 0

    bad = subprocess.run(
        [*kvindex, "--discover", "dns://x.test:1?blocksize=16"], capture_output=True, text=True
    )
    assert bad.returncode == 1
    assert "unknown field 'blocksize'" in bad.stderr


def _serve_zone(port: int, zone: Path) -> None:
    """The test's DNS server: answers from ``zone`` as it is at each query."""
    from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A
    from dnslib.server import DNSServer

    kinds = {"A": lambda v: A(v), "AAAA": lambda v: AAAA(v), "SRV": lambda v: SRV(*v)}

    class Zone:
        def resolve(self, request, handler):  # dnslib's resolver interface
            records = json.loads(zone.read_text())
            reply = request.reply()
            if records.pop("servfail"):
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            qname, kind = str(request.q.qname).rstrip("."), QTYPE[request.q.qtype]
            for value in records.get(kind, {}).get(qname, []):
                reply.add_answer(RR(request.q.qname, request.q.qtype, rdata=kinds[kind](value)))
            if not reply.rr and not any(qname in names for names in records.values()):
                reply.header.rcode = RCODE.NXDOMAIN
            return reply

    class Quiet:
        def __getattr__(self, name):  # dnslib's logger interface: log nothing
            return lambda *args: None

    server = DNSServer(Zone(), port=port, address="127.0.0.1", logger=Quiet())
    server.start_thread()
    print("ready", flush=True)
    while server.isAlive():
        time.sleep(0.5)


if __name__ == "__main__":
    _serve_zone(int(sys.argv[1]), Path(sys.argv[2]))
