"""Who may open doors: binds an engine asks for, the API's token, slow clients.

Binds are tried for real (a real subscriber binding real ZMQ sockets, files
on disk), the token and the exposure check through the real CLI, and the
HTTP limits over real sockets against the server ``kvindex serve`` runs (the
token and the HTTP limits in ``test_hardening_access_http.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from indexer.engine_flags import parse_engine_flag
from indexer.engine_registry import BindPolicy, BindRefused, EngineRegistry, EngineSpec
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.stores import MemoryStore
from kvindex.config import ConfigError, ServeConfig
from kvindex.wiring import api_app
from producer.publisher import Publisher

from .apikit import Api
from .conftest import free_ports


def spec(endpoint: str, **fields) -> EngineSpec:
    return EngineSpec(name="e", endpoint=endpoint, bind=True, **fields)


def refused(policy: BindPolicy, endpoint: str) -> str:
    with pytest.raises(BindRefused) as e:
        policy.check(spec(endpoint))
    return str(e.value)


# --- the bind policy -------------------------------------------------------------


def test_ipc_binds_are_refused_unless_a_directory_is_configured(tmp_path: Path) -> None:
    assert "subscriber.bind.ipc_dir" in refused(BindPolicy(), f"ipc://{tmp_path}/kv.sock")
    BindPolicy(ipc_dir=str(tmp_path)).check(spec(f"ipc://{tmp_path}/kv.sock"))


def test_ipc_binds_stay_inside_the_directory(tmp_path: Path) -> None:
    sockets, elsewhere = tmp_path / "sockets", tmp_path / "elsewhere"
    sockets.mkdir()
    elsewhere.mkdir()
    (sockets / "link").symlink_to(elsewhere)
    policy = BindPolicy(ipc_dir=str(sockets))
    for path in (elsewhere / "kv.sock", f"{sockets}/../elsewhere/kv.sock", sockets / "link/kv"):
        assert "not in subscriber.bind.ipc_dir" in refused(policy, f"ipc://{path}")
    for name in ("@abstract", "*"):
        assert "abstract and wildcard" in refused(policy, f"ipc://{name}")


def test_ipc_binds_never_replace_a_file_that_is_not_a_socket(tmp_path: Path) -> None:
    policy = BindPolicy(ipc_dir=str(tmp_path))
    (tmp_path / "data").write_text("precious")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "data")
    for name in ("data", "dir", "link"):
        assert "is not a socket" in refused(policy, f"ipc://{tmp_path}/{name}")
    with socket.socket(socket.AF_UNIX) as old:  # a socket left by an earlier run
        old.bind(str(tmp_path / "old.sock"))
    policy.check(spec(f"ipc://{tmp_path}/old.sock"))


def test_tcp_binds_are_loopback_unless_listed() -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://localhost:5557"):
        BindPolicy().check(spec(endpoint))
    for host in ("0.0.0.0", "*", "10.0.0.5", "[::]", "eth0"):
        assert "is not loopback" in refused(BindPolicy(), f"tcp://{host}:5557")
    BindPolicy(tcp_hosts=["10.0.0.5"]).check(spec("tcp://10.0.0.5:5557"))
    assert "10.0.0.6" in refused(BindPolicy(tcp_hosts=["10.0.0.5"]), "tcp://10.0.0.6:5557")
    BindPolicy(tcp_hosts=["*"]).check(spec("tcp://0.0.0.0:5557"))


def test_engines_kvindex_connects_to_need_no_permission(tmp_path: Path) -> None:
    BindPolicy().check(EngineSpec("e", f"ipc://{tmp_path}/x"))
    BindPolicy().check(EngineSpec("e", "tcp://0.0.0.0:5557"))
    BindPolicy().check(spec("inproc://kv"))


# --- POST /engines against a real subscriber -------------------------------------


@contextlib.asynccontextmanager
async def live_api(policy: BindPolicy | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """The API over a real subscriber, both with ``policy`` (as ``kvindex serve`` sets them)."""
    policy = policy or BindPolicy()
    store, registry = MemoryStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, SubscriberSettings(bind=policy))
    config = ServeConfig(subscriber=SubscriberSettings(bind=policy))
    app = api_app(store, registry, subscriber, config.api_settings())
    await subscriber.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://kvindex") as client:
            yield client
    finally:
        await subscriber.stop()


def body(endpoint: str) -> dict:
    return {"name": "intruder", "endpoint": endpoint, "bind": True}


async def test_post_engines_cannot_destroy_a_file(tmp_path: Path) -> None:
    """libzmq unlinks an ipc path before binding it: this used to delete the file."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    async with live_api() as client:
        answer = await client.post("/engines", json=body(f"ipc://{victim}"))
        assert answer.status_code == 422, answer.text
        assert "ipc binds are off" in answer.json()["error"]
        assert (await client.get("/engines")).json() == []
    async with live_api(BindPolicy(ipc_dir=str(tmp_path))) as client:
        answer = await client.post("/engines", json=body(f"ipc://{victim}"))
        assert answer.status_code == 422, answer.text
        assert "is not a socket" in answer.json()["error"]
    assert victim.read_text() == "precious"


async def test_post_engines_cannot_open_a_public_listener() -> None:
    port = free_ports()
    async with live_api() as client:
        answer = await client.post("/engines", json=body(f"tcp://0.0.0.0:{port}"))
        assert answer.status_code == 422, answer.text
        assert "0.0.0.0 is not loopback" in answer.json()["error"]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


async def test_an_allowed_ipc_bind_is_consumed(tmp_path: Path) -> None:
    path = tmp_path / "kv.sock"
    async with live_api(BindPolicy(ipc_dir=str(tmp_path))) as client:
        answer = await client.post("/engines", json=body(f"ipc://{path}"))
        assert answer.status_code == 201, answer.text
        with Publisher(f"ipc://{path}", bind=False):

            async def connected() -> bool:
                state = (await client.get("/engines/intruder")).json()
                return state["ranks"][0]["connected"]

            for _ in range(200):
                if await connected():
                    break
                await asyncio.sleep(0.05)
            assert await connected()
            assert path.is_socket()


async def test_the_subscriber_checks_again_right_before_binding(tmp_path: Path) -> None:
    """What an API replica allowed may have changed by the time a worker binds it."""
    store, registry = MemoryStore(), EngineRegistry()
    subscriber = Subscriber(store, registry, SubscriberSettings(bind=BindPolicy(str(tmp_path))))
    await subscriber.start()
    try:
        BindPolicy(str(tmp_path)).check(spec(f"ipc://{tmp_path}/late"))  # allowed now
        (tmp_path / "late").write_text("appeared since")
        with pytest.raises(BindRefused, match="is not a socket"):
            await registry.add(spec(f"ipc://{tmp_path}/late"))
    finally:
        await subscriber.stop()
    assert (tmp_path / "late").read_text() == "appeared since"


async def test_an_api_replica_refuses_binds_its_workers_would_refuse() -> None:
    """A replica consumes nothing, so the API itself must check."""
    api = Api()  # default settings: the default policy, and a subscriber that never binds
    try:
        answer = await api.client.post("/engines", json=body("tcp://0.0.0.0:5557"))
        assert answer.status_code == 422, answer.text
        assert api.registry.all() == []
    finally:
        await api.close()


def test_the_api_section_cannot_set_its_own_bind_policy() -> None:
    with pytest.raises(ConfigError, match=r"subscriber\.bind"):
        ServeConfig(api={"engine_binds": {"tcp_hosts": ["*"]}}).api_settings()


def test_declared_engines_are_checked_at_start(tmp_path: Path) -> None:
    config = ServeConfig(engines=[spec("tcp://0.0.0.0:5557")])
    with pytest.raises(ConfigError, match="is not loopback"):
        config.check_binds()
    with pytest.raises(ConfigError, match="ipc binds are off"):
        ServeConfig().check_binds([parse_engine_flag(f"a=ipc://{tmp_path}/s,bind=true")])


# --- endpoints and the --engine flag ---------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"endpoint": "http://h:1"}, "endpoint: expected tcp://HOST:PORT or ipc://PATH, got 'http://h:1'"),
        ({"endpoint": "tcp://h"}, "expected tcp://HOST:PORT"),
        ({"endpoint": "tcp://h:0"}, "port 0 of 'tcp://h:0' is not in 1-65535"),
        ({"endpoint": "tcp://h:65536"}, "port 65536"),
        ({"endpoint": "tcp://h:65535", "dp_ranks": 2}, "rank 1 of 'tcp://h:65535' would use port"),
        ({"replay_endpoint": "tcp://h:65534", "dp_ranks": 3}, "replay_endpoint: with dp_ranks=3"),
        ({"replay_endpoint": "udp://h:1"}, "replay_endpoint: expected"),
    ],
)  # fmt: skip
async def test_post_engines_says_what_is_wrong_with_an_endpoint(fields, message) -> None:
    api = Api()
    try:
        sent = {"name": "a", "endpoint": "tcp://h:1", **fields}
        answer = await api.client.post("/engines", json=sent)
        assert answer.status_code == 422
        assert message in answer.json()["error"]
    finally:
        await api.close()


def test_ports_at_the_top_of_the_range_are_fine() -> None:
    assert parse_engine_flag("a=tcp://h:65534,dp_ranks=2").rank_endpoint(1) == "tcp://h:65535"
    assert parse_engine_flag("a=tcp://[::1]:5557,dp_ranks=2").rank_endpoint(1) == "tcp://[::1]:5558"


def test_null_in_the_engine_flag_is_none_or_the_default() -> None:
    flag = "a=tcp://h:1,hash_seed=null,model=null,replay_endpoint=null,blocks_per_chunk=null"
    assert parse_engine_flag(flag + ",hash_algo=null,topic=null,dp_ranks=null") == EngineSpec(
        "a", "tcp://h:1", model="", hash_algo=None, hash_seed=None
    )
    with pytest.raises(ValueError, match="color"):
        parse_engine_flag("a=tcp://h:1,color=null")
