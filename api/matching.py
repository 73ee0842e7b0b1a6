"""The read path as the API runs it: wired from an API context, its picks made by the
API's router (:mod:`api.routing`). The rules are :mod:`indexer.query`'s."""

from __future__ import annotations

from api.context import ApiContext
from api.routing import Router
from indexer.loads import LoadBoard
from indexer.query import Query as Query
from indexer.query import ReadPath


class PrefixMatcher(ReadPath):
    """The read path over one API context, its picks made by a
    :class:`~api.routing.Router` of the context's routed entries and load board."""

    def __init__(self, ctx: ApiContext) -> None:
        loads = ctx.loads or LoadBoard(ctx.registry, ctx.store, ctx.settings.load)
        picker = Router(ctx.routed, loads, ctx.settings.routed).route
        super().__init__(
            ctx.store,
            ctx.registry,
            ctx.consumers,
            ctx.token_index,
            ctx.routed,
            picker,
            ctx.settings.weights,
            ctx.misdeclared,
        )
