"""The order a batch's events are planned in: one rule, for every reader of a batch.

Pure logic, no I/O. :func:`planned_runs` is the rule: the batch's events as runs
of alike events, in the order :func:`~indexer.core.residency.plan_batch` turns
them into operations. vLLM's decoder for the index
(:func:`indexer.engines.vllm.wire.decode_batch` with ``tokens=False``) gives its
events as :func:`indexed_events` does: in this order already, alike neighbours
merged (:func:`merge_key`), so that a batch reaches planning as a few events; its
compiled scanner states both rules again in C, condition by condition (in Python,
they would make decoding and applying a third slower), and ``tests/test_frames.py``
and ``tests/test_planning.py`` check it against :func:`indexed_events` on stretches
that reach every branch of them.

Terms. A *run* is a longest sequence of consecutive events alike in
:data:`SIGNATURE`: one operation on one tier. A *stretch* is a longest sequence
of consecutive runs that act on one place (:func:`place`: the tier and the
locality as sent, so ``cpu`` and ``CPU`` are two places; a clear, which has
none of these fields, shares the place of events that have none either).

The rule: in a stretch of more than two runs with no clear, removals move ahead
of stores (each keeping its order; runs then next to a run alike are joined)
unless some removal removes a hash an earlier store of the stretch stored. The
move changes no count: a count of one hash never depends on another's, so only
a store and a removal of one hash do not commute (store then remove leaves the
hash as it was; remove then store leaves it held), and a removal that comes
before every store of its hash stays before them. It changes nothing else a
batch teaches: only stores teach a group's kind and the chunk size, and their
order is kept; every run of a stretch has one locality. A CPU pool evicting one
chunk per chunk it stores sends them alternating, hundreds a batch: moved, they
plan as two operations, not one per event. With one or two runs nothing is
gained, and the order is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, groupby
from operator import attrgetter, itemgetter

import msgspec

from indexer.core.events import GPU, AllBlocksCleared, BlockRemoved, Event

#: What makes consecutive events one operation, read in C for every event: the
#: class, then the place (:func:`place`), then the kind (None for removals and clears).
SIGNATURE = attrgetter(
    "__class__", "medium", "ownership", "group_idx", "locality", "kv_cache_spec_kind"
)

#: A run: its events' :data:`SIGNATURE` and the events, in order.
Run = tuple[tuple, list[Event]]


def planned_runs(events: Iterable[Event]) -> Iterator[Run]:
    """The events' runs in planning order (the module's rule); the events are not changed.

    Run again on events it ordered (a decoded batch's), it moves nothing: where it
    moved removals, they are ahead already, which it sees without reading a hash.
    """
    for _, stretch in groupby(groupby(events, SIGNATURE), place):
        runs = [(signature, list(run)) for signature, run in stretch]
        yield from _removals_first(runs) if removals_move(runs) else runs


def planning_order(events: Sequence[Event]) -> list[Event]:
    """The events, one list, in the order :func:`planned_runs` plans them."""
    return [event for _, run in planned_runs(events) for event in run]


def merge_key(event: Event) -> tuple | None:
    """What consecutive events must share to plan as one event listing their hashes in
    order; None: the event merges with none.

    Removals of one run (:data:`SIGNATURE`) merge, and so do GPU stores alike also in
    what planning reads off each store (its sliding window and block size). Lower-tier
    stores do not: each one's length teaches the chunk size.
    """
    cls = type(event)
    if cls is BlockRemoved:
        return SIGNATURE(event)
    if cls is AllBlocksCleared or event.medium not in (None, GPU):
        return None
    return (*SIGNATURE(event), event.kv_cache_spec_sliding_window, event.block_size)


def merged(events: Iterable[Event], most: int) -> list[Event]:
    """Each stretch of consecutive events alike (:func:`merge_key`) as one event listing
    their hashes in order, up to ``most`` each. For events that carry only what the
    index reads (a store's token ids would not survive the merge)."""
    out: list[Event] = []
    for key, stretch in groupby(events, merge_key):
        if key is None:
            out.extend(stretch)
            continue
        run: list[Event] = []
        count = 0
        for event in stretch:
            if run and count + len(event.block_hashes) > most:
                out.append(_joined(run))
                run, count = [], 0
            run.append(event)
            count += len(event.block_hashes)
        out.append(_joined(run))
    return out


def indexed_events(events: Iterable[Event], most: int) -> list[Event]:
    """A batch's events as the index reads them: alike neighbours merged, in planning
    order, merged again (removals moved together), up to ``most`` hashes each. A pool
    evicting one block per event costs a few events, not hundreds; the index counts
    them the same."""
    return merged(planning_order(merged(events, most)), most)


def _joined(run: list[Event]) -> Event:
    """One event of a run of alike ones: the first with every hash of the run."""
    if len(run) == 1:
        return run[0]
    return msgspec.structs.replace(run[0], block_hashes=[h for e in run for h in e.block_hashes])


def place(run: tuple[tuple, object]) -> tuple:
    """Where a run (``(signature, events)``) acts: medium, ownership, group, locality,
    as sent. The runs of a stretch share it."""
    return run[0][1:5]


def removals_move(runs: Sequence[Run]) -> bool:
    """Whether planning moves a stretch's removals ahead of its stores: more than two
    runs, no clear, some removal after a store (else they are ahead already), and
    no removal of a hash that an earlier store of the stretch stored."""
    if len(runs) <= 2:
        return False
    classes = [signature[0] for signature, _ in runs]
    if AllBlocksCleared in classes:
        return False
    first_store = next((i for i, c in enumerate(classes) if c is not BlockRemoved), len(classes))
    if BlockRemoved not in classes[first_store:]:
        return False
    return not _removes_stored(runs[first_store:])


def _removes_stored(runs: Sequence[Run]) -> bool:
    """Whether some removal of ``runs`` removes a hash an earlier store of them stored."""
    stored: set = set()
    for signature, events in runs:
        if signature[0] is BlockRemoved:
            if any(not stored.isdisjoint(event.block_hashes) for event in events):
                return True
        else:
            for event in events:
                stored.update(event.block_hashes)
    return False


def _removals_first(runs: list[Run]) -> list[Run]:
    """The runs with every removal ahead of every store, each in order, neighbours alike
    in signature joined."""
    removed = [run for run in runs if run[0][0] is BlockRemoved]
    stored = [run for run in runs if run[0][0] is not BlockRemoved]
    return [
        (signature, [*chain.from_iterable(events for _, events in alike)])
        for signature, alike in groupby(removed + stored, itemgetter(0))
    ]
