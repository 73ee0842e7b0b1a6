"""``kvindex sim``: simulated engines publishing KV events on local ports.

Each engine rank runs a :class:`~producer.sim.SimEngine` fed by its own
stream of one shared :class:`~producer.workload.Workload` config (so the
engines share popular system prompts), and publishes through a
:class:`~producer.publisher.Publisher` exactly where vLLM would: engine
``k`` binds its PUB socket on ``base_port + 2 * dp_ranks * k`` and its replay
socket ``dp_ranks`` ports above, data-parallel rank ``r`` on those ports
``+ r``. ``--print-specs`` prints the matching ``POST /engines`` bodies.
With ``--no-events`` the engines run the same but publish nothing (no ports):
engines kvindex knows only by what routers tell it (``events: false``).
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, replace

import zmq

from indexer.core.events import MEDIA
from producer.publisher import Publisher
from producer.sim import SimConfig, SimEngine
from producer.workload import Request, Workload, WorkloadConfig


@dataclass(frozen=True, slots=True)
class Layout:
    """Names and local endpoints of the simulated engines."""

    engines: int
    base_port: int
    dp_ranks: int = 1
    host: str = "127.0.0.1"
    prefix: str = "sim"

    def name(self, engine: int) -> str:
        return f"{self.prefix}-{engine}"

    def rank_name(self, engine: int, dp_rank: int) -> str:
        return self.name(engine) if self.dp_ranks == 1 else f"{self.name(engine)}/dp{dp_rank}"

    def endpoint(self, engine: int) -> str:
        return f"tcp://{self.host}:{self.base_port + 2 * self.dp_ranks * engine}"

    def replay_endpoint(self, engine: int) -> str:
        return f"tcp://{self.host}:{self.base_port + 2 * self.dp_ranks * engine + self.dp_ranks}"


def engine_spec(
    layout: Layout, engine: int, config: SimConfig, model: str, events: bool = True
) -> dict:
    """The ``POST /engines`` body (an :class:`indexer.engine_registry.EngineSpec`) for one engine.

    The engine's seed is declared only when it is one kvindex could know: a
    secret xxhash seed stays secret, and kvindex matches by tokens instead.
    An engine without ``events`` has no endpoints and declares its GPU capacity.
    A simulated engine sends no reuse reports, so each GPU store it publishes
    is a copy: ``reuse_reports: counted``.
    """
    where = (
        {
            "endpoint": layout.endpoint(engine),
            "replay_endpoint": layout.replay_endpoint(engine),
            "reuse_reports": "counted",  # a simulated engine publishes none: copies are exact
        }
        if events
        else {"events": False, "gpu_blocks": config.gpu_blocks}
    )
    return {
        "name": layout.name(engine),
        **where,
        "model": model,
        "dp_ranks": layout.dp_ranks,
        "block_size": config.block_size,
        "adapter": config.adapter,
        "hash_algo": config.hash_algo,
        "hash_seed": config.hash_seed,
        "blocks_per_chunk": config.blocks_per_chunk,
    }


class _Rank:
    """One engine rank: its engine, its requests in arrival order, its publisher."""

    def __init__(
        self,
        name: str,
        engine: SimEngine,
        workload: Iterator[Request],
        publisher: Publisher | None,
    ) -> None:
        self.name = name
        self.engine = engine
        self.publisher = publisher
        self._requests = workload
        self._next = next(workload)

    def advance(self, elapsed: float) -> None:
        """Submit the requests that have arrived, run one step, publish its batch."""
        while self._next.arrival <= elapsed:
            self.engine.submit(self._next.prompt, self._next.output)
            self._next = next(self._requests)
        batch = self.engine.step()
        if batch is not None and self.publisher is not None:
            self.publisher.publish(batch)


def sglang_config(config: SimConfig) -> SimConfig:
    """``config`` for an SGLang engine: unseeded SHA-256 page hashes, GPU only."""
    return replace(
        config, adapter="sglang", cpu_chunks=0, storage_chunks=0, hash_algo="sha256", hash_seed=None
    )


def _start(
    layout: Layout, configs: list[SimConfig], workload: WorkloadConfig, events: bool = True
) -> list[_Rank]:
    """Every rank bound (unless without ``events``) and ready; if one cannot bind, none
    stays open."""
    ranks: list[_Rank] = []
    try:
        for engine, config in enumerate(configs):
            for dp_rank in range(layout.dp_ranks):
                publisher = None
                if events:
                    publisher = Publisher(
                        layout.endpoint(engine),
                        layout.replay_endpoint(engine),
                        data_parallel_rank=dp_rank,
                        bind=True,
                        adapter=config.engine_adapter(),
                    )
                stream = Workload(workload, stream=len(ranks))
                engine_rank = SimEngine(config, dp_rank)
                name = layout.rank_name(engine, dp_rank)
                ranks.append(_Rank(name, engine_rank, stream, publisher))
    except BaseException:
        _close(ranks)
        raise
    return ranks


def _configs(layout: Layout, config: SimConfig, sglang: int) -> list[SimConfig]:
    """Each engine's config: ``config``, the last ``sglang`` of them SGLang's."""
    vllm = layout.engines - min(sglang, layout.engines)
    return [config if e < vllm else sglang_config(config) for e in range(layout.engines)]


def _close(ranks: list[_Rank]) -> None:
    for r in ranks:
        if r.publisher is not None:
            r.publisher.close()


def _write_samples(path: str, ranks: list[_Rank]) -> None:
    """Atomically write ``{rank name: [tokens, ...]}``: prompts each rank has served."""
    samples = {r.name: [list(t) for t in r.engine.recently_served] for r in ranks}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(samples, f)
    os.replace(tmp, path)


def run(
    layout: Layout,
    config: SimConfig,
    workload: WorkloadConfig,
    *,
    tick: float = 0.05,
    samples: str | None = None,
    events: bool = True,
    announce: Callable[[list[dict]], ExitStack] | None = None,
    model: str = "sim",
    sglang: int = 0,
) -> None:
    """Run every rank one step per ``tick`` seconds until interrupted; ``announce``
    registers the engines' specs once they publish, until the run ends. The last
    ``sglang`` engines are SGLang's (:func:`sglang_config`)."""
    configs = _configs(layout, config, sglang)
    ranks = _start(layout, configs, workload, events)
    specs = [engine_spec(layout, e, c, model, events) for e, c in enumerate(configs)]
    announced = announce(specs) if announce is not None else ExitStack()
    try:  # from here on, an interrupt (Ctrl-C, SIGTERM) stops cleanly
        for r in ranks:
            p = r.publisher
            endpoints = f"PUB {p.endpoint}  replay {p.replay_endpoint}" if p else "no events"
            print(f"{r.name}: {endpoints}")
        sys.stdout.flush()  # whoever started us may be waiting for these lines
        started = last_report = time.monotonic()
        while True:
            now = time.monotonic()
            for r in ranks:
                r.advance(now - started)
            if now - last_report >= 1.0:
                last_report = now
                if samples:
                    _write_samples(samples, ranks)
                _progress(ranks)
            time.sleep(max(0.0, tick - (time.monotonic() - now)))
    except KeyboardInterrupt:
        pass
    finally:
        announced.close()  # deregistered before the ports close
        _close(ranks)
        sys.stderr.write("\n")


def _progress(ranks: list[_Rank]) -> None:
    done = sum(r.engine.requests_done for r in ranks)
    batches = sum(r.publisher.next_seq for r in ranks if r.publisher is not None)
    looked_up = max(1, sum(r.engine.prompt_blocks for r in ranks))
    hits = Counter()
    for r in ranks:
        hits.update(r.engine.hit_blocks)
    rates = "  ".join(f"{m} {100 * hits[m] / looked_up:.0f}%" for m in MEDIA if m in hits)
    sys.stderr.write(
        f"\r{len(ranks)} ranks  requests {done}  batches {batches}  prompt cache hits: {rates}   "
    )
    sys.stderr.flush()


class AnnounceFailed(Exception):
    """kvindex refused or could not be reached for ``--announce``."""


def _announcer(args: argparse.Namespace) -> Callable[[list[dict]], ExitStack]:
    """Announce specs to ``--announce`` as the plugin does from inside vLLM."""
    import httpx

    from producer.announce import Announcer, AnnounceRefused  # httpx: only for --announce

    def announce(specs: list[dict]) -> ExitStack:
        stack = ExitStack()
        try:
            for spec in specs:
                announcer = Announcer(args.announce, spec, args.announce_token, args.lease)
                outcome = stack.enter_context(announcer).outcome
                print(f"{spec['name']}: {outcome} at {args.announce} ({announcer.instance})")
        except (AnnounceRefused, httpx.HTTPError) as e:
            stack.close()
            raise AnnounceFailed(str(e) or repr(e)) from e
        except BaseException:
            stack.close()
            raise
        return stack

    return announce


def main(args: argparse.Namespace) -> int:
    if math.ceil(args.max_context / args.block_size) > args.gpu_blocks:
        sys.exit(f"kvindex sim: --max-context {args.max_context} does not fit --gpu-blocks")
    layout = Layout(args.engines, args.base_port, args.dp_ranks, args.host, args.prefix)
    config = SimConfig(
        block_size=args.block_size,
        gpu_blocks=args.gpu_blocks,
        blocks_per_chunk=args.blocks_per_chunk,
        cpu_chunks=args.cpu_chunks,
        storage_chunks=args.storage_chunks,
        self_describing=not args.placeholders,
        offload_events=args.offload_events,
        hash_algo=args.hash_algo,
        hash_seed=args.hash_seed,
    )
    if args.print_specs:
        for engine, each in enumerate(_configs(layout, config, args.sglang)):
            print(json.dumps(engine_spec(layout, engine, each, args.model, not args.no_events)))
        return 0
    workload = WorkloadConfig(
        seed=args.seed,
        rate=args.rate,
        zipf_s=args.zipf,
        system_prompts=args.system_prompts,
        max_context_tokens=args.max_context,
    )
    # Ctrl-C and SIGTERM both stop cleanly, also in a script's background
    # (where the shell starts it with SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run(
            layout,
            config,
            workload,
            tick=args.tick,
            samples=args.samples,
            events=not args.no_events,
            announce=_announcer(args) if args.announce else None,
            model=args.model,
            sglang=args.sglang,
        )
    except AnnounceFailed as e:
        sys.exit(f"kvindex sim: --announce {args.announce}: {e}")
    except zmq.ZMQError as e:  # binding a port: pyzmq's message names the address
        in_use = e.errno == errno.EADDRINUSE
        sys.exit(f"kvindex sim: {e}" + (": choose another --base-port" if in_use else ""))
    return 0
