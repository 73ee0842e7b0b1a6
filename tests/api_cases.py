"""What the HTTP API's tests feed it: batches of GPU blocks and CPU chunks, an
engine's registration body, an answer read as vLLM's tier tokens, and a trace's
probes checked against vLLM's answers, written once so every API test module builds
its cases the same way."""

from __future__ import annotations

from indexer.core.events import BlockStored, EventBatch, RankId
from indexer.ingest.trace import load_trace
from indexer.kv_groups import KVGroup
from indexer.stores import Store

from .apikit import Api, csv, engine
from .conftest import load_expected_json, trace_path


def batch(*events) -> EventBatch:
    return EventBatch(1.0, list(events), 0)


def gpu(hashes, parent=None) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, medium="GPU")


def cpu_chunk(hashes) -> BlockStored:
    """A self-describing CPU chunk (token ids elided: the store only needs the hashes)."""
    return BlockStored(
        block_hashes=list(hashes), token_ids=[0] * 16 * len(hashes), block_size=16, medium="CPU"
    )


def _tier_tokens(answer: dict) -> dict[str, int]:
    (entry,) = answer["engines"]
    size = answer["block_size"]
    return {
        "gpu_tokens": entry["gpu_blocks"] * size,
        "cpu_prefix_tokens": entry["cpu_blocks"] * size,
    }


ENGINE_BODY = {
    "name": "vllm-a",
    "model": "m",
    "endpoint": "tcp://10.0.0.1:5557",
    "replay_endpoint": "tcp://10.0.0.1:5558",
    "dp_ranks": 2,
    "topic": "",
    "block_size": 16,
    "hash_algo": "sha256",
    "hash_seed": None,
    "blocks_per_chunk": None,
}


async def trace_api(name: str, store: Store | None = None) -> tuple[Api, dict]:
    """An API over one engine that published fixture trace ``name`` (engine ``vllm-a``,
    declared as the trace's engine was), and the trace's expected answers; ``store``:
    the store it runs on (the embedded one by default)."""
    expected = load_expected_json(name)
    cfg = expected["engine"]
    api = Api(store=store)
    await api.add(
        engine(
            "vllm-a",
            model="m",
            block_size=cfg["block_size"],
            blocks_per_chunk=cfg["blocks_per_chunk"],
            lookahead_tokens=cfg.get("lookahead_tokens", 0),
            kv_groups=[
                KVGroup(g["kind"], g["sliding_window"], g["block_size"])
                for g in cfg.get("groups", ())
            ]
            or None,
            release=cfg.get("release"),
        )
    )
    await api.consumers.apply_trace(RankId("vllm-a", 0), load_trace(trace_path(name)))
    return api, expected


#: vLLM's answers a trace's probe holds (``storage_prefix_tokens``: with a storage tier)
PROBE_ANSWERS = ("gpu_tokens", "cpu_prefix_tokens", "storage_prefix_tokens", "prefix_tokens")


async def check_trace_probes(name: str, store: Store | None = None) -> None:
    """kvindex answers every probe of trace ``name`` as vLLM did, by tokens and by
    hashes: its GPU hit and its own lookup (the connector's) of the CPU tier (and the
    storage tier, where there is one), from token 0 and after the GPU hit."""
    api, expected = await trace_api(name, store)
    try:
        await check_probes(api, expected["probes"])
    finally:
        await api.close()


async def check_probes(api: Api, probes: list[dict]) -> None:
    """The API over one engine answers every probe as vLLM did (see above)."""
    for probe in probes:
        want = {k: probe[k] for k in PROBE_ANSWERS if k in probe}
        by_tokens, by_hashes = csv(probe["tokens"]), csv(probe["hashes"])
        for params in ({"tokens": by_tokens}, {"block_hashes": by_hashes}):
            answer = (await api.client.get("/prefix-match", params=params)).json()
            (entry,) = answer["engines"]
            got = _tier_tokens(answer) | {
                "storage_prefix_tokens": entry["storage_blocks"] * answer["block_size"],
                "prefix_tokens": entry["prefix_tokens"],
            }
            assert {k: got[k] for k in want} == want, (params.keys(), probe)
