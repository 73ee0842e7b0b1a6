"""Exact from any moment, inside vLLM 0.33.0's own engine: snapshots of two
data-parallel ranks with CPU offloading, answered by kvindex's plugin.

Each rank is an engine core built from vLLM's real scheduler side: its
``Scheduler`` with the ``KVCacheManager`` over a small GPU pool (it evicts) and
the ``OffloadingConnector``'s scheduler half, whose ``CPUOffloadingManager``
(LRU, a small CPU tier: it evicts too) stores finished chunks and whose
``OffloadingEventsTracker`` makes the offload events self-describing; the
scheduler publishes each step's events through vLLM's ``ZmqEventPublisher``
(rank r at port + r, a 10-batch replay buffer), which kvindex's plugin mirrors
without reuse reports (+1000) and answers snapshots beside (+2000). Only the
model is a stand-in: a scheduled prefill "runs" at once and samples one token,
and the offloading worker completes transfers when vLLM's does (a store in the
step after the one that scheduled it, a load in its own), reporting them
through vLLM's job bookkeeping.

Each engine core runs vLLM's busy loop on a thread of its own: requests arrive
on its input queue, are handled by ``EngineCoreProc._handle_client_request``
(with the plugin's wrapper, as ``register`` installs it), and the scheduler
steps. Both ranks live in this one process, each with its own snapshot service
(the plugin gives each publisher the engine core attached before it).

``kvindex serve`` over a real Redis starts only after each rank published more
than three replay buffers' worth; it must then answer exactly what vLLM holds,
per rank and tier (each block's count against the block pool's copies and the
CPU tier's chunks, and prefix-match against vLLM's own GPU and CPU hits),
from a snapshot taken while the engine keeps stepping, and again after Redis
loses everything and after Redis comes back from an older dump, each without
restarting the engine.
"""

from __future__ import annotations

import contextlib
import queue
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
import torch
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCore, EngineCoreProc, EngineShutdownState
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from producer.vllm_plugin import reports, snapshots
from producer.vllm_plugin.settings import PluginSettings
from producer.vllm_plugin.spec import announcement
from tests.servers import REDIS_CLI, REDIS_SERVER, RedisServer, port_free
from tests.servers import free_port as free_redis_port
from tests.vllm_tier.conftest import TOKEN, Serve

BLOCK = 16
CHUNK_BLOCKS = 4  # offloaded chunks of 64 tokens
GPU_BLOCKS = 40
CPU_CHUNKS = 12
BUFFER = 10  # vLLM's replay buffer, in batches
OFFSET = 1000  # the plugin's stream beside vLLM's; snapshots beside it
RANKS = 2
NAME = "tier-snapshots"
SAMPLED = 7  # the token every "forward pass" samples
MAX_PROMPT = 440  # tokens; the model's context is 512
LAYER = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
CHUNK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 2 * CHUNK_BLOCKS  # 2 layers of K and V, fp16


class CpuExecutor:
    """The model executor's answers about the KV cache: two full-attention layers."""

    def get_kv_cache_specs(self):
        return [{f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**LAYER) for i in (0, 1)}]

    def get_supported_kv_cache_layouts(self):
        return [["LBNHC"]]

    def set_kv_cache_layout(self, name, interleave):
        pass

    def determine_available_memory(self):
        return [64 << 20]

    def initialize_from_config(self, configs):
        pass

    def compile_or_warm_up_model(self):
        pass


def engine_ports() -> int:
    """A base port B with vLLM's events at B + r, its replay at B + 2 + r, the plugin's
    at + 1000 and its snapshots at + 2000 all free."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        if all(
            port_free(base + o + i, "0.0.0.0") for o in (0, OFFSET, 2 * OFFSET) for i in range(4)
        ):
            return base
    raise RuntimeError("no free ports")


def engine_config(model_dir, base: int, rank: int):
    """vLLM's config as ``vllm serve`` builds it for data-parallel rank ``rank``."""
    config = EngineArgs(
        model=str(model_dir),
        skip_tokenizer_init=True,  # nothing here tokenizes
        served_model_name=["tiny-llama"],
        block_size=BLOCK,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256",
        max_model_len=512,
        num_gpu_blocks_override=GPU_BLOCKS,
        data_parallel_size=RANKS,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{base}",
            replay_endpoint=f"tcp://*:{base + 2}",
            buffer_steps=BUFFER,
            topic="kv@tier",
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "block_size": BLOCK * CHUNK_BLOCKS,
                "cpu_bytes_to_use": CPU_CHUNKS * CHUNK_BYTES,
                "self_describing_kv_events": True,
            },
        ),
    ).create_engine_config()
    # what the rank's own engine core process is started with
    config.parallel_config.data_parallel_rank = rank
    config.parallel_config.data_parallel_index = rank
    return config


class Chats:
    """Multi-turn chats over a few system prompts shared by every rank, and now and
    then a system prompt alone: block-aligned and cached, vLLM recomputes its last
    block (a hit stops a token short of the prompt), a second physical copy."""

    SYSTEM = [[random.Random(n).randrange(1, 4000) for _ in range(size)] for n, size in
              enumerate((96, 64, 128))]  # fmt: skip

    def __init__(self, seed: int, chats: int = 6) -> None:
        self._rng = random.Random(seed)
        self._histories: list[list[int]] = [[] for _ in range(chats)]

    def __next__(self) -> list[int]:
        i = self._rng.randrange(len(self._histories))
        system = self.SYSTEM[i % len(self.SYSTEM)]
        if self._rng.random() < 0.1:
            return list(system)
        history = self._histories[i]
        turn = [self._rng.randrange(1, 4000) for _ in range(self._rng.randrange(12, 60))]
        if len(system) + len(history) + len(turn) > MAX_PROMPT:
            history.clear()  # a new chat
        prompt = system + history + turn
        history.extend([*turn, SAMPLED])  # the next turn holds this one and its answer
        return prompt


class Rank:
    """One data-parallel rank's engine core: vLLM's scheduler, stepped by a thread
    that runs the engine core's busy loop over its input queue."""

    def __init__(self, model_dir, base: int, rank: int) -> None:
        self.rank, self.base = rank, base + rank
        self.config = engine_config(model_dir, base, rank)
        core = EngineCoreProc.__new__(EngineCoreProc)  # the parts of its start the test needs
        core.vllm_config = self.config
        core.model_executor = CpuExecutor()
        core.available_gpu_memory_for_kv_cache = -1
        core.shutdown_state = EngineShutdownState.RUNNING
        core.reject_new_requests = False
        core.input_queue = queue.Queue()
        # vLLM's KV cache planning, without the plugin's wrapper (which announces)
        init = EngineCore._initialize_kv_caches
        self.kv_cache_config = getattr(init, "__wrapped__", init)(core, self.config)
        # what the plugin's wrapper of _initialize_kv_caches does, on every rank
        self.service = snapshots.attach(core, self.config, self.kv_cache_config)
        block_size, hash_block_size = resolve_kv_cache_block_sizes(
            self.kv_cache_config, self.config
        )
        core.scheduler = self.scheduler = Scheduler(  # creates vLLM's publisher for the rank
            vllm_config=self.config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=block_size,
            hash_block_size=hash_block_size,
            include_finished_set=True,
        )
        self.core = core
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.publisher = self.scheduler.kv_event_publisher
        self.mirror = self.publisher._kvindex_mirror
        self.cpu = self.scheduler.connector.connector_scheduler.manager
        self.chats = Chats(seed=100 + rank)
        self.served: list[list[int]] = []  # every prompt's block hashes, as vLLM hashed them
        self.removed: Counter[str] = Counter()  # BlockRemoved events published, by medium
        self.taken: list[tuple[int, str, bool]] = []  # snapshots: seq, thread, client on
        self.client_on = False
        self._submitted = self._handled = 0
        self._stores: list[int] = []  # store jobs the worker submits next step
        self.loads = 0  # load jobs: chunks read back from the CPU tier
        self.copies_checked = False  # a GPU block with two physical copies compared
        self._idle = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._observe()
        self.thread = threading.Thread(target=self._busy_loop, name=f"EngineCore_DP{rank}")
        self.thread.start()

    def _observe(self) -> None:
        """Count what the rank publishes and record each snapshot it takes."""
        publish, take = self.publisher.publish, self.service._take

        def publishing(batch):
            for event in batch.events:
                if type(event).__name__ == "BlockRemoved":
                    self.removed[(event.medium or "GPU").upper()] += 1
            return publish(batch)

        def taking():
            taken = take()
            self.taken.append((taken.seq, threading.current_thread().name, self.client_on))
            return taken

        self.publisher.publish = publishing
        self.service._take = taking

    # --- the engine core's thread ---------------------------------------------

    def _busy_loop(self) -> None:
        """``EngineCoreProc.run_busy_loop``: wait for input when idle, handle all of
        it, step."""
        core = self.core
        try:
            while not self._stop.is_set():
                if not self.scheduler.has_requests():
                    self._idle.set()
                    try:
                        request = core.input_queue.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    self._idle.clear()
                    self._handle(request)
                while not core.input_queue.empty():
                    self._handle(core.input_queue.get_nowait())
                if self.scheduler.has_requests():
                    self._step()
        except BaseException as e:  # surfaced by the test
            self.error = e
            raise

    def _handle(self, request) -> None:
        EngineCoreProc._handle_client_request(self.core, *request)
        if request[0] == EngineCoreRequestType.ADD:
            self._handled += 1

    def _step(self) -> None:
        """One step: schedule, "run" the model and the offloading worker, update.

        The worker does what vLLM's ``OffloadingConnectorWorker`` does: a store job
        is submitted at the start of the step after the one that scheduled it (or
        at once when the scheduler flushes it), a load in its own step; each is
        reported done in the step it runs in."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        flushed = meta.jobs_to_flush or set()
        done, loaded = OffloadingWorkerMetadata(), set()
        for job_id in [*self._stores, *(j for j in meta.store_jobs if j in flushed)]:
            done.mark_completed(job_id)
        self._stores = [j for j in meta.store_jobs if j not in flushed]
        for job_id, job in meta.load_jobs.items():
            self.loads += 1
            done.mark_completed(job_id)
            if not job.sync:
                loaded.add(job.req_id)
        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [
            [SAMPLED] if requests[i].num_computed_tokens >= requests[i].num_tokens else []
            for i in ids
        ]
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={i: n for n, i in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=loaded or None, kv_connector_worker_meta=done
            ),
        )
        self.scheduler.update_from_output(output, result)

    # --- the client's side ----------------------------------------------------

    def submit(self, tokens: list[int] | None = None) -> list:
        """Send the chats' next request (or ``tokens``); its block hashes."""
        tokens = next(self.chats) if tokens is None else tokens
        params = SamplingParams(max_tokens=1)
        request = Request(
            f"dp{self.rank}-{self._submitted}", tokens, params, None, block_hasher=self.hasher
        )
        self.served.append(list(request.block_hashes))
        self._submitted += 1
        self.core.input_queue.put_nowait((EngineCoreRequestType.ADD, (request, 0)))
        return self.served[-1]

    def serve_now(self, tokens: list[int]) -> list:
        hashes = self.submit(tokens)
        self.settle()
        return hashes

    @property
    def outstanding(self) -> int:
        return self._submitted - self._handled + self.scheduler.get_num_unfinished_requests()

    def settle(self, timeout: float = 20.0) -> None:
        """Until every request submitted is served, its offloads stored and everything
        published is sent."""
        deadline = time.monotonic() + timeout
        while not (self._handled == self._submitted and self._idle.is_set()):
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"rank {self.rank} did not settle"
            time.sleep(0.01)
        assert self.mirror.flush(timeout)

    @property
    def last_seq(self) -> int:
        return self.mirror.last_offered_seq

    # --- vLLM's own state (read while the rank is settled) ----------------------

    def gpu_counts(self) -> dict[int, int]:
        """Each cached hash's physical copies in the block pool, as vLLM publishes it."""
        cached = self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        counts = {}
        for key, blocks in cached._cache.items():
            assert get_group_id(key) == 0
            counts[maybe_convert_block_hash(get_block_hash(key))] = (
                len(blocks) if type(blocks) is dict else 1
            )
        return counts

    def cpu_counts(self) -> dict[int, int]:
        """Each hash's CPU chunks listing it: the chunks the CPU tier holds, with the
        hashes vLLM's tracker announced each with (all its blocks'; only its end's for
        a chunk it could not describe, stored while an eviction of it was in flight:
        a placeholder)."""
        described = self.scheduler.connector.connector_scheduler._events_tracker
        counts: Counter[int] = Counter()
        for key, chunk in self.cpu._policy.chunks.items():
            assert chunk.is_ready
            meta = described._pending_event_metadata.get(key)
            hashes = meta.block_hashes if meta is not None else [get_block_hash(key)]
            assert make_offload_key(hashes[-1], 0) == key  # a chunk is keyed by its end
            counts.update(maybe_convert_block_hash(h) for h in hashes)
        return dict(counts)

    def gpu_hit(self, hashes: list) -> int:
        """vLLM's GPU prefix-cache hit for a prompt of these full blocks, in blocks."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        return coordinator.find_longest_cache_hit(hashes, len(hashes) * BLOCK)[1] // BLOCK

    def cpu_hit(self, hashes: list) -> int:
        """The leading whole chunks the CPU tier holds, in blocks."""
        chunks = self.cpu._policy.chunks
        hit = 0
        for end in range(CHUNK_BLOCKS - 1, len(hashes), CHUNK_BLOCKS):
            chunk = chunks.get(make_offload_key(hashes[end], 0))
            if chunk is None or not chunk.is_ready:
                break
            hit += CHUNK_BLOCKS
        return hit

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self.publisher.shutdown()


class Fleet:
    """The engine's ranks and a client keeping them busy."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self._client: threading.Thread | None = None
        self._client_on = threading.Event()

    def serve(self, requests: int) -> None:
        """Each rank serves ``requests`` more requests, one at a time; then settles."""
        for _ in range(requests):
            for rank in self.ranks:
                rank.submit()
            for rank in self.ranks:
                rank.settle()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """A client keeping each rank busy (two requests in flight) meanwhile."""
        self._client_on.set()
        for rank in self.ranks:
            rank.client_on = True
        self._client = threading.Thread(target=self._keep_busy, name="client")
        self._client.start()
        try:
            yield
        finally:
            self._client_on.clear()
            self._client.join()
            for rank in self.ranks:
                rank.client_on = False
                rank.settle()

    def _keep_busy(self) -> None:
        while self._client_on.is_set():
            for rank in self.ranks:
                if rank.outstanding < 2:
                    rank.submit()
            time.sleep(0.004)

    def batches(self) -> list[int]:
        return [rank.last_seq + 1 for rank in self.ranks]


@pytest.fixture
def fleet(model_dir, monkeypatch) -> Iterator[Fleet]:
    """Two ranks with the plugin installed as ``register`` installs it, with the token."""
    monkeypatch.setattr(reports, "_SETTINGS", reports._SETTINGS)  # the next tests' again after
    reports.install(PluginSettings(announce_token=TOKEN, events_port_offset=OFFSET))
    handle = EngineCoreProc._handle_client_request
    if not getattr(handle, "_kvindex", False):
        monkeypatch.setattr(
            EngineCoreProc, "_handle_client_request", snapshots.handling_requests(handle)
        )
    base = engine_ports()
    ranks: list[Rank] = []
    try:
        for rank in range(RANKS):
            ranks.append(Rank(model_dir, base, rank))
        yield Fleet(ranks)
    finally:
        for rank in ranks:
            rank.close()


@pytest.fixture
def redis(tmp_path) -> Iterator[RedisServer]:
    """A redis-server of the test's own (no automatic saves: an RDB only on SAVE)."""
    if REDIS_SERVER is None:
        pytest.fail("redis-server not installed: run make setup (scripts/ensure-redis.sh)")
    server = RedisServer(tmp_path / "redis", free_redis_port()).start()
    yield server
    server.stop()


class Kvindex:
    """``kvindex serve`` (embedded, or over ``redis``), asked as an operator and a
    router ask it."""

    def __init__(self, workdir, redis: RedisServer | None) -> None:
        args = ("--redis-url", redis.url, "--redis-prefix", "snap") if redis else ()
        self.serve = Serve(workdir, TOKEN, *args)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        self.http = httpx.Client(base_url=self.serve.url, headers=headers, timeout=10)

    def register(self, fleet: Fleet) -> None:
        """The engine as the plugin announces it: rank 0's config describes its ranks."""
        settings = PluginSettings(
            announce_token=TOKEN,
            engine_name=NAME,
            engine_host="127.0.0.1",
            events_port_offset=OFFSET,
        )
        rank = fleet.ranks[0]
        spec = announcement(rank.config, rank.kv_cache_config, settings).spec
        assert spec["dp_ranks"] == RANKS and spec["reuse_reports"] == "filtered"
        assert spec["snapshot_endpoint"] == f"tcp://127.0.0.1:{rank.base + 2 * OFFSET}"
        answer = self.http.post("/engines", json=spec)
        assert answer.status_code == 201, answer.text

    def ranks(self) -> list[dict]:
        answer = self.http.get(f"/engines/{NAME}")
        assert answer.status_code == 200, answer.text
        return answer.json()["ranks"]

    def restored(self, times: int, timeout: float = 40.0) -> list[dict]:
        """Until every rank restored ``times`` times from a snapshot in all."""
        deadline = time.monotonic() + timeout
        while True:
            ranks = self.ranks()
            if all(r["restores"] == times for r in ranks):
                return ranks
            assert time.monotonic() < deadline, ranks
            time.sleep(0.05)

    def caught_up(self, fleet: Fleet, restores: int, timeout: float = 40.0) -> list[dict]:
        """Until every rank applied its engine's last batch, restored ``restores``
        times in all and is not degraded."""
        deadline = time.monotonic() + timeout
        while True:
            ranks = self.ranks()
            last = [rank.last_seq for rank in fleet.ranks]
            if [r["applied_seq"] for r in ranks] == last and all(
                r["restores"] == restores and not r["degraded"] for r in ranks
            ):
                return ranks
            assert time.monotonic() < deadline, (last, ranks)
            time.sleep(0.05)

    def close(self) -> None:
        self.http.close()
        self.serve.stop()


@pytest.fixture
def kvindex_late(tmp_path) -> Iterator:
    """Starts ``kvindex serve`` when the test says (``redis``: its store)."""
    started: list[Kvindex] = []

    def start(redis: RedisServer | None = None) -> Kvindex:
        started.append(Kvindex(tmp_path, redis))
        return started[-1]

    yield start
    for made in started:
        made.close()


def assert_exact(kvindex: Kvindex, fleet: Fleet, restores: int) -> list[dict]:
    """Once kvindex caught up: it answers, rank by rank and tier by tier, what vLLM
    holds (its ranks' status returned)."""
    status = kvindex.caught_up(fleet, restores)
    truths = [(rank.gpu_counts(), rank.cpu_counts()) for rank in fleet.ranks]
    for rank, (gpu, cpu), state in zip(fleet.ranks, truths, status, strict=True):
        assert gpu and cpu, "each tier holds blocks"
        assert state["blocks"] == {"GPU": len(gpu), "CPU": len(cpu), "STORAGE": 0}, rank.rank
        rank.copies_checked |= any(n > 1 for n in gpu.values())
    # every block vLLM holds, with vLLM's count, per rank and tier (with the totals
    # above: and nothing else)
    for block in set().union(*(set(g) | set(c) for g, c in truths)):
        answer = kvindex.http.get(f"/blocks/{block}")
        assert answer.status_code == 200, answer.text
        got = {
            (r["dp_rank"], r["medium"]): r["count"]
            for r in answer.json()["residency"]
            if r["engine"] == NAME
        }
        want = {
            (n, medium): counts[block]
            for n, tiers in enumerate(truths)
            for medium, counts in zip(("GPU", "CPU"), tiers, strict=True)
            if block in counts
        }
        assert got == want, block
    # what a router asks: each rank's GPU and CPU prefix of the prompts served last
    for hashes in [p for rank in fleet.ranks for p in rank.served[-8:]]:
        body = {"block_hashes": [maybe_convert_block_hash(h) for h in hashes], "engines": [NAME]}
        answer = kvindex.http.post("/prefix-match", json=body)
        assert answer.status_code == 200, answer.text
        got = {e["dp_rank"]: (e["gpu_blocks"], e["cpu_blocks"]) for e in answer.json()["engines"]}
        want = {rank.rank: (rank.gpu_hit(hashes), rank.cpu_hit(hashes)) for rank in fleet.ranks}
        assert got == want, hashes
    return status


def redis_cli(redis: RedisServer, *args: str) -> str:
    done = subprocess.run([REDIS_CLI, "-p", str(redis.port), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_late_kvindex_is_exact_from_snapshots_and_again_after_redis_loses_data(
    fleet, kvindex_late, redis
) -> None:
    fleet.serve(32)  # a chat workload: the GPU pool and the CPU tier both evict
    assert min(fleet.batches()) >= 3 * BUFFER, "batches 0.. are long gone from replay"
    for rank in fleet.ranks:
        assert rank.removed["GPU"] and rank.removed["CPU"], rank.removed
        assert rank.loads, "some prompts were read back from the CPU tier"

    kvindex = kvindex_late(redis)
    with fleet.stepping():  # the snapshots are taken while the ranks keep stepping
        kvindex.register(fleet)
        status = kvindex.restored(1)
        time.sleep(0.3)  # and step on a while after them
    for rank in fleet.ranks:
        [(seq, thread, client_on)] = rank.taken
        assert thread == rank.thread.name, "taken on the engine core's own thread"
        assert client_on and seq < rank.last_seq, "the rank stepped on past its snapshot"
    assert all(r["gaps_unfilled"] >= 1 and r["snapshot_error"] is None for r in status), status
    status = assert_exact(kvindex, fleet, restores=1)
    anomalies = [r["anomalies"] for r in status]

    fleet.serve(6)  # applied on top of the snapshot, batch by batch
    for rank in fleet.ranks:  # and a second physical copy of a block, as it comes
        rank.serve_now(Chats.SYSTEM[1]), rank.serve_now(Chats.SYSTEM[1])
    status = assert_exact(kvindex, fleet, restores=1)
    assert all(rank.copies_checked for rank in fleet.ranks)
    assert [r["anomalies"] for r in status] == anomalies, "no removal of a block not held"

    # Redis loses everything: each rank restores from a new snapshot
    assert redis_cli(redis, "FLUSHALL") == "OK"
    with fleet.stepping():
        time.sleep(0.5)
    assert_exact(kvindex, fleet, restores=2)
    assert [len(rank.taken) for rank in fleet.ranks] == [2, 2]

    # Redis comes back from an older dump, more than a replay buffer behind
    assert redis_cli(redis, "SAVE") == "OK"
    before = fleet.batches()
    fleet.serve(8)
    assert min(b - a for a, b in zip(before, fleet.batches(), strict=True)) > BUFFER
    kvindex.caught_up(fleet, restores=2)  # applied them all: the dump is behind them
    redis.restart(signal.SIGKILL)
    assert int(redis_cli(redis, "DBSIZE")) > 0, "back from the dump, not empty"
    with fleet.stepping():
        time.sleep(0.5)
    assert_exact(kvindex, fleet, restores=3)
    assert [len(rank.taken) for rank in fleet.ranks] == [3, 3]


def test_an_idle_engine_is_woken_for_its_snapshot(fleet, kvindex_late) -> None:
    """Nothing is published while kvindex asks: the snapshot server wakes each
    engine core through its input queue, and the rank is exact with its last batch."""
    fleet.serve(32)
    for rank in fleet.ranks:
        system = Chats.SYSTEM[0]
        rank.serve_now(system)
        last = rank.serve_now(system)[-1]  # cached: vLLM computes its last block again
        assert rank.gpu_counts()[maybe_convert_block_hash(last)] >= 2
    kvindex = kvindex_late()  # embedded
    kvindex.register(fleet)
    kvindex.restored(1)
    for rank in fleet.ranks:
        [(seq, thread, client_on)] = rank.taken
        assert thread == rank.thread.name and not client_on
        assert seq == rank.last_seq, "taken between steps, with everything published"
    assert_exact(kvindex, fleet, restores=1)
    assert all(rank.copies_checked for rank in fleet.ranks)


def test_a_failure_counting_a_batch_stops_the_snapshots_not_the_engine(monkeypatch) -> None:
    """The plugin counts each batch inside vLLM's publish, on the engine's thread: a bug
    there must cost the snapshots, never the engine's step."""
    reports.install(PluginSettings(announce_token=TOKEN, events_port_offset=OFFSET))
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**LAYER))]
    no_connector = SimpleNamespace(kv_transfer_config=None)
    service = snapshots.attach(SimpleNamespace(), no_connector, KVCacheConfig(11, [], groups))
    base = engine_ports()
    publisher = ZmqEventPublisher(0, f"tcp://*:{base}", f"tcp://*:{base + 2}", topic="kv")
    try:
        assert getattr(publisher, reports._SNAPSHOTS) is service

        def broken(seq: int, batch: object) -> None:
            raise RuntimeError("a bug in the counting")

        monkeypatch.setattr(service, "published", broken)
        publisher.publish(KVEventBatch(1.0, []))  # raises nothing into vLLM
        assert not hasattr(publisher, reports._SNAPSHOTS)
        publisher.publish(KVEventBatch(2.0, []))
        mirror = getattr(publisher, reports._MIRROR)
        assert mirror.flush() and mirror.last_offered_seq == 1  # the stream goes on
    finally:
        publisher.shutdown()
