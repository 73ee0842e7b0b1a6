"""Item 16's kvindex proxy: the thin router the bench puts in front of the fleet for
kvindex's policies. For each chat completion it asks kvindex ``POST /prefix-match`` with
``route: "best"`` (which records the pick) and streams the request to the engine named;
run as ``python -m bench.routing.proxy_server`` so it is out of the client's process, as a
router is.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.routing.fleet import ROOT, Fleet, Kvindex, Server


class Proxy(Server):
    """:func:`proxy_app` in a process of its own (``python -m bench.routing.proxy_server``),
    asking ``kvindex``: out of the client's process, as a router is."""

    def __init__(self, workdir: Path, name: str, kvindex: Kvindex, fleet: Fleet) -> None:
        super().__init__(workdir, name)
        command = [sys.executable, "-m", "bench.routing.proxy_server", "--port", str(self.port)]
        command += ["--kvindex", kvindex.url, "--token-file", str(kvindex.token_file)]
        command += [f"--engine={e.name}={e.url}" for e in fleet.engines]
        self.command = command
        self.env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=10).json()


def proxy_app(kvindex: str, token: str, engines: dict[str, str]) -> Starlette:
    """For each chat completion: ask kvindex for the best engine (``route: "best"``, which
    records the pick), then stream the request to it. Round robin when kvindex names none
    or fails, counted in ``/stats`` with the picks, so a fallback never hides."""
    client = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64))
    auth = {"Authorization": f"Bearer {token}"}
    names = itertools.cycle(engines)
    stats = {"picks": dict.fromkeys(engines, 0), "fallbacks": 0, "errors": []}
    asks: list[float] = []  # seconds each question to kvindex took

    async def pick(messages: list) -> str:
        ask = {"model": "tiny", "messages": messages, "route": "best"}
        started = time.perf_counter()
        try:
            answer = await client.post(f"{kvindex}/prefix-match", json=ask, headers=auth)
            asks.append(time.perf_counter() - started)
            answer.raise_for_status()
            routed = answer.json().get("routed_to")
            if routed and routed["engine"] in engines:
                return routed["engine"]
        except (httpx.HTTPError, ValueError) as e:
            stats["errors"] = [*stats["errors"][-9:], repr(e)]
        stats["fallbacks"] += 1
        return next(names)

    async def chat(request: Request) -> StreamingResponse:
        body = await request.body()
        name = await pick(json.loads(body)["messages"])
        stats["picks"][name] += 1
        headers = {"content-type": "application/json"}
        upstream = client.build_request(
            "POST", f"{engines[name]}/v1/chat/completions", content=body, headers=headers
        )
        response = await client.send(upstream, stream=True)
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            media_type=response.headers.get("content-type"),
            background=BackgroundTask(response.aclose),
        )

    async def health(_: Request) -> JSONResponse:
        return JSONResponse({})

    async def report(_: Request) -> JSONResponse:
        ordered = sorted(asks)
        at = [ordered[int(q * len(ordered))] * 1000 if asks else None for q in (0.5, 0.99)]
        return JSONResponse(stats | {"ask_p50_ms": at[0], "ask_p99_ms": at[1]})

    routes = [
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/health", health),
        Route("/stats", report),
    ]
    return Starlette(routes=routes)


def main(argv: list[str] | None = None) -> None:
    """The proxy's process: ``python -m bench.routing.proxy_server --port P --kvindex URL
    --token-file F --engine NAME=URL ...``."""
    parser = argparse.ArgumentParser(prog="python -m bench.routing.proxy_server")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kvindex", required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--engine", action="append", required=True, help="NAME=URL")
    args = parser.parse_args(argv)
    engines = dict(e.split("=", 1) for e in args.engine)
    app = proxy_app(args.kvindex, args.token_file.read_text().strip(), engines)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
