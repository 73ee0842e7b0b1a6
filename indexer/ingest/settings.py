"""How ranks are consumed: the ``subscriber`` settings, and what all consumers share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Annotated

import msgspec
import zmq.asyncio

from indexer.core.events import EventBatch, RankId
from indexer.core.sequencer import Rules
from indexer.engine_registry import BindPolicy
from indexer.ingest.slices import Slices

#: the settings a rank's sequencer reads, by name (each a field here and in Rules)
_RULE_LIMITS = tuple(f.name for f in fields(Rules) if not f.name.startswith("has_"))

#: Called after each applied batch; must be cheap, it runs in the apply loop.
Observer = Callable[[RankId, EventBatch], None]

#: Cap, in messages, on a replay socket's mark: a whole replay buffer may arrive at
#: once, and what ZeroMQ drops past the mark is simply asked again.
REPLAY_HWM = 100
#: Seconds of applying batches, across all ranks, before the loop is yielded to the
#: API's queries (a burst otherwise holds a router's query for the whole run).
APPLY_SLICE = 0.001

#: A positive duration in seconds (a config field).
Seconds = Annotated[float, msgspec.Meta(gt=0)]
#: A count of at least one (a config field).
Count = Annotated[int, msgspec.Meta(ge=1)]


class SubscriberSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ranks are consumed: the ``subscriber`` section of the config file.

    Each rank's received batches are bounded in bytes whatever the load: the
    intake holds under ``intake_bytes`` plus one message (and each of the live
    and replay readers one in hand), the held batches under ``pending_bytes``
    plus one, and ZeroMQ, per connection, the mark's messages plus the one it is
    reading (:meth:`receive_hwm`); the sequencer decodes one batch at a time,
    also when a gap filled or given up releases every batch held behind it
    (decoded with its token ids, a batch takes about six times its payload). A
    message is counted as ``max_message_bytes``, its largest frame: that holds
    for the wire's messages (a short topic and seq, then the batch), not for a
    peer sending more or padded frames (ZeroMQ bounds frames, not messages). A
    bound SUB socket (``bind: true``) has a queue per engine connected.
    """

    #: Seconds without a replay frame before a request is abandoned and asked again.
    #: Raise it for engines whose replay answers cross a slow link.
    replay_timeout: Seconds = 2.0
    #: Replay requests in a row that fill nothing before a gap is declared unfilled
    #: (the rank degraded).
    replay_attempts: Count = 3
    #: Replay requests in flight across all ranks, so a fleet restarting at once does
    #: not stampede its engines. Raise it when many ranks catch up slowly after a start.
    max_concurrent_replays: Count = 8
    #: An unfilled range of more batches than this also drops the rank's GPU and CPU
    #: counts (too much was missed to trust them). Lower it to prefer misses to stale
    #: answers after long outages.
    gap_clear_threshold: Count = 1000
    #: Idle seconds after which a rank asks replay whether it missed anything (a lost
    #: last batch, a restart while idle); 0: never.
    probe_interval: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    #: An unanswered probe doubles the wait before the next (``probe_interval``, twice
    #: that, ...) up to this many seconds, so dead engines cost almost nothing.
    probe_backoff_max: Seconds = 60.0
    #: Received batches held before the readers pause (with ``intake_bytes``).
    intake_limit: Count = 10_000
    #: Bytes of received batches held before the readers pause: a rank's memory bound
    #: while its store is slow. Lower it on small machines with many busy ranks.
    intake_bytes: Count = 128 << 20
    #: Batches held out of order behind a gap; beyond, the gap is declared unfilled.
    max_pending: Count = 20_000
    #: Bytes of batches held behind a gap (and while a snapshot is awaited); beyond,
    #: the gap is declared unfilled.
    pending_bytes: Count = 128 << 20
    #: The largest frame accepted (ZeroMQ's ``MAXMSGSIZE``: a peer announcing a larger
    #: one is disconnected before it is read, counted as ``oversize``). vLLM's largest
    #: real batch, a 128k-token prefill, is a few MB (~10 MB for a hybrid model);
    #: 64 MiB leaves room for six times that. Lower it, with ``queue_bytes``, where
    #: engines are not trusted.
    max_message_bytes: Count = 64 << 20
    #: What ZeroMQ itself may queue per connection of a SUB or replay socket, whether
    #: or not the readers read: its receive high-water mark is this over
    #: ``max_message_bytes`` (at least one message). Past it ZeroMQ stops reading and
    #: the engine's queue holds the rest (what its PUB drops is a gap replay fills).
    #: Under 16 messages a catch-up costs the readers more CPU (~1.3x at 8, ~1.6x at 4).
    queue_bytes: Count = 1 << 30
    #: A cap, in messages, on the SUB socket's mark (0: ``queue_bytes`` alone). For
    #: measurements that want a fixed mark; operators turn ``queue_bytes`` instead.
    sub_hwm: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    #: ZeroMQ retries a failed connection after 0.1 s, doubling the wait up to this
    #: many seconds: how soon a restarted engine is heard again.
    reconnect_max: Seconds = 10.0
    #: Seconds without any peer before a rank that never connected is reported (one
    #: warning, ``never_connected``): usually a wrong endpoint or an engine without
    #: ``--kv-events-config``.
    no_publisher_after: Seconds = 10.0
    #: Cap, in seconds, of the backoff between retries of a failed store call.
    store_retry_max: Seconds = 5.0
    #: Seconds to finish the batch in hand at shutdown.
    stop_grace: Seconds = 5.0
    #: Seconds to wait for an engine's snapshot (asked when replay cannot fill a range,
    #: of engines with a ``snapshot_endpoint``); the rank's batches are held meanwhile,
    #: within ``max_pending`` and ``pending_bytes``.
    snapshot_timeout: Seconds = 30.0
    #: Seconds before a snapshot that did not come is asked again.
    snapshot_retry: Seconds = 10.0
    #: Snapshots in flight across all ranks (each is as large as an engine's cache).
    max_concurrent_snapshots: Count = 2
    #: The largest snapshot accepted: 1M GPU blocks of 64-bit hashes are about 9 MB,
    #: of 32-byte digests about 34 MB. Raise it for engines with larger caches.
    snapshot_bytes: Count = 512 << 20
    #: Blocks (distinct hashes) a rank may hold on one medium: CPU and storage, and GPU
    #: unless the engine declares ``gpu_blocks`` (then twice that). A medium past it is
    #: cleared and its events dropped until the engine restarts (``over_capacity``).
    #: About 160 bytes a block in the embedded store: the default is ~330 MB a medium.
    #: Raise it for engines offloading more than 2M blocks to one tier.
    max_blocks: Count = 1 << 21
    #: Where engines with ``bind: true`` may make kvindex listen (default: loopback
    #: tcp only).
    bind: BindPolicy = BindPolicy()

    def rules(self, has_replay: bool, has_snapshot: bool = False) -> Rules:
        """The limits a rank's sequencer applies (``has_replay``, ``has_snapshot``: its
        engine has a replay, a snapshot endpoint)."""
        limits = {name: getattr(self, name) for name in _RULE_LIMITS}
        return Rules(has_replay=has_replay, has_snapshot=has_snapshot, **limits)

    def receive_hwm(self, cap: int) -> int:
        """The receive high-water mark of a consumer socket (``cap``: ``sub_hwm`` or
        :data:`REPLAY_HWM`): the messages of ``max_message_bytes`` that fit in
        ``queue_bytes``, at least one, at most ``cap`` (0: no cap)."""
        fits = max(1, self.queue_bytes // self.max_message_bytes)
        return min(fits, cap) if cap else fits


@dataclass(slots=True)
class Shared:
    """What every rank consumer of one process uses."""

    settings: SubscriberSettings
    context: zmq.asyncio.Context
    replay_slots: asyncio.Semaphore
    #: Snapshots in flight across the process (``max_concurrent_snapshots``).
    snapshot_slots: asyncio.Semaphore
    #: The bearer token engines' snapshot endpoints ask for (the API's), None: none set.
    token: str | None
    notify: Observer
    #: Whether an observer reads an engine's token ids (else batches are decoded without them).
    reads_tokens: Callable[[str], bool]
    #: The loop-turn budget every consumer applies under.
    slices: Slices
