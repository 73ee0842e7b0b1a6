"""What a :class:`~indexer.core.sequencer.Sequencer` is told and answers: small typed values."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from indexer.core.events import CPU, GPU

B = TypeVar("B")


class Mark(NamedTuple):
    """A batch applied (or the highest seq and ts seen): a store's watermark."""

    seq: int
    ts: float


class RankCounts(Protocol):
    """The fields of a rank's status the rules keep (the registry's ``RankStatus``)."""

    last_seq: int | None
    applied_seq: int | None
    last_event_ts: float | None
    degraded: bool
    missing: list[Any]  # records made by ``missing(first, last)``, newest last
    store_loss: str | None
    gaps: int
    gaps_filled: int
    gaps_unfilled: int
    replays: int
    restarts: int
    duplicates: int
    restores: int
    snapshot_error: str | None


#: The media whose counts an unfilled gap or a restart makes untrustworthy.
VOLATILE = (GPU, CPU)


# --- actions --------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: one per batch, and a frozen one is slower to make
class Apply(Generic[B]):
    """Apply ``batch`` as ``seq``; then report it with :meth:`Sequencer.applied`."""

    seq: int
    ts: float
    batch: B


@dataclass(slots=True)
class ApplyHeld:
    """Apply the batch held behind a gap as ``seq``, decoding ``payload`` only now;
    then report it with :meth:`Sequencer.applied`.

    A filled or given-up gap releases every batch held behind it at once, up
    to ``pending_bytes`` of them: decoded all together (a decoded batch with
    its token ids takes about six times its payload), they would take many
    times the bound. The payload decoded when it was held, so it decodes.
    """

    seq: int
    ts: float
    payload: bytes


@dataclass(frozen=True, slots=True)
class Clear:
    """Drop the rank's counts of ``media`` (and its watermark if ``reset_seq``)."""

    media: tuple[str, ...]
    reset_seq: bool = False


@dataclass(frozen=True, slots=True)
class EndRequest:
    """The replay request in flight is over: free its slot; ``close``: also close
    the replay connection, so a late answer to it never arrives."""

    close: bool


@dataclass(frozen=True, slots=True)
class Duplicate:
    """A batch received again (live and replay overlap) was skipped."""


@dataclass(frozen=True, slots=True)
class GapOpened:
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class GapFilled:
    first: int
    last: int


@dataclass(frozen=True, slots=True)
class GaveUp:
    """``first..last`` is lost for ``reason``; ``newly``: the gap's first loss."""

    first: int
    last: int
    reason: str
    cleared: bool
    newly: bool


@dataclass(frozen=True, slots=True)
class Restarted:
    """The engine restarted: seq ``seq`` (None: found by replay) of a new incarnation."""

    applied_seq: int | None
    seq: int | None


@dataclass(frozen=True, slots=True)
class ReplayTimedOut:
    """A request got no end marker in time; ``unavailable``: attempts ran out on it."""

    start: int
    unanswered: int
    unavailable: bool


@dataclass(frozen=True, slots=True)
class StoreLossFound:
    lost: str


@dataclass(frozen=True, slots=True)
class Restored:
    """The rank's counts are the engine's snapshot as of ``seq``: exact again;
    ``dropped``: held batches the snapshot already covered."""

    seq: int
    dropped: int


@dataclass(frozen=True, slots=True)
class SnapshotFailed:
    """No snapshot came, for ``reason``; asked again ``retry`` seconds on."""

    reason: str
    retry: float


@dataclass(frozen=True, slots=True)
class RebuildSettled:
    """A rank rebuilding after a store loss is exact again (``exact``) or degraded for good."""

    last: int
    exact: bool


Action = (
    Apply
    | ApplyHeld
    | Clear
    | EndRequest
    | Duplicate
    | GapOpened
    | GapFilled
    | GaveUp
    | Restarted
    | ReplayTimedOut
    | StoreLossFound
    | RebuildSettled
    | Restored
    | SnapshotFailed
)


# --- settings and bookkeeping ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rules:
    """The limits the rules use: a subset of the subscriber settings, which own
    their defaults (``SubscriberSettings.rules`` builds one), so none are here."""

    has_replay: bool
    replay_timeout: float
    snapshot_retry: float
    replay_attempts: int
    gap_clear_threshold: int
    probe_interval: float
    probe_backoff_max: float
    max_pending: int
    pending_bytes: int
    has_snapshot: bool = False  # the engine answers snapshots (set with has_replay)


@dataclass(frozen=True, slots=True)
class Ask:
    """A replay request to send: from ``start``; ``probe``: nothing known missing."""

    start: int
    probe: bool
