"""Item 15: engine snapshots (issue 25): their size and time, what they cost the
engine, and how soon a kvindex started late answers exactly.

Every figure's baseline is measured in the same run, interleaved with it:

- size and time: one rank holding N cached GPU blocks of one group (1M; 200k
  with ``--quick``), with 64-bit int hashes and with 32-byte digests. The
  snapshot's encoded bytes against the same blocks published as
  ``BlockStored`` batches of 512 hashes (vLLM's wire); its encode and decode
  time against those batches' (typed decode, no token ids, as kvindex reads
  them); and :func:`~indexer.stores.base.apply_snapshot` into the embedded
  store and into a private ``redis-server`` against applying the same batches
  one after the other with :func:`~indexer.stores.base.apply_events` (what a
  consumer that replays them does; decoding excluded on both sides). Redis is
  timed with a socket timeout no apply reaches; one apply with kvindex's
  default (5 s) before says whether the snapshot fits in it (a note if not);
- the engine's side, with the vLLM plugin's own code
  (:class:`producer.vllm_plugin.snapshots.EngineSnapshots`) on a table shaped
  like vLLM 0.33's block pool cache (1M entries in both modes: 32-byte hash +
  4-byte group id keys to a block, 1% to a dict of two copies): the pause on
  the engine thread (``_take``: the dict copy and the multi-copy pass) against
  what the snapshot server's thread then does with it (keys to published
  hashes, ``_assembled``, and encoding; vLLM's setting for int hashes stood in
  for by its default where vLLM is not installed). Per published
  batch while nobody asks (CPU time of the calling thread): the plugin's
  snapshot hook (the publisher's service and ``published()``, offloading off)
  against the mirror publisher's own ``publish_encoded`` of the same batch;
  the plugin's whole publish wrapper with snapshots on against off, also with
  an offloading connector (``published()`` then decodes the batch's lower-tier
  events to count them). The real engine's step time with and without the plugin is
  :mod:`bench.snapshot_engine_step`, run in the vLLM tier's venv (this item
  runs it when that venv exists);
- time to exact answers: a simulated engine rank
  (:class:`producer.snapshots.SelfSnapshotting` around a
  :class:`producer.publisher.Publisher` with ``buffer_steps=10``) publishes N
  blocks in batches of 512, then ``kvindex serve`` starts (embedded store, the
  engine given by ``--engine``): seconds from the process's start until the
  rank has restored once from the snapshot, is not degraded and has applied
  the engine's last seq (``GET /engines/NAME``), and the same from its first
  answered ``/healthz``. Baseline: the same start against an engine
  publishing the same batches whose replay buffer still holds them all
  (kvindex replays them, no snapshot).

Run alone: ``python -m bench [--quick] --only 15`` (about 1.5 minutes quick, 5 full,
on two shared cores).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec

from bench.report import Figure, Report
from indexer.core.events import GPU, BlockStored, EventBatch, RankId
from indexer.core.snapshot import Snapshot, SnapshotTier, decode_snapshot, encode_snapshot
from indexer.engines.vllm.wire import decode_batch
from indexer.stores import MemoryStore, apply_events
from indexer.stores.base import Store, apply_snapshot
from producer.publisher import Publisher
from producer.snapshots import SelfSnapshotting
from tests.servers import RedisServer, free_port

SECTION = "15"
RANK = RankId("snap", 0)
BATCH = 512  # hashes per BlockStored batch of the baselines
TOKEN = "bench-snapshot-token"
KINDS = ("int", "bytes")  # 64-bit ints (vLLM's default on the wire), 32-byte digests
VENV_PYTHON = Path.home() / ".cache/kvindex/vllm-0.33.0-venv/bin/python"
_ENCODE = msgspec.msgpack.Encoder().encode
#: The Redis client's socket timeout of the timed applies (kvindex's default is 5 s).
LONG_SOCKET_TIMEOUT = 300.0
CALLS_CHUNK = 500  # per-batch calls of one candidate before the next's


def blocks_of(quick: bool) -> int:
    return 200_000 if quick else 1_000_000


def hashes(n: int, kind: str, seed: int = 25) -> list:
    r = random.Random(seed)
    if kind == "int":
        return [r.getrandbits(64) for _ in range(n)]
    return [r.randbytes(32) for _ in range(n)]


def batches_of(blocks: list) -> list[EventBatch]:
    return [
        EventBatch(float(i), [BlockStored(blocks[i : i + BATCH], block_size=16)], 0)
        for i in range(0, len(blocks), BATCH)
    ]


def gpu_snapshot(blocks: list, batches: int) -> Snapshot:
    """The blocks as one GPU tier, as of the last of ``batches`` batches."""
    return Snapshot(batches - 1, float(batches - 1), [SnapshotTier(GPU, None, 0, None, blocks)])


def _median_times(repeats: int, candidates: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each candidate times itself (so freeing what it built is not counted);
    medians of ``repeats`` interleaved runs."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            gc.collect()
            times[name].append(fn())
    return {name: statistics.median(t) for name, t in times.items()}


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


# --- 1. size and time -------------------------------------------------------------


def _codec(blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    snapshot = gpu_snapshot(blocks, len(batches))
    payload = encode_snapshot(snapshot)
    wire = [_ENCODE(b) for b in batches]
    assert decode_snapshot(payload).blocks == len(blocks)
    times = _median_times(
        repeats,
        {
            "snapshot_encode": lambda: _timed(lambda: encode_snapshot(snapshot)),
            "batches_encode": lambda: _timed(lambda: [_ENCODE(b) for b in batches]),
            "snapshot_decode": lambda: _timed(lambda: decode_snapshot(payload)),
            "batches_decode": lambda: _timed(lambda: [decode_batch(p, tokens=False) for p in wire]),
        },
    )
    return {
        "snapshot_bytes": len(payload),
        "batches_bytes": sum(map(len, wire)),
        "seconds": times,
    }


async def _snapshot_into(store: Store, snapshot: Snapshot) -> float:
    started = time.perf_counter()
    result = await apply_snapshot(store, RANK, snapshot)
    took = time.perf_counter() - started
    assert result.applied, result
    return took


async def _batches_into(store: Store, batches: list[EventBatch]) -> float:
    started = time.perf_counter()
    for seq, batch in enumerate(batches):
        await apply_events(store, RANK, seq, batch)
    return time.perf_counter() - started


def _memory_apply(blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    snapshot = gpu_snapshot(blocks, len(batches))
    kept: dict[str, MemoryStore] = {}

    def run(name: str, apply: Callable[[MemoryStore], object]) -> float:
        kept.pop(name, None)  # the previous repeat's store is freed before timing
        gc.collect()
        kept[name] = store = MemoryStore()
        return asyncio.run(apply(store))

    times = _median_times(
        repeats,
        {
            "snapshot": lambda: run("snapshot", lambda s: _snapshot_into(s, snapshot)),
            "batches": lambda: run("batches", lambda s: _batches_into(s, batches)),
        },
    )
    counts = {name: asyncio.run(s.block_counts(RANK)) for name, s in kept.items()}
    assert counts["snapshot"] == counts["batches"] and counts["snapshot"][GPU] == len(blocks)
    return {"seconds": times, "gpu_blocks": counts["snapshot"][GPU]}


async def _redis_apply(url: str, blocks: list, batches: list[EventBatch], repeats: int) -> dict:
    from redis.asyncio import Redis

    from indexer.errors import StoreUnavailable
    from indexer.stores.redis import RedisConfig, RedisStore

    snapshot = gpu_snapshot(blocks, len(batches))
    client = Redis.from_url(url)
    times: dict[str, list[float]] = {"snapshot": [], "batches": []}
    counts: dict[str, dict] = {}
    try:
        # First as kvindex is configured by default: the whole snapshot is one apply,
        # its calls sent in round trips that must each answer within ``socket_timeout``.
        store = RedisStore(RedisConfig(url, prefix="snap-default", sweep_interval=None))
        try:
            default: dict = {"seconds": await _snapshot_into(store, snapshot)}
        except StoreUnavailable as e:
            default = {"failed": str(e)}
        finally:
            await store.close()
        # Then timed with a socket timeout no apply reaches, so both sides complete.
        for i in range(repeats):
            for name in times:
                await client.flushall()
                gc.collect()
                config = RedisConfig(url, prefix=f"snap-{i}", sweep_interval=None,
                                     socket_timeout=LONG_SOCKET_TIMEOUT)  # fmt: skip
                store = RedisStore(config)
                try:
                    if name == "snapshot":
                        times[name].append(await _snapshot_into(store, snapshot))
                    else:
                        times[name].append(await _batches_into(store, batches))
                    counts[name] = await store.block_counts(RANK)
                finally:
                    await store.close()
        await client.flushall()
    finally:
        await client.aclose()
    assert counts["snapshot"] == counts["batches"] and counts["snapshot"][GPU] == len(blocks)
    return {
        "seconds": {name: statistics.median(t) for name, t in times.items()},
        "default_config": default,
        "socket_timeout": LONG_SOCKET_TIMEOUT,
    }


def _size_and_time(report: Report, n: int, quick: bool) -> dict:
    repeats = 3 if quick else 5
    redis_repeats = 1 if quick else 2
    workdir = Path(tempfile.mkdtemp(prefix="bench-snapshots-"))
    redis = RedisServer(workdir, free_port()).start() if shutil.which("redis-server") else None
    out: dict[str, dict] = {}
    try:
        for kind in KINDS:
            blocks = hashes(n, kind)
            batches = batches_of(blocks)
            out[kind] = {
                "codec": _codec(blocks, batches, repeats),
                "memory": _memory_apply(blocks, batches, repeats),
            }
            if redis is not None:
                out[kind]["redis"] = asyncio.run(
                    _redis_apply(redis.url, blocks, batches, redis_repeats)
                )
            del blocks, batches
            gc.collect()
    finally:
        if redis is not None:
            redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    label = f"{n / 1e6:g}M"
    base = f"same blocks as BlockStored batches of {BATCH}"
    for kind, d in out.items():
        what = "64-bit int" if kind == "int" else "32-byte"
        codec, s = d["codec"], d["codec"]["seconds"]
        report.add(
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: encoded size",
                   codec["snapshot_bytes"] / 1e6, "MB", f"{base}, on the wire",
                   codec["batches_bytes"] / 1e6,
                   note=f"{codec['snapshot_bytes'] / n:.2f} B/block "
                   f"(batches: {codec['batches_bytes'] / n:.2f})"),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: encode",
                   1000 * s["snapshot_encode"], "ms", f"{base}: encode",
                   1000 * s["batches_encode"]),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: decode",
                   1000 * s["snapshot_decode"], "ms", f"{base}: typed decode (no token ids)",
                   1000 * s["batches_decode"]),
            Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: apply_snapshot, "
                   "embedded store", 1000 * d["memory"]["seconds"]["snapshot"], "ms",
                   f"{base}: apply_events one by one", 1000 * d["memory"]["seconds"]["batches"]),
        )  # fmt: skip
        if "redis" in d:
            r, default = d["redis"]["seconds"], d["redis"]["default_config"]
            verdict = (
                f"FAILED with the default socket_timeout (5 s): {default['failed']}"
                if "failed" in default
                else f"with the default socket_timeout (5 s): {1000 * default['seconds']:.0f} ms"
            )
            report.add(
                Figure(SECTION, f"snapshot, {label} GPU blocks of {what} hashes: apply_snapshot, "
                       "Redis (standalone)", 1000 * r["snapshot"], "ms",
                       f"{base}: apply_events one by one", 1000 * r["batches"],
                       note=f"timed with socket_timeout {LONG_SOCKET_TIMEOUT:g} s; {verdict}"),
            )  # fmt: skip
            if "failed" in default:
                report.notes.append(
                    f"item 15: apply_snapshot of {n:,} {what}-hash blocks into Redis {verdict}"
                )
    if redis is None:
        report.notes.append("item 15: Redis apply skipped, redis-server not found")
    return out


# --- 2. the engine's side -------------------------------------------------------


class _Block:
    """Shaped like vLLM 0.33's ``KVCacheBlock`` (its slots)."""

    __slots__ = (
        "_block_hash", "_block_hash_num_tokens", "block_id", "is_null", "next_free_block",
        "pool", "prev_free_block", "ref_cnt",
    )  # fmt: skip

    def __init__(self, block_id: int, key: bytes) -> None:
        self.block_id, self.ref_cnt, self.pool = block_id, 0, None
        self._block_hash, self._block_hash_num_tokens = key, 16
        self.prev_free_block = self.next_free_block = None
        self.is_null = False


def block_pool_cache(n: int, copies_every: int = 100) -> dict:
    """``BlockHashToBlockMap._cache`` of ``n`` cached hashes: 32-byte hash + the
    group id's 4 bytes, to a block, or for every ``copies_every``-th to a dict of
    two physical copies."""
    r = random.Random(7)
    group = (0).to_bytes(4, "big")
    cache: dict = {}
    for i in range(n):
        key = r.randbytes(32) + group
        block = _Block(i, key)
        cache[key] = {i: block, n + i: _Block(n + i, key)} if i % copies_every == 0 else block
    return cache


@contextlib.contextmanager
def _vllm_stub() -> Iterator[None]:
    """``vllm.envs`` with vLLM 0.33's default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
    (int hashes), where vLLM is not installed, for the plugin's ``_assembled``;
    removed after."""
    if importlib.util.find_spec("vllm") is not None:
        yield
        return
    names = ("vllm", "vllm.envs")
    envs = types.ModuleType(names[-1])
    envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = True
    root = types.ModuleType(names[0])
    root.envs = envs
    modules = {names[0]: root, names[-1]: envs}
    sys.modules.update(modules)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _engine_side(report: Report, quick: bool) -> dict:
    from producer.vllm_plugin import snapshots as plugin

    n = 1_000_000
    repeats = 5 if quick else 9
    cache = block_pool_cache(n)
    pool = SimpleNamespace(
        cached_block_hash_to_block=SimpleNamespace(_cache=cache), kv_event_queue=[]
    )
    core = SimpleNamespace(
        scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool))
    )
    service = plugin.EngineSnapshots(core, SimpleNamespace(kv_cache_groups=[]), offloading=False)
    taken: list = []

    def take() -> float:
        taken.clear()
        gc.collect()
        started = time.perf_counter()
        taken.append(service._take())
        return time.perf_counter() - started

    def off_thread() -> float:
        started = time.perf_counter()
        snapshot = plugin._assembled(taken[0], service._kinds)
        payload = encode_snapshot(snapshot)
        took = time.perf_counter() - started
        assert snapshot.blocks == n and sum(snapshot.tiers[0].counts) == n + n // 100
        taken.append(len(payload))
        return took

    def copy_only() -> float:
        gc.collect()
        started = time.perf_counter()
        copied = cache.copy()
        took = time.perf_counter() - started
        del copied
        return took

    with _vllm_stub():
        times = _median_times(
            repeats, {"take": take, "assemble_encode": off_thread, "copy": copy_only}
        )
    snapshot_bytes = taken[-1]
    taken.clear()
    cache.clear()  # the table's memory, before the per-batch loops
    gc.collect()
    per_batch = _per_batch(plugin, service, 100_000 if quick else 200_000)
    details = {
        "blocks": n,
        "engine_thread_s": times["take"],
        "dict_copy_s": times["copy"],
        "server_thread_s": times["assemble_encode"],
        "snapshot_bytes": snapshot_bytes,
        "per_batch_ns": per_batch,
    }
    report.add(
        Figure(SECTION, "snapshot, engine thread: the plugin's _take of a 1M-entry block-pool "
               "cache (dict copy + multi-copy pass)", 1000 * times["take"], "ms",
               "the same snapshot's work off the engine thread (keys to hashes + encode)",
               1000 * times["assemble_encode"],
               note=f"ms per 1M cached blocks, 1% of them with two copies; the dict copy alone "
               f"{1000 * times['copy']:.0f} ms; the pause against the engine's own step time: "
               "bench.snapshot_engine_step"),
        Figure(SECTION, "snapshot, per published batch while nobody asks: the plugin's "
               "snapshot hook (the publisher's service + published(), offloading off)",
               per_batch["hook"], "ns", "the mirror publisher's publish_encoded of the batch",
               per_batch["publish_encoded"],
               note=f"CPU time of the calling thread, the candidates in turn {CALLS_CHUNK} calls "
               f"at a time; loop overhead included in both (an empty loop: "
               f"{per_batch['empty_loop']:.0f} ns per pass)"),
        Figure(SECTION, "snapshot, per published batch while nobody asks: the plugin's publish "
               "wrapper, snapshots on (offloading off)", per_batch["wrapper_snapshots"], "ns",
               "the same wrapper, snapshots off", per_batch["wrapper_no_snapshots"],
               note="the wrapper as the plugin installs it (report filter, encode, mirror "
               "publish, snapshot hook), vLLM's own publish left out; a 32-hash batch"),
        Figure(SECTION, "snapshot, per published batch while nobody asks: the plugin's publish "
               "wrapper, snapshots on with an offloading connector (published() decodes the "
               "batch to count lower tiers)", per_batch["wrapper_offloading"], "ns",
               "the same wrapper, snapshots off", per_batch["wrapper_no_snapshots"]),
    )  # fmt: skip
    return details


def _per_batch(plugin, service, calls: int) -> dict:
    """ns per published batch: the plugin's publish wrapper (its mirror and snapshot
    part; vLLM's own publish left out) with snapshots on, off, and on with an
    offloading connector; the snapshot part alone; the mirror publisher's
    ``publish_encoded`` alone (its batches go out on its thread). CPU time of the
    calling thread (the engine's), which the shared machine's other work inflates
    less than wall time."""
    from producer.vllm_plugin import reports

    batch = EventBatch(1.0, [BlockStored(list(range(1 << 40, (1 << 40) + 32)), block_size=16)], 0)
    payload = _ENCODE(batch)
    mirror = Publisher(f"tcp://127.0.0.1:{free_port()}", bind=True, max_queue_size=4 * calls)
    offloading = plugin.EngineSnapshots(service._core, SimpleNamespace(kv_cache_groups=[]), True)
    wrapper = reports._publishing(lambda self, events: None)
    attr = reports._SNAPSHOTS

    def publisher(found) -> SimpleNamespace:
        made = SimpleNamespace(**{reports._MIRROR: mirror})
        if found is not None:
            setattr(made, attr, found)
        return made

    def wrapped(found) -> Callable[[int], None]:
        self = publisher(found)

        def loop(n: int) -> None:
            for _ in range(n):
                wrapper(self, batch)

        return loop

    def hook(n: int) -> None:  # the wrapper's two lines of snapshots
        self = publisher(service)
        for seq in range(n):
            if (found := getattr(self, attr, None)) is not None:
                found.published(seq, batch)

    def publish(n: int) -> None:
        for _ in range(n):
            mirror.publish_encoded(payload)

    def empty(n: int) -> None:
        for _ in range(n):
            pass

    candidates = {
        "wrapper_snapshots": wrapped(service),
        "wrapper_no_snapshots": wrapped(None),
        "wrapper_offloading": wrapped(offloading),
        "hook": hook,
        "publish_encoded": publish,
        "empty_loop": empty,
    }
    # In turn, CALLS_CHUNK calls of each (forwards, then backwards), the mirror's queue
    # sent between them: a slow moment of the shared machine hits all alike.
    spent = dict.fromkeys(candidates, 0.0)
    chunks = max(1, calls // CALLS_CHUNK)
    try:
        for chunk in range(chunks):
            for name in list(candidates)[:: 1 if chunk % 2 == 0 else -1]:
                mirror.flush(30)
                started = time.thread_time()
                candidates[name](CALLS_CHUNK)
                spent[name] += time.thread_time() - started
    finally:
        mirror.close()
    return {name: t / (chunks * CALLS_CHUNK) * 1e9 for name, t in spent.items()}


def _vllm_step(report: Report, quick: bool) -> dict | None:
    """:mod:`bench.snapshot_engine_step` in the vLLM tier's venv, when it exists."""
    if not VENV_PYTHON.exists():
        report.notes.append(f"item 15: vLLM step loop skipped, no {VENV_PYTHON}")
        return None
    from bench import snapshot_engine_step

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        command = [str(VENV_PYTHON), "-m", "bench.snapshot_engine_step", "--json", str(out)]
        root = Path(__file__).resolve().parents[1]
        env = {**os.environ, "PYTHONPATH": str(root), "VLLM_TARGET_DEVICE": "cpu"}
        done = subprocess.run([*command, *(["--quick"] if quick else [])], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=1800)  # fmt: skip
        if done.returncode != 0:  # the other figures of the item stand
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            report.notes.append(f"item 15: bench.snapshot_engine_step failed: {tail[0]}")
            return {"failed": done.stderr[-4000:]}
        details = msgspec.json.decode(out.read_bytes())
    report.add(*snapshot_engine_step.figures(details, SECTION))
    return details


# --- 3. time to exact answers ----------------------------------------------------


class _Engine:
    """One simulated rank publishing ``batches``: with ``buffer`` batches of replay,
    answering snapshots (or not)."""

    def __init__(self, name: str, batches: list[EventBatch], buffer: int, snapshots: bool):
        self.name = name
        self.endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(3)]
        pub, replay, snapshot = self.endpoints
        publisher = Publisher(pub, replay, bind=True, buffer_steps=buffer, hwm=10)
        self.rank = SelfSnapshotting(publisher, snapshot, TOKEN) if snapshots else None
        self.publisher = publisher
        for batch in batches:
            sent = self.rank.publish(batch) if self.rank else publisher.publish(batch)
            assert sent
        assert publisher.flush(60)
        self.last_seq = publisher.next_seq - 1

    def engine_flag(self) -> str:
        pub, replay, snapshot = self.endpoints
        spec = f"{self.name}={pub},replay_endpoint={replay},reuse_reports=counted,block_size=16"
        return spec + (f",snapshot_endpoint={snapshot}" if self.rank else "")

    def close(self) -> None:
        if self.rank:
            self.rank.close()
        else:
            self.publisher.close()


async def _until_exact(engine: _Engine, restores: int, timeout: float) -> dict:
    """``kvindex serve`` started now, following ``engine``: seconds to /healthz and to
    exact (restored ``restores`` times, not degraded, the last seq applied)."""
    port = free_port()
    command = [sys.executable, "-m", "kvindex", "serve", "--port", str(port)]
    command += ["--engine", engine.engine_flag(), "--log-level", "error"]
    env = {**os.environ, "KVINDEX_AUTH_TOKEN": TOKEN}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    up = state = None
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10, headers=headers
        ) as client:
            while time.perf_counter() - started < timeout:
                assert child.poll() is None, "kvindex serve exited"
                try:
                    if up is None:
                        if (await client.get("/healthz")).status_code == 200:
                            up = time.perf_counter() - started
                    else:
                        response = await client.get(f"/engines/{engine.name}")
                        if response.status_code == 200:
                            state = response.json()["ranks"][0]
                            if (
                                state["applied_seq"] == engine.last_seq
                                and state["restores"] == restores
                                and not state["degraded"]
                            ):
                                exact = time.perf_counter() - started
                                return {"up_s": up, "exact_s": exact, "after_up_s": exact - up}
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.02)
    finally:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    raise TimeoutError(f"{engine.name}: not exact in {timeout:g} s (last state {state})")


def _late_start(report: Report, n: int, quick: bool) -> dict:
    repeats = 3
    batches = batches_of(hashes(n, "int", seed=3))
    snapshotting = _Engine("late", batches, 10, snapshots=True)
    replaying = _Engine("replayed", batches, len(batches) + 10, snapshots=False)
    del batches
    gc.collect()
    runs: dict[str, list[dict]] = {"snapshot": [], "replay": []}
    try:
        for i in range(repeats):  # which goes first alternates
            for name in ("snapshot", "replay")[:: 1 if i % 2 == 0 else -1]:
                engine, restores = (snapshotting, 1) if name == "snapshot" else (replaying, 0)
                runs[name].append(asyncio.run(_until_exact(engine, restores, 300)))
        served = snapshotting.rank.server.served
    finally:
        snapshotting.close()
        replaying.close()
    assert served == repeats, served
    medians = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    details = {"blocks": n, "batches": snapshotting.last_seq + 1, "runs": runs, "median": medians}
    snap, replay = medians["snapshot"], medians["replay"]
    report.add(
        Figure(SECTION, f"late start, {n / 1e6:g}M GPU blocks: kvindex serve's start to exact "
               "answers, the engine's replay buffer 10 batches deep (restored from its snapshot)",
               snap["exact_s"], "s", f"the same start, an engine whose replay buffer holds all "
               f"{details['batches']:,} batches (replayed)", replay["exact_s"],
               note=f"medians of {repeats}, interleaved; the process answers /healthz after "
               f"{snap['up_s']:.2f} s (replay runs: {replay['up_s']:.2f} s); embedded store"),
        Figure(SECTION, f"late start, {n / 1e6:g}M GPU blocks: from kvindex serve's first "
               "/healthz to exact answers, restored from the snapshot", snap["after_up_s"], "s",
               "the same, replayed from a buffer holding every batch", replay["after_up_s"],
               note="the process's start (interpreter, imports, HTTP up) left out"),
    )  # fmt: skip
    return details


def run(report: Report, quick: bool) -> dict:
    n = blocks_of(quick)
    details = {
        "size_and_time": _size_and_time(report, n, quick),
        "engine": _engine_side(report, quick),
        "late_start": _late_start(report, n, quick),
    }
    details["vllm_step"] = _vllm_step(report, quick)
    if quick:
        report.notes.append(
            f"Item 15 (snapshots), quick run: {n:,} cached blocks for size, apply and late "
            "start (1M in the full run); the engine-side figures use 1M in both."
        )
    return details
