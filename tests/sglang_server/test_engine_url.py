"""An SGLang engine registered by its server's URL alone: kvindex reads the whole server's
``/server_info`` (its ``kv_events``: publisher, endpoint host and port base, replay port
base, topic, page size, DP size) and ``/v1/models``, and is then exact on SGLang's own
stream, for the pages SGLang cached before the engine was registered (replayed) as for
those after."""

from __future__ import annotations

import httpx

from tests.sglang_server.conftest import BY_ENDPOINTS
from tests.sglang_server.kit import MODEL, PAGE, chat_exact, engine_by_url, text

BY_URL = "sgl-by-url"
#: The keys of ``/server_info``'s ``kv_events`` that indexer/engines/sglang/server.py reads.
READ = (
    "publisher",
    "endpoint_host",
    "endpoint_port_base",
    "replay_endpoint_port_base",
    "topic",
    "block_size",
    "dp_size",
)


def conversation(seed: int) -> list[dict]:
    return [
        {"role": "system", "content": "you are a tiny model"},
        {"role": "user", "content": text(60, seed)},
    ]


def test_the_server_describes_its_publisher(sglang) -> None:
    """What SGLang states of its events in ``/server_info``, the keys kvindex reads."""
    stated = httpx.get(f"{sglang.url}/server_info", timeout=30).raise_for_status().json()
    kv_events = stated["kv_events"]
    assert {key: kv_events.get(key) for key in READ} == {
        "publisher": "zmq",
        "endpoint_host": "*",  # its bind address: kvindex dials the URL's host
        "endpoint_port_base": sglang.events,
        "replay_endpoint_port_base": sglang.replay,
        "topic": "kv",
        "block_size": PAGE,
        "dp_size": 1,
    }, kv_events


def test_an_engine_registered_by_its_url_is_exact(sglang, kv) -> None:
    earlier = conversation(501)
    chat_exact(sglang, kv, [BY_ENDPOINTS], earlier)  # served before kvindex knows BY_URL
    with engine_by_url(kv, sglang, BY_URL) as engine:
        # SGLang said where its events are, their topic, its page size and what it serves
        assert engine["endpoint"] == f"tcp://127.0.0.1:{sglang.events}", engine
        assert engine["replay_endpoint"] == f"tcp://127.0.0.1:{sglang.replay}", engine
        described = (engine["topic"], engine["block_size"], engine["dp_ranks"], engine["model"])
        assert described == ("kv", PAGE, 1, MODEL), engine
        assert (engine["adapter"], engine["url"]) == ("sglang", sglang.url), engine

        both = [BY_ENDPOINTS, BY_URL]
        again = chat_exact(sglang, kv, both, earlier)  # BY_URL holds it by replay
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * PAGE, again
        (rank,) = kv.engine(BY_URL)["ranks"]
        assert rank["replays"] >= 1 and not rank["degraded"], rank

        later = conversation(502)
        chat_exact(sglang, kv, both, later)
        again = chat_exact(sglang, kv, both, later)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * PAGE, again
