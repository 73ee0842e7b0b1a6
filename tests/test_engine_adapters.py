"""Engine adapters: the seam, each adapter's garbage and framing, and a second wire end to end.

The second adapter (``vllm_legacy``: older vLLM's positional events) is a
package of its own that edits no other; an engine registered with it is
consumed over real ZMQ sockets (live and replay) into the same store, and
its answers equal those of the same trace published on vLLM 0.33's wire.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import msgspec
import pytest
import zmq
import zmq.asyncio

import indexer.engines
from indexer.core.events import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    RankId,
    WireError,
)
from indexer.core.matching import PrefixMatch
from indexer.engine_flags import parse_engine_flag
from indexer.engine_registry import EngineRegistry, EngineSpec
from indexer.engines import catalog
from indexer.engines.base import MAX_HASHES_PER_EVENT, Prompt
from indexer.engines.rendering import ChatMessage, ChatOptions, ToolServing
from indexer.engines.vllm import hashing, native, render
from indexer.ingest.subscriber import Subscriber, SubscriberSettings
from indexer.prompts import ModelTokenizer
from indexer.query import DECLARED
from indexer.stores import MemoryStore
from kvindex.config import ConfigError, load_config
from producer.publisher import Publisher

from .apikit import Api
from .conftest import (
    FIXTURES,
    assert_matches_trace,
    free_ports,
    load_expected_json,
    trace_batches,
    wait_until,
)

VLLM, LEGACY = catalog.adapter("vllm"), catalog.adapter("vllm_legacy")
ADAPTERS = pytest.mark.parametrize("adapter", [VLLM, LEGACY], ids=lambda a: a.name)
LEGACY_FIXTURE = (FIXTURES / "wire" / "legacy_positional.msgpack").read_bytes()
SEQ_8 = (7).to_bytes(8, "big")
TRAITS = render.TemplateTraits("string", False, frozenset({"add_generation_prompt"}))


def test_the_catalog_finds_each_adapter_package_by_name() -> None:
    assert {"vllm", "vllm_legacy"} <= set(catalog.names())
    assert [catalog.adapter(n).name for n in catalog.names()] == list(catalog.names())
    with pytest.raises(ValueError, match=r"unknown engine adapter 'trtllm'.*vllm_legacy"):
        catalog.adapter("trtllm")


@pytest.fixture
def catalog_cache():
    """The catalog's lists forgotten before and after, and the packages a test added
    unloaded: the test changes what it finds."""
    before = set(sys.modules)
    catalog.names.cache_clear(), catalog.adapter.cache_clear()
    yield
    catalog.names.cache_clear(), catalog.adapter.cache_clear()
    for name in set(sys.modules) - before:
        if name.startswith("indexer.engines."):
            del sys.modules[name]


def test_a_new_adapter_package_is_found_with_no_other_edit(
    tmp_path, monkeypatch, catalog_cache
) -> None:
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "__init__.py").write_text("")
    (tmp_path / "toy" / "adapter.py").write_text(
        "from indexer.engines.zmq_framing import ZmqFraming\n"
        "class Toy(ZmqFraming):\n    name = 'toy'\n    hash_algos = ()\n"
        "ADAPTER = Toy()\n"
    )
    (tmp_path / "misnamed").mkdir()
    (tmp_path / "misnamed" / "__init__.py").write_text("")
    (tmp_path / "misnamed" / "adapter.py").write_text(
        "class Other:\n    name = 'other'\nADAPTER = Other()\n"
    )
    (tmp_path / "not_an_engine").mkdir()  # a package without an adapter module
    (tmp_path / "not_an_engine" / "__init__.py").write_text("")
    monkeypatch.setattr(indexer.engines, "__path__", [*indexer.engines.__path__, str(tmp_path)])
    assert {"toy", "misnamed"} <= set(catalog.names())
    assert "not_an_engine" not in catalog.names()
    assert catalog.adapter("toy").split_live([b"", SEQ_8, b"x"]) == (7, b"x")
    with pytest.raises(RuntimeError, match="calls itself 'other'"):
        catalog.adapter("misnamed")


def test_an_engine_names_its_adapter_and_vllm_is_the_default() -> None:
    assert parse_engine_flag("a=tcp://h:5557").engine_adapter is VLLM
    legacy = parse_engine_flag("a=tcp://h:5557,adapter=vllm_legacy,dp_ranks=2")
    assert legacy.engine_adapter is LEGACY
    assert legacy.rank_endpoint(1) == "tcp://h:5558"
    with pytest.raises(ValueError, match=r"adapter"):
        parse_engine_flag("a=tcp://h:5557,adapter=trtllm")


async def test_an_unknown_adapter_is_a_422_naming_the_field() -> None:
    api = Api()
    try:
        body = {"name": "x", "endpoint": "tcp://127.0.0.1:5557", "adapter": "trtllm"}
        refused = await api.client.post("/engines", json=body)
        created = await api.client.post("/engines", json=body | {"adapter": "vllm_legacy"})
    finally:
        await api.close()
    assert refused.status_code == 422 and "adapter" in refused.text
    assert created.status_code == 201 and created.json()["adapter"] == "vllm_legacy"


def test_the_legacy_adapter_reproduces_the_positional_fixture() -> None:
    batch = LEGACY.decode(LEGACY_FIXTURE)
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].block_size == 16 and batch.events[0].medium == GPU
    assert LEGACY.encode(batch) == LEGACY_FIXTURE  # byte for byte
    assert LEGACY.batch_ts(LEGACY_FIXTURE) == batch.ts == 1760000000.25
    assert VLLM.decode(LEGACY_FIXTURE) == batch  # vLLM's adapter reads both shapes


def test_the_legacy_adapter_reads_its_earliest_releases_too() -> None:
    """No medium yet (so GPU) and no data_parallel_rank in the batch."""
    payload = msgspec.msgpack.encode(
        [2.5, [["BlockStored", [5, 6], None, list(range(32)), 16, None], ["BlockRemoved", [6]]]]
    )
    batch = LEGACY.decode(payload)
    assert batch.data_parallel_rank is None and LEGACY.batch_ts(payload) == 2.5
    assert [(e.block_hashes, e.medium) for e in batch.events] == [([5, 6], None), ([6], None)]


def _stored(n: int, medium: str = "GPU") -> EventBatch:
    return EventBatch(1.5, [BlockStored(list(range(1, n + 1)), None, [], 0, None, medium)], 0)


@ADAPTERS
@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", SEQ_8], "frame_count"),
        ([b"", b"\x00\x07", b"payload"], "bad_seq"),
        ([b"", SEQ_8, b"", b"payload"], "frame_count"),
    ],
)
def test_bad_live_frames_are_wire_errors(adapter, frames: list[bytes], reason: str) -> None:
    with pytest.raises(WireError) as error:
        adapter.split_live(frames)
    assert error.value.reason == reason


@ADAPTERS
@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode("not a batch"),
        msgspec.msgpack.encode([1.0, [["BlockMoved", [1]]], 0]),  # unknown event
        msgspec.msgpack.encode([1.0, [["BlockRemoved", [-1], "GPU"]], 0]),  # negative hash
    ],
)
def test_garbage_payloads_are_wire_errors(adapter, payload: bytes) -> None:
    with pytest.raises(WireError):
        adapter.decode(payload)
    with pytest.raises(WireError):
        adapter.decode(payload, tokens=False)


@ADAPTERS
def test_what_types_cannot_say_is_checked_too(adapter) -> None:
    with pytest.raises(WireError) as medium:
        adapter.decode(adapter.encode(_stored(1, medium="disk")))
    with pytest.raises(WireError) as size:
        adapter.decode(adapter.encode(_stored(MAX_HASHES_PER_EVENT + 1)))
    assert (medium.value.reason, size.value.reason) == ("unknown_medium", "too_many_hashes")


def test_the_legacy_adapter_reads_positional_events_only() -> None:
    maps = VLLM.encode(LEGACY.decode(LEGACY_FIXTURE))
    with pytest.raises(WireError) as error:
        LEGACY.decode(maps)
    assert error.value.reason == "bad_payload"
    with pytest.raises(WireError):
        LEGACY.batch_ts(b"\x92\xa1x\x90")  # an array whose ts is a string


@ADAPTERS
def test_live_and_replay_framing_round_trip(adapter) -> None:
    payload = adapter.encode(_stored(3))
    assert adapter.split_live(adapter.live_frames(b"kv", 7, payload)) == (7, payload)
    request = adapter.replay_request(1 << 40)
    assert adapter.replay_start(request) == 1 << 40
    assert adapter.split_replay(adapter.replay_answer(7, payload)) == (7, payload)
    assert adapter.split_replay(adapter.replay_answer(None, b"")) == (None, b"")
    # A version that puts the topic before the seq is read too.
    assert adapter.split_replay([b"", b"kv", SEQ_8, payload]) == (7, payload)
    with pytest.raises(WireError) as frames:
        adapter.split_replay([b"", b"kv", SEQ_8, payload, b"extra"])
    with pytest.raises(WireError) as request_error:
        adapter.replay_start([b"", SEQ_8, b"extra"])
    assert frames.value.reason == "replay_frame_count"
    assert request_error.value.reason == "replay_request_frame_count"


def test_vllm_hashing_goes_through_the_adapter() -> None:
    tokens = tuple(range(40))
    hasher = VLLM.hasher("sha256", None, 16)
    digests = hasher.digests(Prompt(tokens, cache_salt="s"))
    spec = hashing.HashSpec("sha256", None, 16)
    assert digests == hashing.block_hashes(spec, tokens, cache_salt="s", as_bytes=True)
    assert hasher.published(digests) == hashing.block_hashes(spec, tokens, cache_salt="s")
    assert hasher == VLLM.hasher("sha256", None, 16)  # one hashing per distinct hasher
    assert not VLLM.hasher("xxhash", None, 16).reproducible
    with pytest.raises(ValueError, match="lora_name and lora_path"):
        hasher.digests(Prompt(tokens, lora_name="a"))


def test_a_legacy_engine_is_matched_through_the_learned_index() -> None:
    legacy = EngineSpec("old", "tcp://h:5557", adapter="vllm_legacy")
    assert DECLARED.hashing_of(legacy, 16) is None  # its hashes are not reproduced here
    assert DECLARED.hashing_of(EngineSpec("new", "tcp://h:5557"), 16) is not None
    assert not LEGACY.hash_algos and not LEGACY.hasher("sha256", None, 16).reproducible
    # Its events state no extra keys; vLLM's state them untagged, block by block.
    salted = Prompt(tuple(range(40)), lora_name="ad", cache_salt="s")
    assert LEGACY.stated_extras(salted, 16) == [None, None]
    assert VLLM.stated_extras(salted, 16) == [("ad", "s"), ("ad",)]


async def _positional_on_the_wire(endpoint: str) -> list:
    """Ask a publisher's replay ROUTER for seq 0 over a raw DEALER: its first answer's events."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        await dealer.send_multipart(LEGACY.replay_request(0))
        frames = await asyncio.wait_for(dealer.recv_multipart(), 5)
    finally:
        dealer.close(linger=0)
        context.term()
    seq, payload = LEGACY.split_replay(frames)
    assert seq == 0
    return msgspec.msgpack.decode(payload)[1]


@pytest.mark.slow
async def test_a_legacy_wire_engine_answers_as_the_same_trace_on_vllms_wire() -> None:
    """Two engines publish one trace over real sockets, one on each wire, each losing
    live batches that replay brings back; one subscriber consumes both into one store."""
    items = trace_batches("chat-sha256")
    specs, publishers = [], []
    for name, adapter in (("new", VLLM), ("old", LEGACY)):
        pub, replay = free_ports(), free_ports()
        specs.append(
            EngineSpec(
                name,
                f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
                adapter=adapter.name,
            )
        )
        publishers.append(
            Publisher(
                specs[-1].endpoint,
                specs[-1].replay_endpoint,
                bind=True,
                drop_live={100, 101, 180},
                adapter=adapter,
            )
        )
    store, registry = MemoryStore(), EngineRegistry()
    for spec in specs:
        await registry.add(spec)
    subscriber = Subscriber(store, registry, SubscriberSettings(replay_timeout=0.5))
    await subscriber.start()
    try:
        for name, publisher in zip(("new", "old"), publishers, strict=True):
            await wait_until(lambda n=name: subscriber.rank_status(n)[0].connected)
            await wait_until(lambda p=publisher: p.replays_served >= 1)
            for batch in items:
                assert publisher.publish(batch)
            assert await asyncio.to_thread(publisher.flush)
        last = len(items) - 1
        await wait_until(
            lambda: all(subscriber.rank_status(n)[0].applied_seq == last for n in ("new", "old")),
            what="both engines to apply the whole trace",
        )
        statuses = [subscriber.rank_status(n)[0] for n in ("new", "old")]
        wire_events = await _positional_on_the_wire(specs[1].replay_endpoint)
    finally:
        await subscriber.stop()
        for publisher in publishers:
            publisher.close()

    assert all(type(event) is list for event in wire_events)  # the old engine spoke positional
    for status in statuses:
        assert status.gaps_filled >= 1 and not status.degraded and status.rejected == {}
    new, old = RankId("new", 0), RankId("old", 0)
    await assert_matches_trace(store, old, "chat-sha256")  # vLLM's own refcounts
    assert await store.block_counts(old) == await store.block_counts(new)
    assert await store.anomalies(old) == await store.anomalies(new)
    chunk = load_expected_json("chat-sha256")["engine"]["blocks_per_chunk"]
    probes = load_expected_json("chat-sha256")["probes"]
    hits = []
    for probe in probes:
        chain = [int(h) for h in probe["hashes"]]
        found = await store.prefix_match(chain, {"new": chunk, "old": chunk})
        hit = found.get(old, PrefixMatch())  # a rank matching nothing is left out
        assert hit == found.get(new, PrefixMatch()), probe
        assert hit.gpu_blocks * 16 == probe["gpu_tokens"]
        hits.append(hit)
    # Not vacuous: some probes hit on GPU, some reach into offloaded CPU chunks.
    assert any(h.gpu_blocks for h in hits) and any(h.from_cpu for h in hits)
    counts = await store.block_counts(old)
    assert counts[GPU] > 0 and counts[CPU] > 0


def test_each_adapters_compiled_part_is_reported_and_warned_through_the_catalog(
    monkeypatch, caplog
) -> None:
    assert LEGACY.compiled is None
    assert catalog.compiled_statuses() == [VLLM.compiled.status()]
    assert catalog.compiled_statuses()[0]["compiled_core"] is True
    assert catalog.warn_if_unavailable("serve") is True
    monkeypatch.setattr(native.PART, "module", None)
    monkeypatch.setattr(native.PART, "error", "ImportError: gone")
    with caplog.at_level(logging.WARNING, logger="kvindex.native"):
        assert catalog.warn_if_unavailable("indexer") is False
    assert [(r.role, r.import_error) for r in caplog.records] == [("indexer", "ImportError: gone")]
    assert catalog.compiled_statuses() == [
        {"compiled_core": False, "compiled_core_error": "ImportError: gone"}
    ]


def test_a_model_renders_through_its_adapter_and_one_that_renders_nothing_is_refused(
    tmp_path,
) -> None:
    assert catalog.renderer("vllm") is VLLM.renderer
    assert ModelTokenizer("t").renderer is VLLM.renderer  # vllm is the default
    hi, serving = [ChatMessage("user", "hi")], ToolServing()
    assert VLLM.renderer.chat_call(hi, ChatOptions(), TRAITS, serving) == (
        render.chat_call(hi, ChatOptions(), TRAITS, serving)
    )
    with pytest.raises(ValueError, match="adapter: the 'vllm_legacy' engine adapter does not"):
        ModelTokenizer("t", adapter="vllm_legacy")
    config = tmp_path / "kvindex.yaml"
    config.write_text("models:\n  m:\n    tokenizer: t\n    adapter: trtllm\n")
    with pytest.raises(ConfigError, match="adapter: unknown engine adapter 'trtllm'"):
        load_config(config)
