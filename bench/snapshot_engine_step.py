"""The engine's step time with and without kvindex's vLLM plugin, on vLLM 0.33's own
KV cache manager and publisher (bench item 15's engine side, in the vLLM tier's venv).

An "engine step" here is vLLM's scheduler-side KV cache work for one request
and the step's publish: ``get_computed_blocks``, ``allocate_slots``, ``free``
and ``ZmqEventPublisher.publish`` of the events it made (no model runs: a
real step is far longer, so any cost of the plugin shows larger here than in
an engine). Requests share 64 system prompts (8 blocks) and end in 8 blocks
of their own, on a 4,096-block pool that evicts; they are built (and their
blocks hashed, sha256) before the timed steps. Three ways, interleaved in
rounds of fresh managers and publishers, steps/s each:

- ``vllm``: vLLM alone;
- ``plugin, no snapshots``: the plugin installed
  (:func:`producer.vllm_plugin.reports.install`: its report-free mirror
  stream beside vLLM's), snapshots off;
- ``plugin``: the same with snapshots on (the engine core's
  :class:`~producer.vllm_plugin.snapshots.EngineSnapshots` served beside the
  mirror, as the plugin sets it up), nobody asking.

Then a real block pool with 1M cached blocks (200k with ``--quick``), filled
by requests of unique tokens: the plugin's engine-thread part of a snapshot
(``EngineSnapshots._take``) against the median step of the ``vllm`` rounds,
and the snapshot's off-thread part (keys to published hashes, encode) and
encoded size.

Run (from the checkout, in the tier's venv; about 2 minutes, 1 with --quick)::

    PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu ~/.cache/kvindex/vllm-0.33.0-venv/bin/python \\
        -m bench.snapshot_engine_step [--quick] [--json OUT]

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

    def __init__(self, blocks: int, max_model_len: int, port: int | None = None) -> None:
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
        self.publisher = None
        if port is not None:
            from vllm.distributed.kv_events import ZmqEventPublisher

            self.publisher = ZmqEventPublisher(
                0, f"tcp://*:{port}", f"tcp://*:{port + 1}", topic="kv"
            )
        self.steps = 0

    def step(self, request: Any) -> None:
        from vllm.distributed.kv_events import KVEventBatch

        blocks, hit, *_ = self.manager.get_computed_blocks(request)
        self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks)
        self.manager.free(request)
        events = self.manager.take_events()
        if self.publisher is not None:
            self.publisher.publish(KVEventBatch(float(self.steps), events))
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
        if snapshots:  # what the plugin's wrapper of _initialize_kv_caches sets up
            service._SERVICE = service.EngineSnapshots(engine.core, engine.config, False)
        install(settings)

    def remove(self) -> None:
        from producer.vllm_plugin import snapshots as service

        for owner, name, original in self._saved:
            setattr(owner, name, original)
        service._SERVICE = None


def _round(way: str, plugin: Plugin, requests: list) -> float:
    """Steps/s of one fresh engine serving ``requests``."""
    port = _ports()
    engine = Engine(POOL_BLOCKS, 4096)
    if way != "vllm":
        plugin.install(engine, snapshots=way == "plugin")
    try:
        engine.publisher = _publisher(port)
        if way != "vllm":
            assert hasattr(engine.publisher, "_kvindex_mirror"), "the plugin made no mirror"
        if way == "plugin":
            from producer.vllm_plugin import snapshots

            assert snapshots.service()._server is not None, "snapshots are not served"
        gc.collect()
        started = time.perf_counter()
        for request in requests:
            engine.step(request)
        return len(requests) / (time.perf_counter() - started)
    finally:
        engine.close()
        plugin.remove()


def _publisher(port: int) -> Any:
    from vllm.distributed.kv_events import ZmqEventPublisher

    return ZmqEventPublisher(0, f"tcp://*:{port}", f"tcp://*:{port + 1}", topic="kv")


def step_loop(rounds: int, steps: int) -> dict:
    hasher = _hashing()
    plugin = Plugin()
    rates: dict[str, list[float]] = {way: [] for way in WAYS}
    for i in range(rounds):
        for way in WAYS:  # the same requests each way of a round (built fresh: single use)
            rates[way].append(_round(way, plugin, _requests(steps, i, hasher)))

    def ratios(way: str, baseline: str) -> list[float]:
        return [a / b for a, b in zip(rates[way], rates[baseline], strict=True)]

    return {
        "steps": steps,
        "rounds": rounds,
        "steps_per_s": {way: statistics.median(r) for way, r in rates.items()},
        "all_steps_per_s": rates,
        # each round's own ratio: its ways ran back to back, so a slow moment of the
        # shared machine hits them alike
        "round_ratios": {
            "plugin/vllm": ratios("plugin", "vllm"),
            "plugin/no snapshots": ratios("plugin", "plugin, no snapshots"),
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
    steps = 1500 if quick else 3000
    return {
        "loop": step_loop(5 if quick else 9, steps),
        "take": snapshot_take(200_000 if quick else 1_000_000, 5 if quick else 7),
    }


def _spread(ratios: list[float]) -> str:
    return (
        f"each round's own ratio: median {statistics.median(ratios):.3f}, "
        f"{min(ratios):.3f}-{max(ratios):.3f}"
    )


def figures(details: dict, section: str) -> list[Figure]:
    """The report's figures of :func:`measure`'s output."""
    rates, take = details["loop"]["steps_per_s"], details["take"]
    by_round = details["loop"]["round_ratios"]
    step_ms = 1000 / rates["vllm"]
    label = f"{take['blocks'] / 1e6:g}M"
    loop = "vLLM 0.33 KVCacheManager step loop (get_computed_blocks + allocate + free + publish)"
    return [
        Figure(section, f"{loop}, plugin with snapshots, nobody asking: steps/s", rates["plugin"],
               "steps/s", "same loop, vLLM alone", rates["vllm"],
               note=f"median of {details['loop']['rounds']} interleaved rounds of "
               f"{details['loop']['steps']:,} steps ({_spread(by_round['plugin/vllm'])}); "
               "the plugin's report-free mirror stream included"),
        Figure(section, f"{loop}, plugin with snapshots, nobody asking (vs plugin without): "
               "steps/s", rates["plugin"], "steps/s", "same loop, plugin with snapshots off",
               rates["plugin, no snapshots"], note=_spread(by_round["plugin/no snapshots"])),
        Figure(section, f"vLLM 0.33 block pool with {label} cached blocks: the plugin's _take "
               "(engine-thread pause of one snapshot)", 1000 * take["take_s"], "ms",
               "one step of the loop above, vLLM alone (median)", step_ms,
               note=f"then off the engine thread: keys to hashes + encode "
               f"{1000 * take['assemble_encode_s']:.0f} ms, {take['snapshot_bytes'] / 1e6:.1f} MB "
               f"({take['snapshot_bytes'] / take['blocks']:.2f} B/block)"),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.snapshot_engine_step")
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
