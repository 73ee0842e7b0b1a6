"""Every panel of the Grafana dashboard answers, from a real Prometheus scraping kvindex.

``kvindex serve`` follows two simulated engines (``kvindex sim``) and answers
prefix-match queries while Debian's ``prometheus`` (installed by ``make
setup``: scripts/ensure-prometheus.sh) scrapes its ``/metrics`` every 0.5 s.
Then each query of deploy/grafana/dashboards/kvindex.json is evaluated
through Prometheus's HTTP API, as Grafana would send it: each must return at
least one series with a number. A misspelt metric or label, a counter
without ``_total``, or a metric kvindex stopped exporting fails here.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import free_ports
from .servers import free_port

pytestmark = pytest.mark.slow  # three processes, and Prometheus needs a few scrapes

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvindex.json"
PROMETHEUS = shutil.which("prometheus")
KVINDEX = (sys.executable, "-m", "kvindex.cli")
ENGINES = 2
SCRAPE = 0.5  # seconds


def panel_queries() -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every query of every panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p["targets"]]


def wait_for(ready, what: str, timeout: float = 30.0, procs=()) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        for proc in procs:
            assert proc.poll() is None, f"{what}: a process exited ({proc.args[:4]})"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """kvindex serve with simulated engines, and Prometheus scraping it: their URLs."""
    if PROMETHEUS is None:
        pytest.fail("prometheus not installed: run make setup (scripts/ensure-prometheus.sh)")
    work = tmp_path_factory.mktemp("prometheus")
    base, http, prom = free_ports(2 * ENGINES), free_port(), free_port()
    engines = "".join(
        f"  - {{name: sim-{k}, model: sim, blocks_per_chunk: 4,"
        f" endpoint: 'tcp://127.0.0.1:{base + 2 * k}',"
        f" replay_endpoint: 'tcp://127.0.0.1:{base + 2 * k + 1}'}}\n"
        for k in range(ENGINES)
    )
    config = work / "kvindex.yaml"
    config.write_text(f"engines:\n{engines}metrics:\n  sample_interval: {SCRAPE}\n")
    (work / "prometheus.yml").write_text(
        f"global: {{scrape_interval: {SCRAPE * 1000:.0f}ms, evaluation_interval: 1s}}\n"
        "scrape_configs:\n"
        f"  - {{job_name: kvindex, static_configs: [{{targets: ['127.0.0.1:{http}']}}]}}\n"
    )
    logs = [open(work / f"{name}.log", "w") for name in ("serve", "sim", "prometheus")]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [*KVINDEX, "serve", "--config", str(config), "--port", str(http)],
            stdout=logs[0], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [*KVINDEX, "sim", "--engines", str(ENGINES), "--base-port", str(base),
             "--rate", "20"],
            stdout=logs[1], stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [PROMETHEUS, f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{prom}"],
            stdout=logs[2], stderr=subprocess.STDOUT,
        ),
    ]  # fmt: skip
    api, prometheus = f"http://127.0.0.1:{http}", f"http://127.0.0.1:{prom}"
    try:
        wait_for(lambda: answers(f"{api}/readyz"), "kvindex serve", procs=procs)
        wait_for(lambda: answers(f"{prometheus}/-/ready"), "prometheus", procs=procs)
        yield api, prometheus
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()


def query(prometheus: str, expr: str) -> list[dict]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=5).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def numbers(result: list[dict]) -> list[float]:
    return [v for v in (float(r["value"][1]) for r in result) if math.isfinite(v)]


def test_every_dashboard_panel_returns_data(stack: tuple[str, str]) -> None:
    api, prometheus = stack
    # Whether it hits or not, each query is observed (a miss in the 0 bucket).
    tokens = ",".join(str(t) for t in range(1, 200))
    pending = dict(panel_queries())
    deadline = time.monotonic() + 40
    while pending and time.monotonic() < deadline:
        for _ in range(5):
            assert httpx.get(f"{api}/prefix-match", params={"tokens": tokens}).status_code == 200
        time.sleep(SCRAPE)
        pending = {t: e for t, e in pending.items() if not numbers(query(prometheus, e))}
    assert not pending, f"panels without data: {pending}"
    resident = query(prometheus, "sum by (tier) (kvindex_engine_resident_blocks)")
    assert {r["metric"]["tier"] for r in resident} == {"GPU", "CPU", "STORAGE"}
    assert float(query(prometheus, "sum(kvindex_engine_connected_ranks)")[0]["value"][1]) == ENGINES
    assert not query(prometheus, '{__name__=~".+_created"}')  # no _created series
