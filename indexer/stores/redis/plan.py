"""A batch's operations resolved against a rank's metadata: ids, and what each bucket runs.

Pure: no Redis here. The store reads the rank's metadata, plans with it, and
sends what the plan says (:mod:`indexer.stores.redis.store`).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from indexer.core.events import BlockHash
from indexer.core.residency import ClearMedium, Op, RankResidency, TierTable
from indexer.stores.redis.layout import BUCKETS, LOW, RankMeta, TierId, block_name, bucket_of
from indexer.stores.redis.scripts import HOLD_MARKER

#: Most block operations per script call on a standalone server (whole buckets
#: only), so that one huge batch does not block Redis for long.
OPS_PER_CALL = 4096
#: Most block operations sent in one round trip: a batch larger than this (an
#: engine's snapshot of a million blocks) goes in several, each within the
#: socket timeout even while Redis works through the previous one.
OPS_PER_TRIP = 1 << 17


@dataclass
class Plan:
    """One batch resolved against a rank's metadata: what to write, what it leads to.

    ``writes``: ``(tid, gid, delta, hashes)`` in event order. ``missing``: ids
    the batch needs that are not reserved yet. ``members``: every tid of each
    generation, for counting distinct hashes across a medium's tiers.
    """

    meta: RankMeta
    writes: list[tuple[int, int, int, Sequence[BlockHash]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    members: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    block_ops: int = 0


def plan_writes(meta: RankMeta, ops: Iterable[Op], seq: int, ts: float) -> Plan:
    """Resolve a batch's operations to ids and compute the rank's metadata after it.

    What a batch teaches (group kinds, chunk size, tier locality) comes from
    replaying its operations, without hashes, on the model's own
    :class:`RankResidency`. Ids are named by purpose so that a re-delivered
    batch finds the ids its first attempt reserved: a new generation by its
    medium and the medium's clears so far in the batch, a new tier by its
    generation's id or, if that is new too, the generation's purpose.
    """
    reserved = meta.reserved(seq)
    plan = Plan(meta)
    generation = {medium: str(gid) for medium, gid in meta.gens.items()}

    def take(*purpose: object) -> tuple[int, str]:
        name = msgspec.json.encode(purpose).decode()
        if name not in reserved:
            plan.missing.append(name)
            return -len(plan.missing), name
        return reserved[name], name

    gens = dict(meta.gens)
    tids = {t.tier: t.tid for t in meta.tiers}
    for tier, tid in tids.items():
        plan.members[gens[tier.medium]].append(tid)
    scratch = RankResidency(
        tables={t.tier: TierTable(locality=t.locality) for t in meta.tiers},
        group_kinds=dict(meta.kinds),
        chunk_blocks=meta.chunk,
    )
    clears: Counter[str] = Counter()
    taught: list[Op] = []  # the operations without their hashes, replayed once at the end
    for op in ops:
        if type(op) is ClearMedium:
            taught.append(op)
            clears[op.medium] += 1
            gens.pop(op.medium, None)
            tids = {t: i for t, i in tids.items() if t.medium != op.medium}
            continue
        tier, delta, hashes = op.tier, op.delta, op.hashes
        taught.append(op._replace(hashes=()))
        medium = tier.medium
        if medium not in gens:
            gens[medium], generation[medium] = take("gen", medium, clears[medium])
        tid = tids.get(tier)
        if tid is None:
            tid = tids[tier] = take("tier", *tier, generation[medium])[0]
            plan.members[gens[medium]].append(tid)
        plan.writes.append((tid, gens[medium], delta, hashes))
        plan.block_ops += len(hashes)
    scratch.apply(taught)
    plan.meta = RankMeta(
        meta.rid,
        meta.epoch,
        seq,
        ts,
        gens,
        [TierId(*t, tids[t], table.locality) for t, table in scratch.tables.items()],
        scratch.group_kinds,
        scratch.chunk_blocks,
    )
    return plan


@dataclass
class BucketWrites:
    """A plan as the apply script takes it: its tiers, and one section per bucket.

    ``tiers``: ``[tid, gid, sibling tids...]`` each (siblings: the other tiers
    of the generation, for counting distinct hashes). ``sections``: per
    bucket, one flat list in event order: a marker (+t or -t: tier t, delta +1
    or -1; t + :data:`HOLD_MARKER`: a hold) whenever the operation changes for
    that bucket, then hash names.
    ``sizes``: block operations per bucket that has any.
    """

    tiers: list[list]
    sections: list[list]
    sizes: dict[int, int]


def bucket_writes(plan: Plan) -> BucketWrites:
    tiers: list[list] = []
    tier_index: dict[int, int] = {}
    sections: list[list] = [[] for _ in range(BUCKETS)]
    appends = [section.append for section in sections]
    last = [0] * BUCKETS
    markers = [0] * BUCKETS
    for tid, gid, delta, hashes in plan.writes:
        t = tier_index.get(tid)
        if t is None:
            siblings = [str(m) for m in plan.members[gid] if m != tid]
            tiers.append([str(tid), gid, *siblings])
            t = tier_index[tid] = len(tiers)
        marker = t if delta > 0 else -t if delta < 0 else t + HOLD_MARKER
        try:  # block hashes are ints, except in rare deployments: one pass in C first
            buckets = [h & LOW for h in hashes]
        except TypeError:
            buckets = list(map(bucket_of, hashes))
            names = map(block_name, hashes)
        else:
            names = map(str, hashes)
        for b, n in zip(buckets, names, strict=True):
            if last[b] != marker:
                last[b] = marker
                markers[b] += 1
                appends[b](marker)
            appends[b](n)
    sizes = {b: len(sec) - markers[b] for b, sec in enumerate(sections) if sec}
    return BucketWrites(tiers, sections, sizes)


def script_calls(sizes: dict[int, int], cluster: bool) -> list[list[int]]:
    """Buckets per script call: one per call on a cluster (one slot each), else whole
    buckets up to :data:`OPS_PER_CALL` operations a call.

    ``sizes``: block operations per bucket that has any.
    """
    if cluster:
        return [[b] for b in sizes]
    calls: list[list[int]] = [[]]
    size = 0
    for b, ops in sizes.items():
        if calls[-1] and size + ops > OPS_PER_CALL:
            calls.append([])
            size = 0
        calls[-1].append(b)
        size += ops
    return calls


def round_trips(call_sizes: list[int]) -> list[range]:
    """The script calls of each round trip (by index, in order): whole calls, up to
    :data:`OPS_PER_TRIP` operations a trip. Splitting a batch's calls is safe: each
    bucket's call is marked with the batch and skipped if run again, and the
    watermark moves only once every bucket is done."""
    trips, start, size = [], 0, 0
    for i, ops in enumerate(call_sizes):
        if i > start and size + ops > OPS_PER_TRIP:
            trips.append(range(start, i))
            start, size = i, 0
        size += ops
    trips.append(range(start, len(call_sizes)))
    return trips
