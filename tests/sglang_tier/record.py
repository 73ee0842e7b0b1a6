"""Golden traces recorded by SGLang 0.5.23's own code, on the CPU (the tier venv only).

Each trace drives SGLang's radix cache (``RadixCache.create_simulated``, its
event recorder on) through a seeded chat workload: scheduler steps of inserts
(prompts, then prompts with their replies), evictions and, in some traces, a
reset. Each step's events become one ``KVEventBatch`` handed to SGLang's
``ZmqEventPublisher``, bound on loopback; the trace is what that publisher's
replay ROUTER answers from seq 0, frame for frame. The expected answers are
SGLang's own: every probe's ``device_prefix_len`` from the tree's
``match_prefix``, every probe's page hashes from SGLang's hash, and the tree's
resident page hashes from its recorder.

    python -m tests.sglang_tier.record OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import sys
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from tests.sglang_tier import cpu_torch  # noqa: F401  (before SGLang's imports)

# isort: split
from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

VERSION = "0.5.23"
TOPIC = "kv"
_SALT_TAG = b"sglang-cache-salt-v1\0"


@dataclass(frozen=True)
class Workload:
    """One trace's engine and chat workload (all drawn from ``seed``)."""

    name: str
    page_size: int
    dp_rank: int = 0
    eagle: bool = False
    salts: tuple[str | None, ...] = (None,)
    steps: int = 40
    evict_every: int = 5
    reset_at: int | None = None
    seed: int = 0


WORKLOADS = (
    Workload("page1", page_size=1, seed=1),
    Workload("page4-salted-dp1", page_size=4, dp_rank=1, salts=(None, "tenant-a"), seed=2),
    Workload("page2-reset", page_size=2, reset_at=24, seed=3),
    Workload("page2-eagle", page_size=2, eagle=True, seed=4),
)


class _Allocator:
    """The cache's KV pool where it frees an evicted node's slots: there are none here."""

    device = "cpu"

    def free_segment(self, *args: object, **kwargs: object) -> None:
        return None


#: The replay ROUTER's port is the PUB's plus this (rank r: both + r, SGLang's rule).
REPLAY_OFFSET = 16


def _free_base(dp_rank: int) -> int:
    """A rank-0 port whose rank ``dp_rank`` ports (PUB and replay) are both free."""
    while True:
        with socket.socket() as pub, socket.socket() as replay:
            pub.bind(("127.0.0.1", 0))
            port = pub.getsockname()[1]
            try:
                replay.bind(("127.0.0.1", port + REPLAY_OFFSET))
            except OSError:
                continue
            return port - dp_rank


def _key(tokens: list[int], salt: str | None) -> RadixKey:
    """A request's key; the cache itself turns it into bigrams when it drafts (EAGLE)."""
    return RadixKey(token_ids=array("q", tokens), cache_salt=salt)


class Chats:
    """Conversations that share system prompts and grow turn by turn."""

    def __init__(self, rng: random.Random, salts: tuple[str | None, ...]) -> None:
        self.rng = rng
        self.systems = [
            [rng.randrange(1, 32000) for _ in range(rng.randrange(6, 30))] for _ in range(3)
        ]
        self.salts = salts
        self.chats: list[tuple[list[int], str | None]] = []

    def turn(self) -> tuple[list[int], str | None]:
        rng = self.rng
        if not self.chats or rng.random() < 0.35:
            system = list(rng.choice(self.systems))
            self.chats.append((system, rng.choice(self.salts)))
        tokens, salt = rng.choice(self.chats)
        tokens.extend(rng.randrange(1, 32000) for _ in range(rng.randrange(3, 25)))
        return list(tokens), salt


def _publish(cache: RadixCache, publisher: ZmqEventPublisher) -> int:
    events = cache.take_events()
    if not events:
        return 0
    publisher.publish(KVEventBatch(ts=time.time(), events=events))
    return 1


def _replayed(replay: str, batches: int) -> list[list[bytes]]:
    """Every batch the publisher buffered, as its replay ROUTER answers from seq 0."""
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(replay)
    try:
        while True:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            answer = []
            while True:
                if not dealer.poll(10_000):
                    raise TimeoutError("SGLang's replay ROUTER did not answer")
                frames = dealer.recv_multipart()
                if frames[1] == b"":
                    break
                answer.append(frames)
            if len(answer) == batches:  # else the publisher thread is still sending
                return answer
            time.sleep(0.05)
    finally:
        dealer.close(linger=0)


def _check_live(live: zmq.Socket, replayed: list[list[bytes]]) -> None:
    """The PUB sent each batch it was connected for as the replay answers it, through
    the last (the subscriber joins late, so the first may be missing)."""
    last = replayed[-1][2]
    got = None
    while got is None or got[1] != last:
        if not live.poll(10_000):
            raise TimeoutError("SGLang's PUB sent no last batch")
        got = live.recv_multipart()
        assert got == replayed[int.from_bytes(got[1], "big")][1:], "live differs from replay"
    live.close(linger=0)


def _page_hashes(tokens: list[int], page_size: int, salt: str | None, eagle: bool) -> list[int]:
    """SGLang's published hashes of a prompt's whole pages, by its own hash function."""
    key = RadixKey(token_ids=array("q", tokens), is_bigram=eagle)
    key = key.page_aligned(page_size)
    if len(key) == 0:
        return []
    prior = None if salt is None else hashlib.sha256(_SALT_TAG + salt.encode()).hexdigest()
    return [hash_str_to_int64(h) for h in get_hash_str(key, prior, page_size=page_size)]


def _resident(cache: RadixCache) -> list[int]:
    """Every page hash the tree holds, as its recorder publishes them."""
    found, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        found += map(hash_str_to_int64, cache.kv_events._node_event_hash_values(node))
    return sorted(found)


def record(work: Workload, out: Path) -> None:
    rng = random.Random(work.seed)
    cache = RadixCache.create_simulated(
        mock_allocator=_Allocator(), page_size=work.page_size, enable_kv_cache_events=True
    )
    cache.is_eagle = work.eagle
    base = _free_base(work.dp_rank)
    endpoint, replay = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + REPLAY_OFFSET}"
    publisher = ZmqEventPublisher(
        attn_dp_rank=work.dp_rank,
        endpoint=endpoint,
        replay_endpoint=replay,
        topic=TOPIC,
        bind=True,
    )
    live = zmq.Context.instance().socket(zmq.SUB)
    live.connect(f"tcp://127.0.0.1:{base + work.dp_rank}")  # rank r's PUB: port + r
    live.subscribe(TOPIC.encode())
    chats = Chats(rng, work.salts)
    batches = _publish(cache, publisher)  # the tree's first reset
    for step in range(work.steps):
        for _ in range(rng.randrange(1, 4)):
            tokens, salt = chats.turn()
            cache.insert(InsertParams(key=_key(tokens, salt)))
        if step % work.evict_every == work.evict_every - 1:
            cache.evict(EvictParams(num_tokens=rng.randrange(20, 120)))
        if step == work.reset_at:
            cache.reset()
        batches += _publish(cache, publisher)
    # rank r's replay ROUTER is at the rank-0 address + r, as SGLang offsets it
    frames = _replayed(f"tcp://127.0.0.1:{base + REPLAY_OFFSET + work.dp_rank}", batches)
    _check_live(live, frames)
    publisher.shutdown()
    probes = _probes(cache, chats, rng, work)
    assert not cache.take_events(), "probing the tree published events"
    trace = [[int.from_bytes(seq, "big"), payload] for _, topic, seq, payload in frames]
    assert all(f[1] == TOPIC.encode() for f in frames)
    (out / f"{work.name}.frames.msgpack").write_bytes(msgspec.msgpack.encode(trace))
    expected = {
        "sglang": VERSION,
        "engine": {
            "page_size": work.page_size,
            "dp_rank": work.dp_rank,
            "eagle": work.eagle,
            "topic": TOPIC,
        },
        "batches": batches,
        "gpu_hashes": _resident(cache),
        "probes": probes,
    }
    (out / f"{work.name}.expected.json").write_text(json.dumps(expected, indent=1) + "\n")


def _probes(cache: RadixCache, chats: Chats, rng: random.Random, work: Workload) -> list[dict]:
    """Each chat and a few variations of it, with SGLang's hit and page hashes."""
    prompts = []
    for tokens, salt in chats.chats:
        prompts.append((tokens, salt))
        cut = rng.randrange(1, len(tokens))
        prompts.append((tokens[:cut] + [rng.randrange(1, 32000) for _ in range(8)], salt))
        other = [s for s in work.salts if s != salt]
        if other:
            prompts.append((tokens, other[0]))
    prompts.append(([rng.randrange(1, 32000) for _ in range(20)], None))
    answers = []
    for tokens, salt in prompts:
        hit = cache.match_prefix(MatchPrefixParams(key=_key(tokens, salt)))
        answers.append(
            {
                "tokens": tokens,
                "cache_salt": salt,
                "hashes": _page_hashes(tokens, work.page_size, salt, work.eagle),
                "device_prefix_len": hit.device_prefix_len,
            }
        )
    return answers


def hash_vectors(out: Path) -> None:
    """SGLang's hashes of seeded prompts beyond the traces': tokens past 32 bits, every
    page size the traces lack, salts and bigrams."""
    rng = random.Random(5)
    vectors = []
    for page_size in (1, 3, 16):
        for salt in (None, "s", "sel-\u00e9"):
            for eagle in (False, True):
                for top in (32000, 1 << 40):
                    tokens = [rng.randrange(0, top) for _ in range(rng.randrange(1, 70))]
                    hashes = _page_hashes(tokens, page_size, salt, eagle)
                    vectors.append(
                        {
                            "tokens": tokens,
                            "page_size": page_size,
                            "cache_salt": salt,
                            "eagle": eagle,
                            "hashes": hashes,
                        }
                    )
    (out / "hash_vectors.json").write_text(json.dumps(vectors) + "\n")


def main_into(out: Path) -> None:
    """Record every trace and the hash vectors into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for work in WORKLOADS:
        record(work, out)
        print(f"recorded {work.name}")
    hash_vectors(out)


if __name__ == "__main__":
    main_into(Path(sys.argv[1]))
