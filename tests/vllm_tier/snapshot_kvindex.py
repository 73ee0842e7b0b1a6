"""``kvindex serve`` as the snapshot tier asks it, and the check that it answers
exactly what vLLM holds, rank by rank and tier by tier: one definition of
"exact" for every scenario of the tier."""

from __future__ import annotations

import subprocess
import time

import httpx
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from producer.vllm_plugin.settings import PluginSettings
from producer.vllm_plugin.spec import announcement
from tests.servers import REDIS_CLI, RedisServer
from tests.vllm_tier.conftest import TOKEN, Serve
from tests.vllm_tier.snapshot_engine import NAME, OFFSET, RANKS
from tests.vllm_tier.snapshot_rank import Fleet


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
