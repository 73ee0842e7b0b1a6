"""What every route works with, wired by the program (:func:`kvindex.wiring.api_services`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.settings import ApiSettings
from indexer.announcements import Leases
from indexer.engine_registry import ConsumerView, Registry
from indexer.loads import LoadBoard
from indexer.misdeclared import MisdeclaredView
from indexer.prompts import Tokenizers
from indexer.query import ReadPath
from indexer.routed import MemoryRouted, RoutedEntries
from indexer.stores.base import Store
from indexer.token_index import TokenIndex


@dataclass(frozen=True, slots=True)
class ApiContext:
    """The store (guarded: failures are 503s), the registry, the subscriber's
    view, the learned token index, the settings, the models' tokenizers and the read
    path over them."""

    store: Store
    registry: Registry
    consumers: ConsumerView
    token_index: TokenIndex
    settings: ApiSettings
    tokenizers: Tokenizers
    #: what prefix-match queries and routed entries are answered by
    read_path: ReadPath
    #: the routed entries beside the store (in process unless given Redis's)
    routed: RoutedEntries = field(default_factory=MemoryRouted)
    #: the self-registered engines' leases over ``registry``
    leases: Leases | None = None
    #: engines whose events contradict their declaration (fed by the subscriber)
    misdeclared: MisdeclaredView | None = None
    #: each rank's load, which ``route: "best"`` weighs
    loads: LoadBoard | None = None
