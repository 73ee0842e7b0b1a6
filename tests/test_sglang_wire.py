"""SGLang's wire where its golden traces do not reach: media, bad payloads, restarts."""

from __future__ import annotations

import msgspec
import pytest

from indexer.core.events import CPU, GPU, STORAGE, WireError
from indexer.engines import catalog
from indexer.engines.sglang.wire import signed, unsigned

SGLANG = catalog.adapter("sglang")


def payload(*events: dict, rank: int | None = 0) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events), rank])


def stored(hashes: list[int], tokens: list, **more: object) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens, "block_size": 2, "lora_id": None, **more}  # fmt: skip


@pytest.mark.parametrize(
    ("medium", "tier"),
    [("GPU", GPU), ("CPU_PINNED", CPU), ("DISK", STORAGE), ("EXTERNAL", STORAGE), (None, None)],
)
def test_sglangs_media_are_kvindexs_tiers(medium: str | None, tier: str | None) -> None:
    more = {} if medium is None else {"medium": medium}
    batch = SGLANG.decode(
        payload(
            stored([-1], [1, 2], **more), {"type": "BlockRemoved", "block_hashes": [-1], **more}
        )
    )
    assert [e.medium for e in batch.events] == [tier, tier]
    assert batch.events[0].block_hashes == [(1 << 64) - 1] == batch.events[1].block_hashes


def test_what_is_not_sglangs_wire_is_a_wire_error() -> None:
    bad = [
        payload(stored([1], [1, 2], medium="NVME")),
        payload(stored([1 << 63], [1, 2])),  # past int64
        payload(stored([1], [1, [2, 3]])),  # tokens and bigrams mixed
        payload(stored([1], [[1, 2]])),  # bigram pages that are not whole
        b"\x93\x01",
    ]
    for raw in bad:
        with pytest.raises(WireError):
            SGLANG.decode(raw)


def test_namespaces_are_stated_per_page_and_survive_encoding() -> None:
    raw = payload(stored([5, -6], [1, 2, 3, 4], cache_salt="s", session_id="x", lora_name="a"))
    event = SGLANG.decode(raw).events[0]
    assert event.extra_keys == [["a", "s"], ["a", "s"]] and event.lora_name == "a"
    assert SGLANG.encode(SGLANG.decode(raw)) == raw
    assert all(signed(unsigned(h)) == h for h in (0, -1, 1 << 62, -(1 << 63)))


def test_a_restart_and_a_reset_are_vllms_seq_and_clear() -> None:
    cleared = SGLANG.decode(payload({"type": "AllBlocksCleared"}, rank=3))
    assert type(cleared.events[0]).__name__ == "AllBlocksCleared"
    assert cleared.data_parallel_rank == 3
    assert SGLANG.split_live([b"kv", (0).to_bytes(8, "big"), b"p"]) == (0, b"p")
    end = [b"", b"", b"\xff" * 8, b""]  # SGLang's end of a replay answer
    assert SGLANG.split_replay(end) == (None, b"")
    assert SGLANG.split_replay([b"", b"kv", (7).to_bytes(8, "big"), b"p"]) == (7, b"p")
    assert SGLANG.rank_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
