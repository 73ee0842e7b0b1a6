"""Engine-side half of kvindex: what an engine runs to publish KV cache events.

Imports only msgspec, pyzmq, the standard library and :mod:`indexer.wire`, so
an engine process never pulls in the server's dependencies (FastAPI, redis).
"""

from producer.tracker import (
    GroupSpec,
    OffloadEvent,
    OffloadKey,
    RequestView,
    Tracker,
)

__all__ = ["GroupSpec", "OffloadEvent", "OffloadKey", "RequestView", "Tracker"]
