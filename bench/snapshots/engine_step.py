"""The engine's step time with and without kvindex's vLLM plugin, on vLLM 0.33's own
KV cache manager and publisher (bench item 15's engine side, in the vLLM tier's venv).

An "engine step" here is vLLM's scheduler-side KV cache work for one request
and the step's publish: ``get_computed_blocks``, ``allocate_slots``, ``free``
and ``ZmqEventPublisher.publish`` of the events it made (no model runs: a
real step is far longer, so any cost of the plugin shows larger here than in
an engine). Requests share 64 system prompts (8 blocks) and end in 8 blocks
of their own, on a 4,096-block pool that evicts; they are built (and their
blocks hashed, sha256) before the timed steps. Three ways, each an engine of
its own with the same requests, stepping in turn (50 steps of one, then the
next's; forwards, then backwards), timed by the engine thread's CPU clock (and
by wall time):

- ``vllm``: vLLM alone (its publisher made before the plugin is installed, and
  its own ``publish`` called);
- ``plugin, no snapshots``: the plugin installed
  (:func:`producer.vllm_plugin.reports.install`: its report-free mirror
  stream beside vLLM's), snapshots off;
- ``plugin``: the same with snapshots on (the engine core's
  :class:`~producer.vllm_plugin.snapshots.EngineSnapshots` attached and served
  beside the mirror, as the plugin sets it up), nobody asking.

The publishers' own threads run meanwhile, all ways alike. The note gives the
ratio's spread over stretches of the run; on the shared two cores it is a
few percent, so the loop bounds what the plugin costs to that, not finer.
What the snapshot part adds per batch (a few hundred ns) is measured alone
by bench item 15 in the main venv.

Then a real block pool with 1M cached blocks (200k with ``--quick``), filled
by requests of unique tokens: the plugin's engine-thread part of a snapshot
(``EngineSnapshots._take``) against one step of ``vllm`` above, and the
snapshot's off-thread part (keys to published hashes, encode) and encoded
size.

Run (from the checkout, in the tier's venv; about 2 minutes, 40 s with --quick)::

    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu ~/.cache/kvindex/vllm-0.33.0-venv/bin/python \\
        -m bench.snapshots.engine_step [--quick] [--json OUT]

``python -m bench --only 15`` runs it too, when that venv exists. vLLM is
imported only inside functions: :func:`figures` is read by the main venv.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import socket
import statistics
import sys
import time
from types import SimpleNamespace
from typing import Any

from bench.report import Figure

BLOCK = 16
POOL_BLOCKS = 4096
PREFIXES, PREFIX_BLOCKS, OWN_BLOCKS = 64, 8, 8
OFFSET = 1000  # the plugin's port offsets (mirror, and snapshots beside the mirror)
WAYS = ("vllm", "plugin, no snapshots", "plugin")
CHUNK = 50  # steps of one way before the next way's
TOKEN = "bench-step-token"


def _ports() -> int:
    """A port p with p, p + 1, and each + OFFSET and + 2 * OFFSET free."""
    for _ in range(200):
        base = random.randrange(20_000, 40_000)
        wanted = [base + d + k * OFFSET for d in (0, 1) for k in (0, 1, 2)]
        try:
            for port in wanted:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


class Engine:
    """vLLM's KV cache manager (one full-attention group) and its zmq publisher."""

    def __init__(self, blocks: int, max_model_len: int) -> None:
        import torch
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16
        )
        self.config = KVCacheConfig(blocks + 1, [], [KVCacheGroupSpec(["layer.0"], spec)])
        self.manager = KVCacheManager(
            self.config, max_model_len, BLOCK, BLOCK, enable_caching=True,
            enable_kv_cache_events=True,
        )  # fmt: skip
        self.core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=self.manager))
        self.publisher: Any = None
        self.publish: Any = None  # the publisher's publish, or vLLM's own kept aside
        self.steps = 0

    def step(self, request: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        blocks, hit, *_ = self.manager.get_computed_blocks(request)
        self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        self.manager.free(request)
        events = self.manager.take_events()
        if self.publish is not None:
            self.publish(KVEventBatch(float(self.steps), events))
        self.steps += 1

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()


def _hashing() -> Any:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


def _requests(count: int, seed: int, hasher: Any) -> list:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    r = random.Random(seed)
    params = SamplingParams(max_tokens=1)
    prefixes = [
        [r.randrange(1, 30_000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(PREFIXES)
    ]
    made = []
    for i in range(count):
        own = [r.randrange(1, 30_000) for _ in range(OWN_BLOCKS * BLOCK)]
        tokens = [*r.choice(prefixes), *own, 7]  # one token past the last full block
        made.append(Request(f"{seed}-{i}", tokens, params, None, block_hasher=hasher))
    return made


class Plugin:
    """kvindex's plugin installed into vLLM's classes, and taken out again."""

    def __init__(self) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher
        from vllm.v1.core.block_pool import BlockPool

        self._saved = [
            (BlockPool, "emit_cached_block_events", BlockPool.emit_cached_block_events),
            *((ZmqEventPublisher, name, getattr(ZmqEventPublisher, name))
              for name in ("__init__", "publish", "shutdown")),
        ]  # fmt: skip

    def install(self, engine: Engine, snapshots: bool) -> None:
        """Before ``engine``'s publisher is made (the plugin wraps its ``__init__``)."""
        from producer.vllm_plugin import snapshots as service
        from producer.vllm_plugin.reports import install
        from producer.vllm_plugin.settings import PluginSettings

        settings = PluginSettings(
            announce_token=TOKEN, events_port_offset=OFFSET, snapshot_port_offset=OFFSET,
            snapshots=snapshots,
        )  # fmt: skip
        install(settings)
        # what the plugin's wrapper of EngineCore._initialize_kv_caches does (with
        # snapshots on or off), before the scheduler makes the publisher that serves it
        service.attach(engine.core, SimpleNamespace(kv_transfer_config=None), engine.config)

    def remove(self) -> None:
        from producer.vllm_plugin import reports
        from producer.vllm_plugin import snapshots as service

        for owner, name, original in self._saved:
            setattr(owner, name, original)
        reports._SETTINGS = None
        service.claim()  # none left unclaimed


def _publisher(port: int) -> Any:
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(0, f"tcp://*:{port}", f"tcp://*:{port + 1}", topic="kv")


def _engines(plugin: Plugin) -> dict[str, Engine]:
    """One engine each way, their publishers made as the plugin makes them: vLLM's
    own publish kept aside for ``vllm``'s, the plugin's settings with snapshots off
    for the second and on for the third."""
    import functools

    from vllm.distributed.kv_events import ZmqEventPublisher

    from producer.vllm_plugin import reports

    vllm_publish = ZmqEventPublisher.publish
    engines = {way: Engine(POOL_BLOCKS, 4096) for way in WAYS}
    bare = engines["vllm"]
    bare.publisher = _publisher(_ports())
    bare.publish = functools.partial(vllm_publish, bare.publisher)
    for way in WAYS[1:]:
        engine = engines[way]
        plugin.install(engine, snapshots=way == "plugin")
        engine.publisher = _publisher(_ports())
        engine.publish = engine.publisher.publish
        mirror = getattr(engine.publisher, reports._MIRROR, None)
        served = getattr(engine.publisher, reports._SNAPSHOTS, None)
        assert mirror is not None, f"{way}: the plugin made no mirror"
        assert (served is not None) == (way == "plugin"), f"{way}: snapshots {served}"
    return engines


def step_loop(blocks_of_steps: int, steps: int) -> dict:
    """The three ways' engines stepping in turn, ``CHUNK`` steps each (forwards, then
    backwards), so that a slow moment of the shared machine hits them alike:
    seconds per step by the engine thread's CPU clock and by wall time, in total and
    over ``blocks_of_steps`` consecutive stretches (their spread)."""
    hasher = _hashing()
    plugin = Plugin()
    requests = {way: _requests(steps, 1, hasher) for way in WAYS}  # same tokens, each its own
    engines = _engines(plugin)
    clocks = {"cpu": time.thread_time, "wall": time.perf_counter}
    per_stretch = steps // CHUNK // blocks_of_steps
    spent = {c: {w: [0.0] * blocks_of_steps for w in WAYS} for c in clocks}
    try:
        gc.collect()
        for chunk in range(per_stretch * blocks_of_steps):
            stretch, first = chunk // per_stretch, chunk * CHUNK
            for way in WAYS[:: 1 if chunk % 2 == 0 else -1]:
                engine, todo = engines[way], requests[way][first : first + CHUNK]
                cpu, wall = time.thread_time(), time.perf_counter()
                for request in todo:
                    engine.step(request)
                spent["cpu"][way][stretch] += time.thread_time() - cpu
                spent["wall"][way][stretch] += time.perf_counter() - wall
    finally:
        for engine in engines.values():
            engine.publisher.shutdown()
        plugin.remove()
    done = per_stretch * blocks_of_steps * CHUNK

    def ratios(clock: str, way: str, baseline: str) -> list[float]:
        return [a / b for a, b in zip(spent[clock][way], spent[clock][baseline], strict=True)]

    return {
        "steps": done,
        "chunk": CHUNK,
        "stretches": blocks_of_steps,
        "steps_per_cpu_s": {way: done / sum(spent["cpu"][way]) for way in WAYS},
        "steps_per_s": {way: done / sum(spent["wall"][way]) for way in WAYS},
        "seconds": spent,
        # time ratios of each stretch (the inverse of the steps/s ratio)
        "stretch_time_ratios": {
            f"{clock} {way}/{baseline}": ratios(clock, way, baseline)
            for clock in clocks
            for way, baseline in (("plugin", "vllm"), ("plugin", "plugin, no snapshots"))
        },
    }


def snapshot_take(blocks: int, repeats: int) -> dict:
    """A block pool holding ``blocks`` cached blocks: the plugin's ``_take`` (engine
    thread), then ``_assembled`` + encode (server thread), medians."""
    from indexer.core.snapshot import encode_snapshot
    from producer.vllm_plugin.snapshots import EngineSnapshots, _assembled

    hasher = _hashing()
    per_request = 2048
    # room for every request's partial last block too: nothing cached is evicted
    engine = Engine(blocks + blocks // per_request + 2, per_request * BLOCK + BLOCK)
    r = random.Random(99)
    started = time.perf_counter()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1)
    filled = 0
    while filled < blocks:
        n = min(per_request, blocks - filled)
        tokens = [r.randrange(1, 1 << 30) for _ in range(n * BLOCK)]
        engine.step(Request(f"fill-{filled}", [*tokens, 7], params, None, block_hasher=hasher))
        filled += n
    fill_s = time.perf_counter() - started
    cached = len(engine.manager.block_pool.cached_block_hash_to_block._cache)
    assert cached == blocks, (cached, blocks)
    service = EngineSnapshots(engine.core, engine.config, offloading=False)
    takes, assembles = [], []
    for _ in range(repeats):
        gc.collect()
        started = time.perf_counter()
        taken = service._take()
        takes.append(time.perf_counter() - started)
        started = time.perf_counter()
        payload = encode_snapshot(_assembled(taken, service._kinds))
        assembles.append(time.perf_counter() - started)
        del taken
    return {
        "blocks": blocks,
        "fill_s": fill_s,
        "take_s": statistics.median(takes),
        "assemble_encode_s": statistics.median(assembles),
        "snapshot_bytes": len(payload),
    }


def measure(quick: bool) -> dict:
    return {
        "loop": step_loop(5 if quick else 10, 5000 if quick else 12_000),
        "take": snapshot_take(200_000 if quick else 1_000_000, 5 if quick else 7),
    }


def _spread(ratios: list[float]) -> str:
    """Steps/s ratios of the stretches, from their time ratios."""
    inverse = [1 / r for r in ratios]
    return (
        f"over {len(inverse)} stretches: median {statistics.median(inverse):.3f}, "
        f"{min(inverse):.3f}-{max(inverse):.3f}"
    )


def figures(details: dict, section: str) -> list[Figure]:
    """The report's figures of :func:`measure`'s output."""
    loop, take = details["loop"], details["take"]
    cpu, wall = loop["steps_per_cpu_s"], loop["steps_per_s"]
    stretches = loop["stretch_time_ratios"]
    label = f"{take['blocks'] / 1e6:g}M"
    name = "vLLM 0.33 KVCacheManager step loop (get_computed_blocks + allocate + free + publish)"
    how = (
        f"{loop['steps']:,} steps each way, {loop['chunk']} of one way then the next's; "
        "CPU time of the engine thread"
    )

    def note(way: str, baseline: str) -> str:
        return (
            f"{how} ({_spread(stretches[f'cpu {way}/{baseline}'])}); by wall time "
            f"{wall[way]:.0f} vs {wall[baseline]:.0f} steps/s "
            f"({_spread(stretches[f'wall {way}/{baseline}'])})"
        )

    return [
        Figure(section, f"{name}, plugin with snapshots, nobody asking: steps per engine-thread "
               "CPU-second", cpu["plugin"], "steps/s", "same loop, vLLM alone", cpu["vllm"],
               note=note("plugin", "vllm") + "; the plugin's report-free mirror stream "
               "included"),
        Figure(section, f"{name}, plugin with snapshots, nobody asking (vs plugin without): "
               "steps per engine-thread CPU-second", cpu["plugin"], "steps/s",
               "same loop, plugin with snapshots off", cpu["plugin, no snapshots"],
               note=note("plugin", "plugin, no snapshots")),
        Figure(section, f"vLLM 0.33 block pool with {label} cached blocks: the plugin's _take "
               "(engine-thread pause of one snapshot)", 1000 * take["take_s"], "ms",
               "one step of the loop above, vLLM alone (wall)", 1000 / wall["vllm"],
               note=f"then off the engine thread: keys to hashes + encode "
               f"{1000 * take['assemble_encode_s']:.0f} ms, {take['snapshot_bytes'] / 1e6:.1f} MB "
               f"({take['snapshot_bytes'] / take['blocks']:.2f} B/block); the pool filled in "
               f"{take['fill_s']:.0f} s"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshots.engine_step")
    parser.add_argument("--quick", action="store_true", help="fewer steps, a 200k-block pool")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    import logging

    logging.disable(logging.WARNING)  # vLLM's and the plugin's info lines
    details = measure(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(details, f, indent=1)
    for f in figures(details, "15"):
        ratio = f"{f.ratio:.3f}" if f.ratio is not None else ""
        print(f"{f.name}: {f.value:.4g} {f.unit}; {f.baseline}: {f.baseline_value:.4g}; "
              f"ratio {ratio}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
