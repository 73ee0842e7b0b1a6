"""The seq-numbered ZMQ framing vLLM's publisher uses, for adapters whose engine speaks it.

Live: a PUB multipart ``[topic, seq, payload]``, ``seq`` 8 bytes big-endian,
+1 per batch. Replay: the engine binds a ROUTER; a DEALER sends ``[b"",
start]`` and receives ``[b"", seq, payload]`` for every buffered batch from
``start`` on (some versions put the topic before the seq), then ``[b"", -1,
b""]``. Data-parallel rank r listens on port + r, or ``inproc`` name +
``_dp{r}``. An adapter inherits :class:`ZmqFraming` and adds its payload codec
and hashing; an engine with other framing overrides what differs.
"""

from __future__ import annotations

from indexer.core.events import WireError
from indexer.engines.base import ReplaySeq

SEQ_BYTES = 8
#: The seq frame that ends a replay answer: -1 as 8 signed big-endian bytes.
REPLAY_END = b"\xff" * SEQ_BYTES


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def _seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise WireError("bad_seq", f"{len(frame)} bytes")
    return int.from_bytes(frame, "big")


def decode_frames(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """Split a multipart ``[topic, seq, payload]`` message; seq is 8-byte big-endian."""
    if len(frames) != 3:
        raise WireError("frame_count", str(len(frames)))
    topic, seq, payload = frames
    return topic, _seq(seq), payload


def split_replay(frames: list[bytes]) -> tuple[ReplaySeq, bytes]:
    """Seq (None for the end marker) and payload of one replay answer.

    The DEALER side receives ``[b"", seq, payload]``; some versions add the
    topic, ``[b"", topic, seq, payload]``. Both are accepted.
    """
    if len(frames) in (3, 4) and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 3:
        frames = frames[1:]
    if len(frames) != 2:
        raise WireError("replay_frame_count", str(len(frames)))
    seq, payload = frames
    return (None if seq == REPLAY_END else _seq(seq)), payload


def offset_endpoint(endpoint: str | None, dp_rank: int) -> str | None:
    """A rank's endpoint: tcp port + rank, or an ``_dp{rank}`` inproc suffix."""
    if not endpoint or dp_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{dp_rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + dp_rank}"
    if "tcp" in endpoint:
        return endpoint
    raise ValueError(f"invalid endpoint {endpoint!r}: must be tcp or inproc")


class ZmqFraming:
    """The framing half of an :class:`~indexer.engines.base.EngineAdapter`."""

    def split_live(self, frames: list[bytes]) -> tuple[int, bytes]:
        _, seq, payload = decode_frames(frames)
        return seq, payload

    def live_frames(self, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
        return [topic, seq_frame(seq), payload]

    def replay_request(self, start: int) -> list[bytes]:
        return [b"", seq_frame(start)]

    def replay_start(self, frames: list[bytes]) -> int:
        if len(frames) != 2:
            raise WireError("replay_request_frame_count", str(len(frames)))
        return int.from_bytes(frames[1], "big")

    def replay_answer(self, seq: ReplaySeq, payload: bytes) -> list[bytes]:
        return [b"", REPLAY_END, b""] if seq is None else [b"", seq_frame(seq), payload]

    def split_replay(self, frames: list[bytes]) -> tuple[ReplaySeq, bytes]:
        return split_replay(frames)

    def rank_endpoint(self, endpoint: str | None, dp_rank: int) -> str | None:
        return offset_endpoint(endpoint, dp_rank)
