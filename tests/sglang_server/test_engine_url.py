"""An SGLang engine registered by its server's URL alone: kvindex reads the whole server's
``/server_info`` (its ``kv_events``: publisher, endpoint host and port base, replay port
base, topic, page size, DP size) and ``/v1/models``, and is then exact on SGLang's own
stream, for the pages SGLang cached before the engine was registered (replayed) as for
those after."""

from __future__ import annotations

from tests.sglang_server.conftest import BY_ENDPOINTS
from tests.sglang_server.kit import MODEL, PAGE, chat_exact, engine_by_url, text

BY_URL = "sgl-by-url"


def conversation(seed: int) -> list[dict]:
    return [
        {"role": "system", "content": "you are a tiny model"},
        {"role": "user", "content": text(60, seed)},
    ]


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
