"""``kvindex sim`` and its flags: the simulated fleet's layout, engines and workload.

Defaults are the simulator's own (:class:`producer.sim.SimConfig`,
:class:`producer.workload.WorkloadConfig`), so the help shows what a run
without flags does. Reading them loads the simulator, so the command line
imports this module only for ``sim`` (and the command list in ``--help``).
"""

from __future__ import annotations

import argparse

import click

from indexer.engines import catalog
from kvindex.cli import SETTINGS, _log_level, _parsed
from kvindex.options import Port, apply, option
from producer.sim import SimConfig
from producer.tracker import OFFLOAD_EVENTS
from producer.workload import WorkloadConfig

_ENGINE, _LOAD = SimConfig(), WorkloadConfig()

sim_flags = apply(
    option("--engines", type=int, default=4, show_default=True, help="engines to run"),
    option(
        "--sglang",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="of --engines, the last N publish SGLang's KV events and page hashes (GPU only)",
    ),
    option("--base-port", type=Port(), default=5557, show_default=True, help="first PUB port"),
    option(
        "--dp-ranks",
        type=int,
        default=1,
        show_default=True,
        help="data-parallel ranks per engine (each its own PUB and replay port)",
    ),
    option("--host", default="127.0.0.1", show_default=True, help="address to bind"),
    option(
        "--prefix",
        default="sim",
        show_default=True,
        help="engine names: PREFIX-0, PREFIX-1, ... (a second fleet beside the first)",
    ),
    option("--model", default="sim", show_default=True, help="model name in --print-specs"),
    option("--print-specs", is_flag=True, help="print each engine's POST /engines body, exit"),
    option(
        "--announce",
        metavar="URL",
        help="register each engine with the kvindex at URL (POST /engines/announce), renew"
        " its lease, deregister on exit",
    ),
    option("--announce-token", metavar="TOKEN", help="kvindex's bearer token for --announce"),
    option(
        "--lease",
        type=float,
        default=30.0,
        show_default=True,
        help="seconds of the lease --announce asks for",
    ),
    option("--samples", metavar="FILE", help="keep each rank's recently served prompts in FILE"),
    option("--tick", type=float, default=0.05, show_default=True, help="seconds per engine step"),
    option("--rate", type=float, default=_LOAD.rate, show_default=True, help="requests/s per rank"),
    option(
        "--seed",
        type=int,
        default=_LOAD.seed,
        show_default=True,
        help="workload seed: fixes the system prompts, shared by every engine",
    ),
    option(
        "--zipf",
        type=float,
        default=_LOAD.zipf_s,
        show_default=True,
        help="system prompt skew: prompt i has weight 1/(i+1)^zipf (0: uniform)",
    ),
    option(
        "--system-prompts",
        type=int,
        default=_LOAD.system_prompts,
        show_default=True,
        help="distinct system prompts the conversations start from",
    ),
    option(
        "--max-context",
        type=int,
        default=_LOAD.max_context_tokens,
        show_default=True,
        help="tokens a conversation may reach before it ends (must fit --gpu-blocks)",
    ),
    option(
        "--block-size",
        type=int,
        default=_ENGINE.block_size,
        show_default=True,
        help="tokens per KV block",
    ),
    option(
        "--gpu-blocks",
        type=int,
        default=_ENGINE.gpu_blocks,
        show_default=True,
        help="GPU KV cache size, in blocks",
    ),
    option(
        "--blocks-per-chunk",
        type=int,
        default=_ENGINE.blocks_per_chunk,
        show_default=True,
        help="blocks per CPU offload chunk (offload moves whole chunks)",
    ),
    option(
        "--cpu-chunks",
        type=int,
        default=_ENGINE.cpu_chunks,
        show_default=True,
        help="CPU offload tier size, in chunks (0: no offload)",
    ),
    option(
        "--storage-chunks",
        type=int,
        default=0,
        show_default=True,
        help="owned STORAGE tier size, in chunks (0: none)",
    ),
    option(
        "--placeholders",
        is_flag=True,
        help="publish CPU chunks as placeholders (vLLM without self-describing events)",
    ),
    option(
        "--offload-events",
        type=click.Choice(OFFLOAD_EVENTS),
        default=_ENGINE.offload_events,
        show_default=True,
        help="the vLLM release whose offload event shapes the engines publish",
    ),
    option(
        "--hash-algo",
        type=click.Choice(catalog.hash_algos()),
        default=_ENGINE.hash_algo,
        show_default=True,
        help="vLLM's prefix-caching hash",
    ),
    option("--hash-seed", help="the engines' PYTHONHASHSEED (unset: xxhash gets a secret seed)"),
    option(
        "--no-events",
        is_flag=True,
        help="publish no KV events and bind no ports: event-less engines, which kvindex"
        " routes by routed entries alone (--print-specs: events false, gpu_blocks)",
    ),
)


def _sim(args: argparse.Namespace) -> int:
    from producer import simcli

    return simcli.main(args)


@click.command(context_settings=SETTINGS, short_help="simulated engines publishing vLLM KV events")
@sim_flags
@_log_level()
def sim(**_: object) -> argparse.Namespace:
    """Run simulated engines publishing vLLM KV events on local ports, until
    Ctrl-C or SIGTERM.

    Engine k binds its PUB socket on --base-port + 2 * dp_ranks * k and its
    replay socket dp_ranks ports above; --print-specs prints the matching
    POST /engines bodies.

    \b
    Example:
      kvindex sim --engines 2 --base-port 5557 &
      kvindex sim --engines 2 --print-specs | while read -r spec; do
        curl -s -X POST localhost:8000/engines -H 'content-type: application/json' -d "$spec"
      done
    """
    return _parsed(_sim)
