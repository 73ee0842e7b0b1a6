"""``route: "best"``: weigh every candidate rank's prefix against its load, pick the
cheapest and record the prompt as routed to it (:mod:`indexer.core.load` has the
cost; :mod:`indexer.routed` picks and records in one atomic step).

The answer says what was weighed (:class:`~answers.RouteCost` per candidate),
so a router can log why a rank was picked.
"""

from __future__ import annotations

from collections.abc import Sequence

from answers import RouteCost
from indexer.core.events import BlockHash, RankId
from indexer.core.load import cost
from indexer.core.matching import NO_MATCH, PrefixMatch, TierWeights
from indexer.core.routed import Candidate, RoutedRules
from indexer.core.routed import score as routed_score
from indexer.engine_registry import EngineSpec
from indexer.loads import LoadBoard, Report
from indexer.routed import RoutedEntries

#: What a pick answers: the rank (None: no candidate), the candidates' routed_blocks
#: (the pick's after its record), and the costs weighed, the pick's first.
Routed = tuple[Candidate | None, dict[RankId, int], list[RouteCost]]


class LoadAwarePicker:
    """The picks of one process (a :data:`~indexer.query.matcher.Picker`): its routed
    entries, its load board, its rules."""

    def __init__(self, routed: RoutedEntries, loads: LoadBoard, rules: RoutedRules) -> None:
        self._routed, self._loads, self._rules = routed, loads, rules

    async def route(
        self,
        chain: list[BlockHash],
        ranks: Sequence[tuple[EngineSpec, int, bool]],
        found: dict[RankId, PrefixMatch],
        weights: TierWeights,
        ttl: float,
    ) -> Routed:
        """Route ``chain`` to the cheapest of ``ranks`` (spec, dp rank, degraded), in the
        order ties go by. A degraded rank (not connected, an unfilled gap) is weighed as
        holding nothing: its numbers may be stale, and after an engine restart they are
        the old process's, a cache that is gone."""
        ids = [RankId(spec.name, dp_rank) for spec, dp_rank, _ in ranks]
        evented = [(rank, spec.events) for (spec, _, _), rank in zip(ranks, ids, strict=True)]
        placed = self._loads.placements(evented)
        candidates = [
            Candidate(
                rank.engine,
                rank.dp_rank,
                NO_MATCH if degraded else found.get(rank, NO_MATCH),
                self._rules.bound(None if spec.events else spec.gpu_blocks),
                where,
            )
            for (spec, _, degraded), rank, (where, _) in zip(ranks, ids, placed, strict=True)
        ]
        pick, runs, queues = await self._routed.route(chain, candidates, weights, ttl)
        reports = [report for _, report in placed]
        costs = self._costs(candidates, reports, (runs, queues), weights, len(chain), pick)
        if pick is not None:
            rank = RankId(pick.engine, pick.dp_rank)
            self._loads.picked(rank)
            if pick.match.gpu_blocks < len(chain):
                runs = {**runs, rank: len(chain)}
        return pick, runs, costs

    def _costs(
        self,
        candidates: list[Candidate],
        reports: list[Report | None],
        weighed: tuple[dict[RankId, int], dict[RankId, int]],
        weights: TierWeights,
        num_blocks: int,
        pick: Candidate | None,
    ) -> list[RouteCost]:
        """Each candidate's cost as it was weighed (``weighed``: the route's routed runs
        and queues), with the report its load is of; the pick first, then cheapest first."""
        runs, queues = weighed
        rows = []
        for c, report in zip(candidates, reports, strict=True):
            rank = RankId(c.engine, c.dp_rank)
            here = (runs.get(rank, 0), queues.get(rank, 0))
            rows.append(self._cost(c, report, here, weights, num_blocks))
        picked = None if pick is None else (pick.engine, pick.dp_rank)
        rows.sort(key=lambda row: ((row.engine, row.dp_rank) != picked, row.cost))
        return rows

    def _cost(
        self,
        c: Candidate,
        report: Report | None,
        weighed: tuple[int, int],
        weights: TierWeights,
        num_blocks: int,
    ) -> RouteCost:
        run, queued = weighed
        s = routed_score(c.match, run, weights)  # the exact score where routed adds nothing
        where = c.placement
        return RouteCost(
            c.engine,
            c.dp_rank,
            round(cost(s, num_blocks, where, queued), 6),
            round(s, 6),
            where.requests_ahead,
            queued,
            where.pending,
            None if report is None else report.load.running,
            None if report is None else report.load.waiting,
            round(where.fullness, 6),
            None if report is None else round(self._loads.age(report) * 1000, 1),
        )
