"""The simulated workload and the ``kvindex sim`` command around it: the traffic
every benchmark and demo runs on must be deterministic and shaped as described
(turns, arrivals, skew), and the printed specs must register as they publish."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter

import msgspec
import pytest

from indexer.engine_registry import EngineSpec
from producer.sim import SimConfig
from producer.simcli import Layout, engine_spec
from producer.workload import Workload, WorkloadConfig

# --- workload ----------------------------------------------------------------


def test_workload_is_deterministic_per_seed_and_stream():
    def take(config: WorkloadConfig, stream: int = 0) -> list:
        return list(itertools.islice(Workload(config, stream), 30))

    config = WorkloadConfig(seed=7)
    assert take(config) == take(config)
    assert take(config) != take(config, stream=1)
    assert Workload(config, 1).system_prompts == Workload(config).system_prompts
    assert take(config) != take(WorkloadConfig(seed=8))


def test_turns_resend_the_whole_conversation():
    history: dict[int, tuple[int, ...]] = {}
    turns = Counter()
    for request in itertools.islice(Workload(WorkloadConfig()), 200):
        if request.turn == 1:
            system = Workload(WorkloadConfig()).system_prompts[request.system_prompt]
            assert request.prompt[: len(system)] == system
        else:
            before = history[request.conversation]
            assert request.prompt[: len(before)] == before
            assert len(request.prompt) > len(before)
        history[request.conversation] = request.prompt + request.output
        turns[request.turn] += 1
        assert len(request.prompt) + len(request.output) <= WorkloadConfig().max_context_tokens
    assert turns[1] > 0 and turns[3] > 0
    assert max(turns) <= WorkloadConfig().max_turns


def test_arrivals_follow_the_rate():
    requests = list(itertools.islice(Workload(WorkloadConfig(rate=50.0)), 2000))
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals)
    assert 35 < len(requests) / arrivals[-1] < 65


def test_zipf_skew_favours_the_first_system_prompts():
    def share_of_first(zipf_s: float) -> float:
        config = WorkloadConfig(zipf_s=zipf_s, new_conversation_prob=1.0, active_conversations=1)
        firsts = [r.system_prompt for r in itertools.islice(Workload(config), 2000)]
        return firsts.count(0) / len(firsts)

    assert share_of_first(2.0) > 0.5
    assert share_of_first(0.0) < 0.2


def test_workload_config_refuses_a_context_too_small_for_a_first_turn():
    with pytest.raises(ValueError, match="max_context_tokens"):
        WorkloadConfig(max_context_tokens=100)


# --- the sim command ----------------------------------------------------------


def test_printed_specs_register_and_match_the_publishers_ports():
    layout = Layout(engines=3, base_port=6000, dp_ranks=2)
    specs = [
        msgspec.convert(engine_spec(layout, k, SimConfig(), "m"), EngineSpec) for k in range(3)
    ]

    ports = [
        int(spec.rank_endpoint(r, replay).rsplit(":", 1)[1])
        for spec in specs
        for r in range(2)
        for replay in (False, True)
    ]
    assert len(set(ports)) == len(ports) == 12
    assert specs[1].rank_endpoint(1) == "tcp://127.0.0.1:6005"
    assert (specs[0].blocks_per_chunk, specs[0].hash_algo) == (4, "sha256")
    assert specs[0].hash_seed is None


def test_kvindex_sim_print_specs():
    result = subprocess.run(
        [sys.executable, "-m", "kvindex.cli", "sim", "--engines", "2", "--print-specs"],
        capture_output=True,
        text=True,
        check=True,
    )
    bodies = [json.loads(line) for line in result.stdout.splitlines()]
    assert [b["name"] for b in bodies] == ["sim-0", "sim-1"]
    assert [b["endpoint"] for b in bodies] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5559"]


def test_every_producer_module_imports_no_server_dependencies():
    code = """
import importlib, pkgutil, sys, producer
for module in pkgutil.iter_modules(producer.__path__):
    importlib.import_module(f"producer.{module.name}")
bad = sorted(m for m in sys.modules if m.split(".")[0] in {"fastapi", "redis", "api", "uvicorn"})
sys.exit(f"server modules imported: {bad}" if bad else 0)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
