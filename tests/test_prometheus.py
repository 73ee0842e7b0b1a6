"""Every panel of the Grafana dashboard answers, from a real Prometheus scraping kvindex.

``kvindex serve`` follows two simulated engines (``kvindex sim``) and answers
prefix-match queries while Debian's ``prometheus`` (installed by ``make
setup``: scripts/ensure-prometheus.sh) scrapes its ``/metrics`` every 0.5 s.
Then each query of deploy/grafana/dashboards/kvindex.json is evaluated
through Prometheus's HTTP API, as Grafana would send it: each must return at
least one series with a number. A misspelt metric or label, a counter
without ``_total``, or a metric kvindex stopped exporting fails here.

Grafana itself is not installable here (no Debian package), so the test draws
each panel's ``query_range`` answer with matplotlib into
tests/output/dashboard.png, titled as what it is (docs/dashboard.png is a
copy): the panels' data, not a Grafana screenshot.
"""

from __future__ import annotations

import json
import math
import re
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
OUTPUT = ROOT / "tests" / "output"
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
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path]]:
    """kvindex serve with simulated engines, and Prometheus scraping it: their URLs,
    and the file where the engines write prompts they served."""
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
             "--rate", "20", "--samples", str(work / "samples.json")],
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
        yield api, prometheus, work / "samples.json"
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


def prompts(samples: Path) -> list[list[int]]:
    """Prompts the engines served (they hit), else one that misses: both are observed."""
    try:
        served = json.loads(samples.read_text())
    except (OSError, ValueError):
        served = {}
    found = [p for rank in served.values() for p in rank[-3:]]
    return found or [list(range(1, 200))]


def test_every_dashboard_panel_returns_data(stack: tuple[str, str, Path]) -> None:
    api, prometheus, samples = stack
    started = time.time()
    pending = dict(panel_queries())
    deadline = time.monotonic() + 40
    # Until every panel has data, and long enough for the drawing to show a trend.
    while (pending or time.time() < started + 8) and time.monotonic() < deadline:
        for tokens in prompts(samples)[:6]:
            answer = httpx.post(f"{api}/prefix-match", json={"tokens": tokens})
            assert answer.status_code == 200, answer.text
        time.sleep(SCRAPE)
        pending = {t: e for t, e in pending.items() if not numbers(query(prometheus, e))}
    assert not pending, f"panels without data: {pending}"
    draw(prometheus, started, time.time(), OUTPUT / "dashboard.png")
    resident = query(prometheus, "sum by (tier) (kvindex_engine_resident_blocks)")
    assert {r["metric"]["tier"] for r in resident} == {"GPU", "CPU", "STORAGE"}
    assert all(float(r["value"][1]) > 0 for r in resident if r["metric"]["tier"] != "STORAGE")
    assert float(query(prometheus, "sum(kvindex_engine_connected_ranks)")[0]["value"][1]) == ENGINES
    assert not query(prometheus, '{__name__=~".+_created"}')  # no _created series


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), template)


def draw(prometheus: str, start: float, end: float, path: Path) -> None:
    """Each panel's queries over the test's run, one small chart per panel."""
    import matplotlib  # imported here: only this test draws

    matplotlib.use("Agg")
    from matplotlib import pyplot

    panels = json.loads(DASHBOARD.read_text())["panels"]
    columns = 4
    figure, axes = pyplot.subplots(
        math.ceil(len(panels) / columns), columns, figsize=(22, 2.9 * len(panels) / columns)
    )
    for ax, panel in zip(axes.flat, panels, strict=False):
        for target in panel["targets"]:
            params = {"query": target["expr"], "start": start, "end": end, "step": SCRAPE}
            answer = httpx.get(f"{prometheus}/api/v1/query_range", params=params, timeout=5)
            for line in answer.json()["data"]["result"][:8]:
                times = [float(t) - start for t, _ in line["values"]]
                values = [float(v) for _, v in line["values"]]
                ax.plot(times, values, label=_legend(target["legendFormat"], line["metric"]))
        ax.set_title(panel["title"], fontsize=9)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle(
        "kvindex dashboard panels (deploy/grafana/dashboards/kvindex.json): each panel's"
        " PromQL over a real Prometheus scraping kvindex serve with 2 simulated engines,"
        " drawn by tests/test_prometheus.py with matplotlib (not a Grafana screenshot);"
        " x: seconds",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(exist_ok=True)
    figure.savefig(path, dpi=72)
    pyplot.close(figure)
