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
from indexer.ingest.slices import Slices
from indexer.registry import BindPolicy

#: the settings a rank's sequencer reads, by name (each a field here and in Rules)
_RULE_LIMITS = tuple(f.name for f in fields(Rules) if not f.name.startswith("has_"))

#: Called after each applied batch; must be cheap, it runs in the apply loop.
Observer = Callable[[RankId, EventBatch], None]

#: A positive duration in seconds (a config field).
Seconds = Annotated[float, msgspec.Meta(gt=0)]
#: A count of at least one (a config field).
Count = Annotated[int, msgspec.Meta(ge=1)]


class SubscriberSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ranks are consumed: the ``subscriber`` section of the config file.

    - ``replay_timeout``: seconds without a replay frame before a request is
      abandoned (and retried).
    - ``replay_attempts``: requests in a row that fill nothing before a gap
      is declared unfilled.
    - ``max_concurrent_replays``: replay requests in flight across all ranks,
      so a fleet restarting at once does not stampede its engines.
    - ``gap_clear_threshold``: an unfilled range of more batches than this
      also drops the rank's GPU/CPU counts.
    - ``probe_interval``: idle seconds after which a rank asks replay whether
      it missed anything (a lost last batch, a restart while idle); 0: never.
    - ``probe_backoff_max``: a probe that goes unanswered doubles the wait
      before the next one (``probe_interval``, twice that, ...), up to this.
    - ``intake_limit``, ``intake_bytes``: received batches, and their bytes,
      held before the readers pause.
    - ``max_pending``, ``pending_bytes``: batches, and their bytes, held out
      of order behind a gap; beyond either the gap is declared unfilled.
    - ``max_message_bytes``: the largest frame accepted (ZeroMQ's
      ``MAXMSGSIZE``: a peer announcing a larger one is disconnected before
      it is read). vLLM publishes one batch per engine step; the largest
      real one is a long prefill: 128k tokens are 8,192 blocks of 16, whose
      ``BlockStored`` carries 8,192 hashes (32-byte digests: ~280 KB) and
      131,072 token ids (up to 5 bytes each: ~660 KB), about 1 MB per KV
      cache group, and as much again for the CPU offload's copy and the
      evictions it causes: a few MB, ~10 MB for a hybrid model with several
      groups. 64 MiB leaves room for six times that.
    - ``queue_bytes``: what ZeroMQ itself may queue per connection of a SUB
      or replay DEALER socket. ZeroMQ's I/O thread reads TCP into the
      socket's queue whether or not the readers read it (they pause while
      the intake is full, or the loop is busy), until the queue holds its
      receive high-water mark, counted in messages: the mark is therefore
      this over ``max_message_bytes`` (at least one message), so the queue
      stays within it whatever the messages' sizes. Past the mark ZeroMQ
      stops reading the connection: the engine's own queue holds the rest,
      and what its PUB drops becomes a gap that replay fills.
    - ``sub_hwm``, ``replay_hwm``: caps, in messages, on those marks
      (``sub_hwm`` 0: no cap but ``queue_bytes``). A low mark costs the readers CPU when batches
      queue (fewer are read per wake-up): a catch-up of 2 KB batches took
      ~1.1x the CPU at the default's mark of 16 (1 GiB over 64 MiB), ~1.3x
      at 8, ~1.6x at 4, as much at 32 as at 10,000.
    - ``reconnect_max``: ZeroMQ retries a connection that fails after 0.1 s,
      doubling the wait up to this many seconds.
    - ``no_publisher_after``: seconds without any peer before a rank that
      has never connected is reported (one warning, ``never_connected``).
    - ``store_retry_max``: cap of the store retry backoff, seconds.
    - ``stop_grace``: seconds to finish the batch in hand at shutdown.
    - ``apply_slice``: seconds of applying batches, across all ranks, before
      the loop is yielded to the API's queries (a burst otherwise holds a
      router's query for the whole run of batches between yields).
    - ``max_missing``: unfilled ranges kept per rank for operators.
    - ``snapshot_timeout``: seconds to wait for an engine's snapshot (asked
      when replay cannot fill a range, from engines that announce a
      ``snapshot_endpoint``: :mod:`indexer.ingest.snapshots`); the rank's
      batches are held meanwhile, within ``max_pending`` and ``pending_bytes``.
    - ``snapshot_retry``: seconds before a failed snapshot is asked again.
    - ``max_concurrent_snapshots``: snapshots in flight across all ranks.
    - ``snapshot_bytes``: the largest snapshot accepted. An engine's snapshot
      holds every cached block hash once per tier: 1M GPU blocks of 64-bit
      hashes are about 9 MB, of 32-byte digests about 34 MB.
    - ``max_blocks``: the blocks (distinct hashes) a rank may hold on one
      medium: on CPU and storage, and on GPU unless its engine declares
      ``gpu_blocks`` (then twice that: :mod:`indexer.ingest.capacity`). A
      medium past its bound is cleared and its events dropped (counted as
      rejected, ``over_capacity``) until the engine restarts, the rank
      degraded meanwhile. A block of 32-byte hashes costs the embedded store
      about 160 bytes: the default's 2,097,152 are ~330 MB per medium.
    - ``bind``: where engines with ``bind: true`` may make kvindex listen
      (:class:`~indexer.registry.BindPolicy`; default: loopback tcp only).

    Each rank's received batches are thus bounded in bytes whatever the load:
    the intake holds under ``intake_bytes`` plus one message (and each of the
    live and replay readers one in hand), the held batches under
    ``pending_bytes`` plus one, and ZeroMQ, per connection, the mark's
    messages plus the one it is reading (:meth:`receive_hwm`); the sequencer
    decodes one batch at a time, also when a gap filled or given up releases
    every batch held behind it (each is decoded as its turn to be applied
    comes: decoded with its token ids, a batch takes about six times its
    payload). A
    message is counted as ``max_message_bytes``, its largest frame: that holds
    for the wire's messages (a short topic and seq, then the batch), not for a
    peer sending more or padded frames (ZeroMQ bounds frames, not messages).
    A bound SUB socket (``bind: true``) has a queue per engine connected.
    """

    replay_timeout: Seconds = 2.0
    replay_attempts: Count = 3
    max_concurrent_replays: Count = 8
    gap_clear_threshold: Count = 1000
    probe_interval: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    probe_backoff_max: Seconds = 60.0
    intake_limit: Count = 10_000
    intake_bytes: Count = 128 << 20
    max_pending: Count = 20_000
    pending_bytes: Count = 128 << 20
    max_message_bytes: Count = 64 << 20
    queue_bytes: Count = 1 << 30
    sub_hwm: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    replay_hwm: Count = 100
    reconnect_max: Seconds = 10.0
    no_publisher_after: Seconds = 10.0
    store_retry_max: Seconds = 5.0
    stop_grace: Seconds = 5.0
    apply_slice: Seconds = 0.001
    max_missing: Count = 100
    snapshot_timeout: Seconds = 30.0
    snapshot_retry: Seconds = 10.0
    max_concurrent_snapshots: Count = 2
    snapshot_bytes: Count = 512 << 20
    max_blocks: Count = 1 << 21
    bind: BindPolicy = BindPolicy()

    def rules(self, has_replay: bool, has_snapshot: bool = False) -> Rules:
        """The limits a rank's sequencer applies (``has_replay``, ``has_snapshot``: its
        engine has a replay, a snapshot endpoint)."""
        limits = {name: getattr(self, name) for name in _RULE_LIMITS}
        return Rules(has_replay=has_replay, has_snapshot=has_snapshot, **limits)

    def receive_hwm(self, cap: int) -> int:
        """The receive high-water mark of a consumer socket (``cap``: ``sub_hwm`` or
        ``replay_hwm``): the messages of ``max_message_bytes`` that fit in
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
