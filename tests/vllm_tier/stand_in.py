"""One engine step through vLLM's real scheduler, with stand-ins for the model and the
offloading worker: the one definition of a step the tier's engines share.

A scheduled prefill "runs" at once and samples one token. The offloading worker
completes transfers when vLLM's ``OffloadingConnectorWorker`` does: a store job is
submitted at the start of the step after the one that scheduled it (or at once when
the scheduler flushes it), a load in its own step; each is reported done in the step
it runs in, through vLLM's job bookkeeping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.vllm_tier.runner import runner_output

#: The token every "forward pass" samples.
SAMPLED = 7


class StandIn:
    """The model and the offloading worker of one engine, stepping its ``scheduler``."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._stores: list[int] = []  # store jobs the worker submits next step
        self.loads = 0  # load jobs: chunks read back from the CPU tier

    def step(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Schedule, "run" the model and the offloading worker, update; ``meanwhile``
        runs while the model "runs" (the engine core's inputs, as vLLM 0.34 handles
        them during a step)."""
        output = self.scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [
            [SAMPLED] if requests[i].num_computed_tokens >= requests[i].num_tokens else []
            for i in ids
        ]
        connector = self._offloading(output.kv_connector_metadata)
        if meanwhile is not None:
            meanwhile()
        self.scheduler.update_from_output(output, runner_output(ids, sampled, connector))

    def _offloading(self, meta: Any) -> Any:
        if meta is None:  # no connector
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        flushed = meta.jobs_to_flush or set()
        done, loaded = OffloadingWorkerMetadata(), set()
        for job_id in [*self._stores, *(j for j in meta.store_jobs if j in flushed)]:
            done.mark_completed(job_id)
        self._stores = [j for j in meta.store_jobs if j not in flushed]
        for job_id, job in meta.load_jobs.items():
            self.loads += 1
            done.mark_completed(job_id)
            if not job.sync:
                loaded.add(job.req_id)
        return KVConnectorOutput(finished_recving=loaded or None, kv_connector_worker_meta=done)
