"""Engine-side half of kvindex: what an engine runs to publish KV cache events.

Imports only msgspec, pyzmq, the standard library, :mod:`indexer.core` and
:mod:`indexer.engines` (the engine adapters), so an engine process never pulls in the server's
dependencies (FastAPI, redis).
"""

from producer.sim import SimConfig, SimEngine
from producer.tracker import (
    GroupSpec,
    OffloadEvent,
    OffloadKey,
    RequestView,
    Tracker,
)
from producer.workload import Request, Workload, WorkloadConfig

__all__ = [
    "GroupSpec",
    "OffloadEvent",
    "OffloadKey",
    "Request",
    "RequestView",
    "SimConfig",
    "SimEngine",
    "Tracker",
    "Workload",
    "WorkloadConfig",
]
