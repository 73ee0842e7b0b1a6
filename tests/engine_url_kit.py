"""A stand-in for vLLM's OpenAI server, for the tests of registering an engine
by its URL: a real HTTP server answering its description as vLLM 0.32/0.33
does, with a publisher on the ports it announces, so kvindex is tested against
what it will really be asked to follow."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from indexer.core.events import BlockStored, EventBatch
from indexer.engines import catalog
from indexer.engines.base import Prompt
from producer.publisher import Publisher

from .conftest import free_ports

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BLOCK = 32  # the engine's block size, which only its events say
PROMPT = list(range(100, 100 + 3 * BLOCK))


def sources(pub: int, replay: int, ranks: int = 1, **more: Any) -> dict[str, dict]:
    """``/kv_event_sources`` as vLLM 0.33 answers it: each rank's events config."""
    return {
        str(r): {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{pub + r}",
            "replay_endpoint": f"tcp://*:{replay + r}",
            "buffer_steps": 10000,
            "hwm": 100000,
            "max_queue_size": 100000,
            "topic": "kv-events",
            **more,
        }
        for r in range(ranks)
    }


MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model", "parent": None}]}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up mid-answer: nothing to report


class EngineServer:
    """A real HTTP server answering an engine's description (path -> JSON, or a
    status code), and its ranks' publishers on the announced ports."""

    def __init__(self, answers: dict[str, Any] | None = None, ranks: int = 1) -> None:
        self.pub, self.replay = free_ports(ranks), free_ports(ranks)
        self.answers = answers or {
            "/kv_event_sources": sources(self.pub, self.replay, ranks),
            "/v1/models": MODELS,
        }
        served = self.answers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer = served.get(self.path, 404)
                status = answer if isinstance(answer, int) else 200
                body = json.dumps({"detail": "Not Found"} if status != 200 else answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._handler = Handler
        self.up()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.name = self.url.removeprefix("http://")
        self.publishers: dict[int, Publisher] = {}

    def up(self, port: int = 0) -> None:
        """Serve (again) on ``port`` (0: any free one)."""
        self.http = _Server(("127.0.0.1", port), self._handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def down(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def publish(self, algo: str = "sha256", rank: int = 0) -> None:
        """One batch storing PROMPT's blocks on ``rank``'s GPU, hashed as an engine running
        ``algo``."""
        publisher = self.publishers.get(rank)
        if publisher is None:
            publisher = self.publishers[rank] = Publisher(
                f"tcp://*:{self.pub}",
                f"tcp://*:{self.replay}",
                topic="kv-events",
                data_parallel_rank=rank,
                bind=True,
            )
        hasher = catalog.adapter("vllm").hasher(algo, None, BLOCK)
        stored = BlockStored(
            block_hashes=hasher.published(hasher.digests(Prompt(tuple(PROMPT)))),
            token_ids=PROMPT,
            block_size=BLOCK,
            extra_keys=[None] * 3,
            medium="GPU",
        )
        assert publisher.publish(EventBatch(ts=1.0, events=[stored]))
        assert publisher.flush()

    def close(self) -> None:
        self.down()
        for publisher in self.publishers.values():
            publisher.close()
