"""An engine core per data-parallel rank, built from vLLM's real scheduler side
and stepped by its own busy loop on a thread, and read back as vLLM holds it:
the truth kvindex's answers are held to, apart from the tests that compare."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.engine import EngineCoreRequestType
from vllm.v1.engine.core import EngineCoreProc, EngineShutdownState
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.request import Request

from producer.vllm_plugin import snapshots
from tests.vllm_tier.pool_truth import cached_copies
from tests.vllm_tier.snapshot_engine import (
    BLOCK,
    CHUNK_BLOCKS,
    Chats,
    engine_config,
    make_scheduler,
    plan_kv_cache,
)
from tests.vllm_tier.stand_in import StandIn


class Rank:
    """One data-parallel rank's engine core: vLLM's scheduler, stepped by a thread
    that runs the engine core's busy loop over its input queue."""

    def __init__(self, model_dir, base: int, rank: int) -> None:
        self.rank, self.base = rank, base + rank
        self.config = engine_config(model_dir, base, rank)
        core = EngineCoreProc.__new__(EngineCoreProc)
        core.shutdown_state = EngineShutdownState.RUNNING
        core.reject_new_requests = False
        core.input_queue = queue.Queue()
        self.kv_cache_config = plan_kv_cache(core, self.config)
        # what the plugin's wrapper of _initialize_kv_caches does, on every rank
        self.service = snapshots.attach(core, self.config, self.kv_cache_config)
        _, hash_block_size = resolve_kv_cache_block_sizes(self.kv_cache_config, self.config)
        core.scheduler = self.scheduler = make_scheduler(self.config, self.kv_cache_config)
        self.core = core
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.publisher = self.scheduler.kv_event_publisher
        self.mirror = self.publisher._kvindex_mirror
        self.cpu = self.scheduler.connector.connector_scheduler.manager
        self.chats = Chats(seed=100 + rank)
        self.served: list[list[int]] = []  # every prompt's block hashes, as vLLM hashed them
        self.removed: Counter[str] = Counter()  # BlockRemoved events published, by medium
        self.taken: list[tuple[int, str, bool]] = []  # snapshots: seq, thread, client on
        self.client_on = False
        self._submitted = self._handled = 0
        self.stand_in = StandIn(self.scheduler)
        self.copies_checked = False  # a GPU block with two physical copies compared
        #: handle inputs while a step runs, as vLLM 0.34's ``_wait_for_output`` does
        self.mid_step = False
        #: set: the next step with unpublished changes waits mid-step for a wake-up
        self.hold = threading.Event()
        self.held_after: int | None = None  # the last seq published when it held
        self._in_step = False
        self.hooked_mid_step = 0  # the plugin's hook run mid-step, a snapshot wanted
        self._idle = threading.Event()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._observe()
        self.thread = threading.Thread(target=self._busy_loop, name=f"EngineCore_DP{rank}")
        self.thread.start()

    def _observe(self) -> None:
        """Count what the rank publishes and record each snapshot it takes."""
        publish, take = self.publisher.publish, self.service._take

        def publishing(batch):
            for event in batch.events:
                if type(event).__name__ == "BlockRemoved":
                    self.removed[(event.medium or "GPU").upper()] += 1
            return publish(batch)

        def taking():
            taken = take()
            self.taken.append((taken.seq, threading.current_thread().name, self.client_on))
            return taken

        between = self.service.between_steps

        def hooked():
            self.hooked_mid_step += self._in_step and self.service._handoff.wanted
            return between()

        self.publisher.publish = publishing
        self.service._take = taking
        self.service.between_steps = hooked

    # --- the engine core's thread ---------------------------------------------

    def _busy_loop(self) -> None:
        """``EngineCoreProc.run_busy_loop``: wait for input when idle, handle all of
        it, step."""
        core = self.core
        try:
            while not self._stop.is_set():
                if not self.scheduler.has_requests():
                    self._idle.set()
                    try:
                        request = core.input_queue.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    self._idle.clear()
                    self._handle(request)
                while not core.input_queue.empty():
                    self._handle(core.input_queue.get_nowait())
                if self.scheduler.has_requests():
                    self.stand_in.step(self._during_step if self.mid_step else None)
        except BaseException as e:  # surfaced by the test
            self.error = e
            raise

    def _during_step(self) -> None:
        """vLLM 0.34's ``_wait_for_output``: the new requests, aborts and wake-ups that
        came handled while the model runs (``hold``: on a step whose changes are not
        published yet, wait for a wake-up first)."""
        waiting = self.core.input_queue
        pool = self.scheduler.kv_cache_manager.block_pool
        if self.hold.is_set() and pool.kv_event_queue:
            self.held_after = self.service._published.last[0]
            deadline = time.monotonic() + 60
            while not any(r[0] == EngineCoreRequestType.WAKEUP for r in list(waiting.queue)):
                assert time.monotonic() < deadline, "no wake-up came"
                time.sleep(0.001)
            self.hold.clear()
        self._in_step = True
        try:
            while not waiting.empty():
                self._handle(waiting.get_nowait())
        finally:
            self._in_step = False

    def _handle(self, request) -> None:
        EngineCoreProc._handle_client_request(self.core, *request)
        if request[0] == EngineCoreRequestType.ADD:
            self._handled += 1

    # --- the client's side ----------------------------------------------------

    def submit(self, tokens: list[int] | None = None) -> list:
        """Send the chats' next request (or ``tokens``); its block hashes."""
        tokens = next(self.chats) if tokens is None else tokens
        params = SamplingParams(max_tokens=1)
        request = Request(
            f"dp{self.rank}-{self._submitted}", tokens, params, None, block_hasher=self.hasher
        )
        self.served.append(list(request.block_hashes))
        self._submitted += 1
        self.core.input_queue.put_nowait((EngineCoreRequestType.ADD, (request, 0)))
        return self.served[-1]

    def abort_last(self) -> None:
        """Abort the request submitted last (served already or not)."""
        request_id = f"dp{self.rank}-{self._submitted - 1}"
        self.core.input_queue.put_nowait((EngineCoreRequestType.ABORT, [request_id]))

    def serve_now(self, tokens: list[int]) -> list:
        hashes = self.submit(tokens)
        self.settle()
        return hashes

    @property
    def outstanding(self) -> int:
        return self._submitted - self._handled + self.scheduler.get_num_unfinished_requests()

    def settle(self, timeout: float = 20.0) -> None:
        """Until every request submitted is served, its offloads stored and everything
        published is sent."""
        deadline = time.monotonic() + timeout
        while not (self._handled == self._submitted and self._idle.is_set()):
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"rank {self.rank} did not settle"
            time.sleep(0.01)
        assert self.mirror.flush(timeout)

    @property
    def last_seq(self) -> int:
        return self.mirror.last_offered_seq

    # --- vLLM's own state (read while the rank is settled) ----------------------

    def gpu_counts(self) -> dict[int, int]:
        """Each cached hash's physical copies in the block pool, as vLLM publishes it."""
        pool = self.scheduler.kv_cache_manager.block_pool
        keys = cached_copies(pool)
        assert set(keys) == set(pool.cached_block_hash_to_block._cache), "the table agrees"
        assert all(get_group_id(key) == 0 for key in keys)
        return {maybe_convert_block_hash(get_block_hash(key)): n for key, n in keys.items()}

    def cpu_counts(self) -> dict[int, int]:
        """Each hash's CPU chunks listing it: the chunks the CPU tier holds, with the
        hashes vLLM's tracker announced each with (all its blocks'; only its end's for
        a chunk it could not describe, stored while an eviction of it was in flight:
        a placeholder)."""
        described = self.scheduler.connector.connector_scheduler._events_tracker
        counts: Counter[int] = Counter()
        for key, chunk in self.cpu._policy.chunks.items():
            assert chunk.is_ready
            meta = described._pending_event_metadata.get(key)
            hashes = meta.block_hashes if meta is not None else [get_block_hash(key)]
            assert make_offload_key(hashes[-1], 0) == key  # a chunk is keyed by its end
            counts.update(maybe_convert_block_hash(h) for h in hashes)
        return dict(counts)

    def gpu_hit(self, hashes: list) -> int:
        """vLLM's GPU prefix-cache hit for a prompt of these full blocks, in blocks."""
        coordinator = self.scheduler.kv_cache_manager.coordinator
        return coordinator.find_longest_cache_hit(hashes, len(hashes) * BLOCK)[1] // BLOCK

    def cpu_hit(self, hashes: list) -> int:
        """The leading whole chunks the CPU tier holds, in blocks."""
        chunks = self.cpu._policy.chunks
        hit = 0
        for end in range(CHUNK_BLOCKS - 1, len(hashes), CHUNK_BLOCKS):
            chunk = chunks.get(make_offload_key(hashes[end], 0))
            if chunk is None or not chunk.is_ready:
                break
            hit += CHUNK_BLOCKS
        return hit

    def close(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)
        self.publisher.shutdown()


class Fleet:
    """The engine's ranks and a client keeping them busy."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks
        self._client: threading.Thread | None = None
        self._client_on = threading.Event()
        self._aborts = False

    def serve(self, requests: int) -> None:
        """Each rank serves ``requests`` more requests, one at a time; then settles."""
        for _ in range(requests):
            for rank in self.ranks:
                rank.submit()
            for rank in self.ranks:
                rank.settle()

    @contextlib.contextmanager
    def stepping(self, aborts: bool = False) -> Iterator[None]:
        """A client keeping each rank busy (two requests in flight) meanwhile (``aborts``:
        aborting every third request it sends right after)."""
        self._aborts = aborts
        self._client_on.set()
        for rank in self.ranks:
            rank.client_on = True
        self._client = threading.Thread(target=self._keep_busy, name="client")
        self._client.start()
        try:
            yield
        finally:
            self._client_on.clear()
            self._client.join()
            for rank in self.ranks:
                rank.client_on = False
                rank.settle()

    def _keep_busy(self) -> None:
        sent = 0
        while self._client_on.is_set():
            for rank in self.ranks:
                if rank.outstanding < 2:
                    rank.submit()
                    sent += 1
                    if self._aborts and sent % 3 == 0:
                        rank.abort_last()
            time.sleep(0.004)

    def batches(self) -> list[int]:
        return [rank.last_seq + 1 for rank in self.ranks]
