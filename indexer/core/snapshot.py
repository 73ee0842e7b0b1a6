"""An engine rank's whole residency as of one seq: what a snapshot says, and the
operations that make a rank's counts exactly that.

A rank that missed batches replay can no longer bring (it started after the
engine's replay buffer moved on, a gap went unfilled, the store lost data)
would otherwise stay degraded until the engine restarts. An engine that can
say what it holds (kvindex's vLLM plugin, from inside the engine) answers
with a :class:`Snapshot`: every tier's counts, exact as of the batch ``seq``
it published last before taking it. Applying :func:`plan_snapshot`'s
operations to an emptied rank, with ``seq`` as its watermark, and then the
batches after ``seq``, gives the counts the whole stream would have.

Pure logic, no I/O: the wire form is msgpack (:func:`encode_snapshot`,
:func:`decode_snapshot`), and who asks and who answers live elsewhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from indexer.core.events import GPU, BlockHash, WireError, normalise_medium
from indexer.core.residency import Op, RankResidency, Tier, TierOp

#: Its ``seq`` when the engine published no batch yet: the rank is empty.
NOTHING_PUBLISHED = -1

#: The rejection counted for a snapshot asking for more than any engine holds.
SNAPSHOT_OVER_CAPACITY = "snapshot_over_capacity"


class SnapshotTier(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The counts of one tier: ``counts[i]`` references of ``hashes[i]`` (each at least
    1); ``counts`` None: one each, the common case."""

    medium: str
    ownership: str | None
    group_idx: int
    locality: str | None
    hashes: list[BlockHash]
    counts: list[Annotated[int, msgspec.Meta(ge=1)]] | None = None


class Snapshot(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=False):
    """A rank's residency as of batch ``seq`` (published at ``ts``).

    ``group_kinds``: each KV group's kind as its store events name it (what
    hybrid matching needs); ``chunk_blocks``: blocks per offloaded chunk, where
    lower tiers hold chunks.
    """

    seq: int
    ts: float
    tiers: list[SnapshotTier]
    group_kinds: dict[int, str | None] = {}
    chunk_blocks: int | None = None

    @property
    def blocks(self) -> int:
        """Residencies it holds (a hash on two tiers counts twice)."""
        return sum(len(t.hashes) for t in self.tiers)


def beyond_capacity(snapshot: Snapshot, bounds: Mapping[str, int]) -> str | None:
    """Why applying the snapshot would build more than any engine holds (None: it
    would not): more references on a medium, one hash's counted as many times as
    its count says, than the rank may hold blocks there (``bounds``, by medium).

    Each reference is a block of the engine's cache (a physical GPU copy, an
    offloaded chunk holding the hash), so an engine within its rank's bound
    holds no more; a few bytes claiming ``counts: [10**9]`` would otherwise make
    kvindex build a billion of them. One pass over the decoded counts, before
    anything is planned or applied.
    """
    references = dict.fromkeys(bounds, 0)
    for t in snapshot.tiers:
        medium = normalise_medium(t.medium)
        references[medium] += len(t.hashes) if t.counts is None else sum(t.counts)
    over = [f"{m} {n} references, over {bounds[m]}" for m, n in references.items() if n > bounds[m]]
    return ", ".join(over) or None


def snapshot_of(residency: RankResidency, seq: int, ts: float) -> Snapshot:
    """The snapshot of counts kept as kvindex keeps them (an engine that follows its
    own events, or a test's reference)."""
    tables = residency.tables.items()
    tiers = [_tier_of(tier, table.counts, table.locality) for tier, table in tables]
    kinds = dict(residency.group_kinds)
    return Snapshot(seq, ts, [t for t in tiers if t.hashes], kinds, residency.chunk_blocks)


def _tier_of(tier: Tier, counts: dict[BlockHash, int], locality: str | None) -> SnapshotTier:
    hashes = list(counts)
    values = list(counts.values())
    several = any(c != 1 for c in values)
    return SnapshotTier(*tier, locality, hashes, values if several else None)


def plan_snapshot(snapshot: Snapshot) -> list[Op]:
    """Operations that give an empty rank the snapshot's counts: one per tier, +1 for
    each hash as many times as its count says (a store counts a hash repeated in one
    operation once per repeat, as in an event). What it builds is the snapshot's
    references, which :func:`beyond_capacity` bounds, whatever one hash's count."""
    kinds, chunk = snapshot.group_kinds, snapshot.chunk_blocks
    ops: list[Op] = []
    for t in snapshot.tiers:
        tier = Tier(normalise_medium(t.medium), t.ownership, t.group_idx)
        lower = chunk if tier.medium != GPU else None
        ops.append(TierOp(tier, 1, _references(t), t.locality, kinds.get(t.group_idx), lower))
    return ops


def _references(tier: SnapshotTier) -> Sequence[BlockHash]:
    """Each hash of the tier, repeated as many times as its count."""
    if tier.counts is None:
        return tier.hashes
    pairs = zip(tier.hashes, tier.counts, strict=True)
    return [h for h, count in pairs for _ in range(count)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Snapshot)


def encode_snapshot(snapshot: Snapshot) -> bytes:
    return _ENCODER.encode(snapshot)


def decode_snapshot(payload: bytes) -> Snapshot:
    """The snapshot a payload holds; raises :class:`WireError` for anything else
    (counts that do not pair with the hashes included)."""
    try:
        snapshot = _DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WireError("bad_snapshot", str(e)) from None
    for t in snapshot.tiers:
        if t.counts is not None and len(t.counts) != len(t.hashes):
            raise WireError("bad_snapshot", "a tier's counts do not pair with its hashes")
        normalise_medium(t.medium)  # raises for an unknown one
    if snapshot.seq < NOTHING_PUBLISHED:
        raise WireError("bad_snapshot", f"seq {snapshot.seq}")
    return snapshot


# --- asking and answering ---------------------------------------------------------
#
# A DEALER sends [b"", PROTOCOL, token] to the engine's snapshot ROUTER, which
# answers [b"", status, body]: OK with the encoded snapshot, or another status
# with a reason in UTF-8. One request per connection.

PROTOCOL = b"kvindex-snapshot/1"
OK, DENIED, BUSY, FAILED = b"ok", b"denied", b"busy", b"failed"


class SnapshotRefused(Exception):
    """The engine answered without a snapshot: ``status`` and its reason."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(f"{status}: {reason}" if reason else status)
        self.status = status


def snapshot_request(token: str | None) -> list[bytes]:
    return [b"", PROTOCOL, (token or "").encode()]


def requested_token(frames: list[bytes]) -> str | None:
    """The token of a request's frames (after the ROUTER's identity); None: not a
    request of this protocol."""
    if len(frames) != 3 or frames[0] != b"" or frames[1] != PROTOCOL:
        return None
    return frames[2].decode(errors="replace")


def snapshot_answer(status: bytes, body: bytes) -> list[bytes]:
    return [b"", status, body]


def answered_snapshot(frames: list[bytes]) -> Snapshot:
    """The snapshot an answer carries; raises :class:`SnapshotRefused` for a refusal
    and :class:`WireError` for anything else."""
    if len(frames) != 3 or frames[0] != b"":
        raise WireError("bad_snapshot", f"an answer of {len(frames)} frames")
    status, body = frames[1], frames[2]
    if status != OK:
        reason = body.decode(errors="replace")[:500]
        raise SnapshotRefused(status.decode(errors="replace")[:40], reason)
    return decode_snapshot(body)
