"""The operator page in a real headless browser, over a real ``kvindex serve``.

The fleet: engine ``a`` replays the chat-sha256 trace with two batches lost
on the live socket (replays fill the gaps), ``b`` the chat-gpu-only trace
with a batch missing for good (an unfilled gap: degraded), ``ghost`` has no
publisher at all, ``c`` (model llama3ish, with its tokenizer) holds blocks
of two of vLLM's tokenizer cases (a completions prompt and a chat), and
``kvindex sim`` runs two engines of two data-parallel ranks each with GPU,
CPU and STORAGE tiers, streaming while the page is open. Everything the
page shows of the engines fed from vLLM's recordings is checked against the
numbers those imply and against what the JSON API answers.

One browser session serves every test (Debian's chromium, driven through
Selenium and the chromedriver of the same release); it resolves no host but
127.0.0.1, so a page that needed the internet would fail here. Waits are
explicit conditions, never sleeps. The last screenshot is written to
tests/output/ui.png (docs/ui.png is a copy of it).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from indexer.core.events import GPU, BlockStored, EventBatch
from producer.publisher import Publisher
from producer.sim import SimConfig
from producer.simcli import Layout, engine_spec

from .conftest import EXIT_WITHIN, FIXTURES, free_ports, load_expected_json, trace_batches
from .test_serve import KVINDEX, Serve, blocks_of, publish

pytestmark = pytest.mark.slow  # a serve, a sim and a browser

OUTPUT = Path(__file__).parent / "output"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
TOKEN = "s3cret"  # mutating endpoints need it; the page must not
TIERS = ("GPU", "CPU", "STORAGE")
WAIT_S = 30  # generous: a loaded 2-core machine runs serve, sim and chromium at once
SIM_ARGS = ("--engines", "2", "--dp-ranks", "2", "--gpu-blocks", "128", "--cpu-chunks", "64")
SIM_ARGS += ("--storage-chunks", "128", "--max-context", "1024", "--rate", "4")

CONFIG = """
engines:
  - name: a
    endpoint: tcp://127.0.0.1:{a_pub}
    replay_endpoint: tcp://127.0.0.1:{a_replay}
    blocks_per_chunk: 4
  - name: b
    endpoint: tcp://127.0.0.1:{b_pub}
    replay_endpoint: tcp://127.0.0.1:{b_replay}
  - name: ghost
    endpoint: tcp://127.0.0.1:{ghost}
  - name: c
    model: llama3ish
    endpoint: tcp://127.0.0.1:{c_pub}
    replay_endpoint: tcp://127.0.0.1:{c_replay}
models:
  llama3ish:
    tokenizer: {tokenizer}
subscriber:
  replay_timeout: 0.5
  probe_interval: 0.2
api:
  auth_token: {token}
"""

TOKENIZE = FIXTURES / "tokenize"
TOKENIZER = TOKENIZE / "llama3ish"
_CASES = json.loads((TOKENIZE / "cases.json").read_text())["cases"]
_LLAMA = {c["name"]: c for c in _CASES if c["tokenizer"] == "llama3ish"}
#: Prompts engine c holds (of vLLM's tokenizer cases) and how many of their blocks.
PROMPT_CASES = ((_LLAMA["cmpl_long_prose"], 200), (_LLAMA["chat_multi_turn"], 5))

#: Each rank row of the fleet table, keyed "engine/rank" (read in one script: atomic).
FLEET_JS = """
const rows = {};
for (const tr of document.querySelectorAll('#fleet-table tbody tr')) {
  const cell = (q) => tr.querySelector(q).textContent;
  rows[`${tr.dataset.engine}/${tr.dataset.rank}`] = {
    state: tr.querySelector('[data-state]').dataset.state, reason: cell('[data-state]'),
    GPU: cell('[data-tier=GPU]'), CPU: cell('[data-tier=CPU]'),
    STORAGE: cell('[data-tier=STORAGE]'), seq: tr.cells[7].textContent,
    rate: tr.cells[9].textContent};
}
return rows;
"""


def number(text: str) -> int:
    return int(text.replace(",", ""))


class Fleet:
    """``kvindex serve`` with traced engines, a ghost and a running ``kvindex sim``.

    Everything it starts is stopped by ``stack``, also when starting fails halfway.
    """

    def __init__(self, tmp: Path, stack: ExitStack) -> None:
        names = ("a_pub", "a_replay", "b_pub", "b_replay", "ghost", "c_pub", "c_replay")
        ports = {k: free_ports() for k in names}
        self.a_endpoint = f"tcp://127.0.0.1:{ports['a_pub']}"
        config = tmp / "kvindex.yaml"
        config.write_text(CONFIG.format(token=TOKEN, tokenizer=TOKENIZER, **ports))
        a = stack.enter_context(publisher(ports["a_pub"], ports["a_replay"], drop_live={100, 180}))
        b = stack.enter_context(publisher(ports["b_pub"], ports["b_replay"], holes={120}))
        c = stack.enter_context(publisher(ports["c_pub"], ports["c_replay"]))
        self.serve = Serve(tmp / "serve.log", "--config", str(config))
        stack.callback(self.serve.stop)
        self.url = f"http://127.0.0.1:{self.serve.port}"
        sim_base = free_ports(8)  # 2 engines x 2 ranks x (PUB, replay)
        sim_log = tmp / "sim.log"
        with sim_log.open("w") as log:
            sim = (*KVINDEX, "sim", *SIM_ARGS, "--base-port", str(sim_base))
            self.sim = subprocess.Popen(sim, stdout=log, stderr=subprocess.STDOUT)
        stack.callback(self._stop_sim)
        # It prints each rank's endpoints once it has bound them.
        self.serve.until(lambda: sim_log.read_text().count("PUB") == 4, "the sim's ranks")
        layout = Layout(engines=2, base_port=sim_base, dp_ranks=2)
        for k in range(layout.engines):  # what `kvindex sim --print-specs` prints
            body = engine_spec(layout, k, SimConfig(), "sim")
            answer = self.serve.http.post(
                "/engines", json=body, headers={"authorization": f"Bearer {TOKEN}"}
            )
            assert answer.status_code == 201, answer.text
        for engine in ("a", "b", "c"):  # else a late SUB misses the drops: no gap to show
            self.serve.until(lambda e=engine: self.rank(e).get("connected"), f"{engine} connected")
        publish(a, trace_batches("chat-sha256"))
        publish(b, trace_batches("chat-gpu-only"))
        publish(c, [EventBatch(time.time(), [held(case, n) for case, n in PROMPT_CASES])])
        for engine, last in (("a", 249), ("b", 199), ("c", 0)):
            self.serve.until(
                lambda e=engine, s=last: self.rank(e).get("applied_seq") == s, f"{engine} caught up"
            )

    def _stop_sim(self) -> None:
        self.sim.send_signal(signal.SIGTERM)
        self.sim.wait(timeout=EXIT_WITHIN)

    def rank(self, engine: str, dp_rank: int = 0) -> dict:
        return self.serve.rank(engine, dp_rank)

    def api(self, path: str, **kw: Any) -> Any:
        """What the JSON API answers, read without the token as the page does."""
        answer = httpx.request(kw.pop("method", "GET"), self.url + path, timeout=10, **kw)
        assert answer.status_code == 200, answer.text
        return answer.json()


def held(case: dict, blocks: int) -> BlockStored:
    """The first ``blocks`` blocks of a tokenizer case's prompt, stored on GPU."""
    return BlockStored(
        block_hashes=case["block_hashes_u64"][:blocks],
        token_ids=case["token_ids"][: blocks * 16],
        block_size=16,
        medium=GPU,
    )


def publisher(pub: int, replay: int, **faults: set[int]) -> Publisher:
    return Publisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", bind=True, **faults)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with ExitStack() as stack:
        yield Fleet(tmp_path_factory.mktemp("ui"), stack)


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("chromium and chromedriver are needed: run scripts/ensure-browser.sh")
    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # tests run as root in CI
        "--disable-dev-shm-usage",
        "--window-size=1500,1000",
        # No network but this machine: a CDN URL left in a page fails to load.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait(browser: webdriver.Chrome, condition, what: str) -> Any:
    try:
        return WebDriverWait(browser, WAIT_S, poll_frequency=0.1).until(lambda d: condition(d))
    except TimeoutException:
        shown = browser.execute_script("return document.body && document.body.innerText")
        raise AssertionError(
            f"timed out waiting for {what}; console: {page_errors(browser)}; page: {shown}"
        ) from None


def fleet_rows(browser: webdriver.Chrome) -> dict[str, dict[str, str]]:
    return browser.execute_script(FLEET_JS)


def asked_elsewhere(browser: webdriver.Chrome, url: str) -> list[str]:
    """The resources the page loaded from anywhere but kvindex (should be none)."""
    loaded = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    return [u for u in loaded if not u.startswith(url)]


def page_errors(browser: webdriver.Chrome) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def test_fleet_table_shows_every_rank_and_why_it_is_degraded(fleet: Fleet, browser) -> None:
    browser.get(fleet.url + "/")  # redirects to /ui/
    sims = [f"sim-{e}/{r}" for e in (0, 1) for r in (0, 1)]
    wanted = ["a/0", "b/0", "ghost/0", "c/0", *sims]

    def loaded(d) -> dict | None:
        rows = fleet_rows(d)
        return rows if all(k in rows for k in wanted) and rows["a/0"]["seq"] == "249" else None

    rows = wait(browser, loaded, "the fleet table")
    assert browser.current_url == fleet.url + "/ui/"
    a = rows["a/0"]
    assert a["state"] == "ok"
    assert {t: number(a[t]) for t in TIERS} == blocks_of("chat-sha256")
    assert {t: number(a[t]) for t in TIERS} == fleet.rank("a")["blocks"]
    assert rows["b/0"]["state"] == "degraded"
    assert "unfilled gaps: batches 120..120" in rows["b/0"]["reason"]
    assert number(rows["b/0"]["GPU"]) == fleet.rank("b")["blocks"]["GPU"]  # batch 120 never came
    assert rows["ghost/0"]["state"] == "degraded" and "connected" in rows["ghost/0"]["reason"]
    summary = browser.find_element(By.ID, "summary").text
    assert "8 ranks" in summary and "2 degraded" in summary
    wait(browser, lambda d: all(number(fleet_rows(d)[k]["GPU"]) > 0 for k in sims), "sim blocks")
    assert asked_elsewhere(browser, fleet.url) == []
    assert page_errors(browser) == []


def test_the_page_updates_without_reload(fleet: Fleet, browser) -> None:
    first = number(fleet_rows(browser)["sim-0/0"]["seq"])
    wait(browser, lambda d: number(fleet_rows(d)["sim-0/0"]["seq"]) > first, "a newer applied seq")
    wait(browser, lambda d: float(fleet_rows(d)["sim-0/0"]["rate"]) > 0, "a batch rate")


def test_engine_detail_shows_gaps_and_replays(fleet: Fleet, browser) -> None:
    browser.find_element(By.CSS_SELECTOR, '#fleet-table tr[data-engine="a"] a.engine').click()
    spec = '#engine-spec [data-field="endpoint"]'
    wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, spec).text == fleet.a_endpoint, "a")
    assert browser.find_element(By.ID, "engine-select").get_attribute("value") == "a"
    row = browser.find_element(By.CSS_SELECTOR, '#engine-ranks tr[data-rank="0"]')
    api = fleet.rank("a")
    assert api["gaps"] == api["gaps_filled"] >= 1 and api["replays"] >= 1  # the dropped batches
    cell = row.find_element(By.CSS_SELECTOR, '[data-field="gaps"]').text
    assert cell == f"{api['gaps']} ({api['gaps_filled']} filled)"
    assert (
        number(row.find_element(By.CSS_SELECTOR, '[data-field="replays"]').text) == api["replays"]
    )
    assert row.find_element(By.CSS_SELECTOR, "[data-state]").get_attribute("data-state") == "ok"


def probe(browser: webdriver.Chrome, by: str, prompt: str, model: str = "") -> None:
    """Fill the probe form as pasting would (typing 5,000 keys takes seconds) and submit."""
    option = f'#probe-form option[value="{by}"]'
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, option), f"the {by} option")
    form = browser.find_element(By.ID, "probe-form")
    Select(form.find_element(By.NAME, "by")).select_by_value(by)
    browser.execute_script(
        "arguments[0].prompt.value = arguments[1]; arguments[0].model.value = arguments[2];"
        " document.querySelector('#probe-result').replaceChildren()",  # wait for the new one
        form,
        prompt,
        model,
    )
    form.find_element(By.CSS_SELECTOR, "button").click()


def probe_row(browser: webdriver.Chrome, engine: str) -> dict[str, str]:
    """The probe answer's bars for ``engine``'s rank 0, by tier (and its prefix line)."""
    row = f'#probe-result .probe-row[data-engine="{engine}"][data-rank="0"]'
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, row), f"the probe answer for {engine}")
    texts = {
        t: browser.find_element(By.CSS_SELECTOR, f'{row} [data-tier="{t}"]').text for t in TIERS
    }
    texts["prefix"] = browser.find_element(By.CSS_SELECTOR, f'{row} [data-field="prefix"]').text
    return texts


def test_text_and_chat_prompts_are_tokenized_by_the_server(fleet: Fleet, browser) -> None:
    for case, blocks in PROMPT_CASES:
        if case["kind"] == "completion":
            probe(browser, "prompt", case["request"]["prompt"], "llama3ish")
        else:
            probe(browser, "messages", json.dumps(case["request"]["messages"]), "llama3ish")
        bars = probe_row(browser, "c")
        assert bars["GPU"].endswith(f"{blocks} / {case['num_full_blocks']} blocks"), case["name"]
        assert len(browser.find_elements(By.CSS_SELECTOR, "#probe-result .probe-row")) == 1


def test_probe_draws_per_tier_bars(fleet: Fleet, browser) -> None:
    case = max(load_expected_json("chat-sha256")["probes"], key=lambda p: p["gpu_tokens"])
    probe(browser, "tokens", ", ".join(map(str, case["tokens"])))
    bars = probe_row(browser, "a")
    answer = fleet.api("/prefix-match", method="POST", json={"tokens": case["tokens"]})
    want = next(e for e in answer["engines"] if e["engine"] == "a")
    assert want["gpu_blocks"] * 16 == case["gpu_tokens"]  # what vLLM itself reused
    for tier in TIERS:
        text = f"{want[tier.lower() + '_blocks']} / {answer['num_blocks']} blocks"
        assert bars[tier].endswith(text), (tier, bars[tier])
    assert bars["prefix"].startswith(f"prefix {want['prefix_blocks']} blocks")
    gpu = '#probe-result .probe-row[data-engine="a"] [data-tier="GPU"] .bar'
    assert browser.find_element(By.CSS_SELECTOR, gpu).value_of_css_property("width") != "0px"
    ranks = browser.find_elements(By.CSS_SELECTOR, "#probe-result .probe-row")
    assert len(ranks) == len(answer["engines"]) == 8


def test_block_lookup_shows_residency(fleet: Fleet, browser) -> None:
    refcounts = load_expected_json("chat-sha256")["expected"]["gpu_refcounts"]
    block, count = max(refcounts.items(), key=lambda kv: kv[1])
    form = browser.find_element(By.ID, "block-form")
    form.find_element(By.NAME, "hash").send_keys(block)
    form.find_element(By.CSS_SELECTOR, "button").click()
    cells = "#block-result tbody tr td"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, cells), "the block's residency")
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#block-result tbody tr')].map(tr =>"
        " Object.fromEntries([...tr.cells].map(td => [td.dataset.field, td.textContent])))"
    )
    mine = [r for r in rows if r["engine"] == "a" and r["medium"] == "GPU"]
    assert [(r["dp_rank"], number(r["count"])) for r in mine] == [("0", count)]
    assert len(rows) == len(fleet.api(f"/blocks/{block}")["residency"])
    OUTPUT.mkdir(exist_ok=True)
    # The whole page: a window as tall as the document (plus the window's own frame).
    height = browser.execute_script(
        "window.scrollTo(0, 0);"
        " return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight"
    )
    browser.set_window_size(1500, height)
    assert browser.save_screenshot(str(OUTPUT / "ui.png"))
    assert page_errors(browser) == []


def test_docs_render_offline(fleet: Fleet, browser) -> None:
    operations = sum(len(ops) for ops in fleet.api("/openapi.json")["paths"].values())
    browser.get(fleet.url + "/docs")
    blocks = ".opblock-summary-path"
    found = wait(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, blocks)) == operations or None,
        "Swagger UI's operations",
    )
    assert found
    paths = {e.text.replace("\u200b", "") for e in browser.find_elements(By.CSS_SELECTOR, blocks)}
    assert {"/prefix-match", "/engines/{name}", "/blocks/{block_hash}"} <= paths
    assert asked_elsewhere(browser, fleet.url) == []
    browser.get(fleet.url + "/redoc")
    items = "[data-section-id^='operation/'], [data-section-id^='tag/']"
    wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, items), "ReDoc's operations")
    assert "/prefix-match" in browser.find_element(By.TAG_NAME, "body").text
    # ReDoc's bundle shows its vendor's logo from a CDN: the page's CSP refuses it
    # before any request leaves the browser, and nothing else is asked elsewhere.
    errors = page_errors(browser)
    refused = [e for e in errors if "Content Security Policy" in e and "has been blocked" in e]
    assert [e for e in errors if e not in refused] == []
    elsewhere = asked_elsewhere(browser, fleet.url)
    assert all(any(f"'{url}'" in e for e in refused) for url in elsewhere), (elsewhere, refused)
