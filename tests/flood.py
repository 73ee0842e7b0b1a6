"""A misbehaving engine in a process of its own: ``python -m tests.flood SCENARIO PUB REPLAY``.

Its own process, so that the frames it builds and ZeroMQ's send queues do
not count in the memory of the consumer under test. Scenarios:

- ``oversize``: batches 0-9, one 200 MB frame as seq 10, then (once the
  consumer has reconnected) batches 11-19.
- ``held``: batches 0-4, then 500 batches of 1 MB as seqs 6-505 (5 is
  lost, and the replay endpoint has nothing listening: all are held), built
  before the first is sent, so they come faster than the consumer applies.
- ``flood``: nothing live; every replay request is answered with 1 MB
  batches from the asked seq to 1499, as fast as ZeroMQ takes them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import zmq

from indexer.core.events import BlockStored, EventBatch
from indexer.engines.vllm.wire import encode_batch
from indexer.engines.zmq_framing import REPLAY_END

MB = 1 << 20
#: Token ids of five bytes each (above 65,535): a 1 MB batch of one block.
_BIG_TOKEN = 70_000
FLOOD = 1500
HELD = 500


def batch(seq: int, nbytes: int = 0) -> bytes:
    """Batch ``seq``: one GPU block, hash ``seq + 1``, padded with token ids to ~``nbytes``."""
    event = BlockStored([seq + 1], token_ids=[_BIG_TOKEN] * (nbytes // 5), block_size=16)
    return encode_batch(EventBatch(1000.0 + seq, [event], 0))


def _frame(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def _subscribed(xpub: zmq.Socket) -> None:
    while xpub.recv() != b"\x01":
        pass


def oversize(ctx: zmq.Context, pub: int) -> list[zmq.Socket]:
    xpub = ctx.socket(zmq.XPUB)
    xpub.bind(f"tcp://127.0.0.1:{pub}")
    _subscribed(xpub)
    for seq in range(10):
        xpub.send_multipart(_frame(seq, batch(seq)))
    xpub.send_multipart(_frame(10, b"\x93\xcb" + bytes(8) + bytes(200 * MB)))
    # ZeroMQ drops the consumer on the frame's header and it comes back by itself:
    # say the rest until it must have heard (what it hears twice is a duplicate).
    for _ in range(100):
        for seq in range(11, 20):
            xpub.send_multipart(_frame(seq, batch(seq)))
        time.sleep(0.1)
    return [xpub]


def held(ctx: zmq.Context, pub: int) -> list[zmq.Socket]:
    xpub = ctx.socket(zmq.XPUB)
    xpub.setsockopt(zmq.SNDHWM, 0)
    xpub.bind(f"tcp://127.0.0.1:{pub}")
    frames = [_frame(seq, batch(seq, MB if seq > 5 else 0)) for seq in range(6 + HELD)]
    del frames[5]
    _subscribed(xpub)
    for frame in frames:
        xpub.send_multipart(frame)
    return [xpub]


def flood(ctx: zmq.Context, pub: int, replay: int) -> None:
    live = ctx.socket(zmq.PUB)  # the consumer asks replay only of an engine it is connected to
    live.bind(f"tcp://127.0.0.1:{pub}")
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay}")
    payloads = [batch(seq, MB) for seq in range(FLOOD)]
    while True:
        peer, _, start = router.recv_multipart()
        for seq in range(int.from_bytes(start, "big"), FLOOD):
            router.send_multipart([peer, *_frame(seq, payloads[seq])])
        router.send_multipart([peer, b"", REPLAY_END, b""])


def _exit_with_the_test() -> None:
    """End this process when the test closes its stdin, or dies."""
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()


def main(scenario: str, pub: int, replay: int) -> None:
    _exit_with_the_test()
    ctx = zmq.Context()
    if scenario == "flood":
        flood(ctx, pub, replay)
    _open = {"oversize": oversize, "held": held}[scenario](ctx, pub)  # referenced: not closed
    threading.Event().wait()  # until the end: closing would drop what is still queued


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
