"""Bench item 15, part 2 (:mod:`bench.snapshots`): what snapshots cost the engine,
since the plugin runs inside vLLM's engine thread: the pause a snapshot takes
there against the work done off it, and the per-batch cost of the snapshot hook
while nobody asks, each against the publishing it rides on."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec

from bench.report import Figure, Report
from bench.snapshots.data import ENCODE, SECTION, median_times
from indexer.core.events import BlockStored, EventBatch
from indexer.core.snapshot import encode_snapshot
from producer.publisher import Publisher
from tests.servers import free_port

VENV_PYTHON = Path.home() / ".cache/kvindex/vllm-0.33.0-venv/bin/python"
CALLS_CHUNK = 500  # per-batch calls of one candidate before the next's


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


def engine_side(report: Report, quick: bool) -> dict:
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
        times = median_times(
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
               "bench.snapshots.engine_step"),
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
    payload = ENCODE(batch)
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


def vllm_step(report: Report, quick: bool) -> dict | None:
    """:mod:`bench.snapshots.engine_step` in the vLLM tier's venv, when it exists."""
    if not VENV_PYTHON.exists():
        report.notes.append(f"item 15: vLLM step loop skipped, no {VENV_PYTHON}")
        return None
    from bench.snapshots import engine_step

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        command = [str(VENV_PYTHON), "-m", "bench.snapshots.engine_step", "--json", str(out)]
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(root), "VLLM_TARGET_DEVICE": "cpu"}
        done = subprocess.run([*command, *(["--quick"] if quick else [])], cwd=root, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=1800)  # fmt: skip
        if done.returncode != 0:  # the other figures of the item stand
            tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
            report.notes.append(f"item 15: bench.snapshots.engine_step failed: {tail[0]}")
            return {"failed": done.stderr[-4000:]}
        details = msgspec.json.decode(out.read_bytes())
    report.add(*engine_step.figures(details, SECTION))
    return details
