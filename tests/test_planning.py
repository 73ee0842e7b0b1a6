"""Planning order (:mod:`indexer.core.planning`): one rule, and every reader takes it.

The compiled scanner states the rule in C; here it must give the batches the
core's rule gives (:func:`~indexer.core.planning.indexed_events`) on stretches
built to reach every branch of it, and the rule must change no count: applying a batch as
planned leaves a rank as applying its events one at a time, in wire order.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.core.events import EventBatch
from indexer.core.residency import RankResidency, plan_batch
from indexer.engines.vllm import wire

from .test_frames import by_core_rule


def _event(kind: str, hashes: list[int], medium: str | None, spec: str | None) -> dict:
    """An event map as vLLM writes it (nil fields left out)."""
    event = {"type": kind}
    if kind != "AllBlocksCleared":
        event["block_hashes"] = hashes
    if medium is not None and kind != "AllBlocksCleared":
        event["medium"] = medium
    if kind == "BlockStored":
        event.update(block_size=16, **({"kv_cache_spec_kind": spec} if spec else {}))
    return event


#: Few hashes, two places, three kinds: long stretches of many runs, some removing a
#: hash stored before them, some with their removals ahead already, a few clears.
_events = st.lists(
    st.builds(
        _event,
        st.sampled_from(["BlockStored"] * 5 + ["BlockRemoved"] * 4 + ["AllBlocksCleared"]),
        st.lists(st.integers(0, 30), min_size=1, max_size=3),
        st.sampled_from([None, "CPU", "CPU", "CPU"]),
        st.sampled_from([None, "full_attention", "mamba"]),
    ),
    max_size=30,
)


def _payload(events: list[dict]) -> bytes:
    return msgspec.msgpack.encode([1.0, events, 0])


def _indexed(decode, payload: bytes) -> bytes:
    return msgspec.msgpack.encode(decode(payload))


@settings(max_examples=400, deadline=None)
@given(_events)
def test_the_scanner_orders_a_batch_as_the_core_rule_does(events: list[dict]) -> None:
    payload = _payload(events)
    assert wire._scan(payload) is not None
    scanned = _indexed(lambda p: wire.decode_batch(p, tokens=False), payload)
    assert scanned == _indexed(by_core_rule, payload)


def _state(batches: list[EventBatch], hold_gpu: bool) -> tuple:
    rank = RankResidency()
    for batch in batches:
        rank.apply(plan_batch(batch, hold_gpu=hold_gpu))
    tables = {tier: (dict(t.counts), t.locality) for tier, t in rank.tables.items()}
    return tables, rank.unknown_removals, rank.group_kinds, rank.chunk_blocks


@settings(max_examples=300, deadline=None)
@given(_events, st.booleans())
def test_planning_order_changes_no_count(events: list[dict], hold_gpu: bool) -> None:
    batch = wire.decode_batch(_payload(events))
    one_at_a_time = [EventBatch(batch.ts, [event]) for event in batch.events]
    assert _state([batch], hold_gpu) == _state(one_at_a_time, hold_gpu)
    indexed = wire.decode_batch(_payload(events), tokens=False)
    assert _state([indexed], hold_gpu) == _state(one_at_a_time, hold_gpu)


def _r(*hashes: int) -> dict:
    return _event("BlockRemoved", list(hashes), "CPU", None)


def _s(*hashes: int, kind: str = "full_attention") -> dict:
    return _event("BlockStored", list(hashes), "CPU", kind)


@pytest.mark.parametrize(
    ("events", "planned"),
    [
        ([_r(1), _s(2), _r(3), _s(4)], ["-1 3", "+2", "+4"]),  # removals move ahead
        ([_r(1), _s(2), _r(2), _s(4)], ["-1", "+2", "-2", "+4"]),  # 2 removed after stored
        ([_s(1), _r(2)], ["+1", "-2"]),  # two runs: nothing gained
        ([_r(1), _s(2), _s(3, kind="mamba")], ["-1", "+2", "+3"]),  # ahead already
        (
            [_event("BlockRemoved", [1], None, None), _event("BlockStored", [2], None, None),
             {"type": "AllBlocksCleared"}, _event("BlockRemoved", [3], None, None)],
            ["-1", "+2", "clear", "-3"],
        ),  # a clear shares the place of events with no fields: nothing moves past it
    ],
)  # fmt: skip
def test_each_branch_of_the_rule(events: list[dict], planned: list[str]) -> None:
    payload = _payload(events)
    for decode in (lambda p: wire.decode_batch(p, tokens=False), by_core_rule):
        assert [_short(e) for e in decode(payload).events] == planned


def _short(event: object) -> str:
    hashes = getattr(event, "block_hashes", ())
    if not hashes:
        return "clear"
    sign = "-" if type(event).__name__ == "BlockRemoved" else "+"
    return sign + " ".join(map(str, hashes))
