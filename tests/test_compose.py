"""docker-compose.yml is a valid Compose file whose commands are real kvindex commands.

No Docker daemon runs here: Debian's ``docker-compose`` (installed by ``make
setup``) validates the file against the Compose specification and prints it
resolved (anchors and merges applied) without one. Each service's command
must then parse with kvindex's own argument parser, and the services must be
wired to each other: workers and replicas to Redis, workers to the engines'
PUB and replay ports. tests/test_scaleout.py runs the same topology as
processes. The Prometheus and Grafana services are checked against the files
they mount (deploy/); tests/test_prometheus.py runs a real Prometheus over
every dashboard query.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from api.settings import ApiSettings
from kvindex.cli import parse_args
from kvindex.config import AUTH_TOKEN_ENV, refuse_open_door, resolve_auth_token

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = shutil.which("docker-compose")
TOKEN = "compose-test-token"


def compose(*args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    if COMPOSE is None:
        pytest.fail("docker-compose not installed: run make setup (scripts/ensure-compose.sh)")
    # The token from here only, never from a developer's .env.
    env = {k: v for k, v in os.environ.items() if k != AUTH_TOKEN_ENV}
    if token is not None:
        env[AUTH_TOKEN_ENV] = token
    with tempfile.NamedTemporaryFile("w", suffix=".env") as no_env_file:
        return subprocess.run(
            [
                COMPOSE,
                "-f",
                str(ROOT / "docker-compose.yml"),
                "--env-file",
                no_env_file.name,
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    result = compose("config")
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)["services"]


def test_the_file_is_valid_compose() -> None:
    result = compose("config", "--quiet")
    assert result.returncode == 0, result.stderr


def kvindex_commands(services: dict[str, dict]) -> dict[str, object]:
    """Every kvindex service's parsed command line, by service name."""
    parsed = {}
    for name, service in services.items():
        command = service.get("command") or []
        if command and command[0] == "kvindex":
            try:
                parsed[name] = parse_args(command[1:])
            except SystemExit:
                pytest.fail(f"{name}: not a kvindex command line: {command}")
    return parsed


def test_commands_are_kvindex_commands_wired_together(services: dict[str, dict]) -> None:
    parsed = kvindex_commands(services)
    roles = {name: args.command for name, args in parsed.items()}
    assert sorted(roles.values()) == ["api"] * 2 + ["indexer"] * 2 + ["sim"] * 4
    assert set(services) == {*roles, "redis", "prometheus", "grafana"}

    ports = {}  # engine service -> (PUB, replay) ports it binds on every interface
    for name, args in parsed.items():
        if args.command == "sim":
            assert (args.engines, args.dp_ranks, args.host) == (1, 1, "0.0.0.0"), name
            ports[name] = (args.base_port, args.base_port + 1)
    for name, args in parsed.items():
        if args.command in ("indexer", "api"):
            url = urlsplit(args.redis_url)
            assert (url.hostname, url.port) == ("redis", 6379), name
            assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        if args.command == "indexer":
            engines = {
                urlsplit(spec.endpoint).hostname: (spec.endpoint, spec.replay_endpoint)
                for spec in args.engine
            }
            assert set(engines) == set(ports), name
            for host, (pub, replay) in engines.items():
                assert (pub, replay) == tuple(f"tcp://{host}:{p}" for p in ports[host])

    published = [p["published"] for n, a in parsed.items() if a.command == "api"
                 for p in services[n]["ports"]]  # fmt: skip
    assert len(set(published)) == 2
    assert {a.port for a in parsed.values() if a.command == "api"} == {8000}
    assert {a.host for a in parsed.values() if a.command == "api"} == {"0.0.0.0"}


def bind_mounts(service: dict) -> dict[str, str]:
    """Container path -> host path of a service's volumes (``SOURCE:TARGET[:MODE]``)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        mounts[target] = source
    return mounts


def test_every_service_has_a_healthcheck(services: dict[str, dict]) -> None:
    """``depends_on: service_healthy`` and ``docker compose ps`` need one on each."""
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), name


def test_prometheus_scrapes_every_kvindex_process(services: dict[str, dict]) -> None:
    """Each worker's metrics port and each replica's HTTP port is a target; the
    workers' ports are also published, each on a port of its own."""
    parsed = kvindex_commands(services)
    wanted = {f"{n}:{a.metrics_port}" for n, a in parsed.items() if a.command == "indexer"}
    wanted |= {f"{n}:{a.port}" for n, a in parsed.items() if a.command == "api"}
    config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for c in job["static_configs"]
               for t in c["targets"]}  # fmt: skip
    assert targets == wanted
    published = [p["published"] for n, a in parsed.items() if a.command == "indexer"
                 for p in services[n]["ports"]]  # fmt: skip
    assert len(published) == len(set(published)) == 2
    mounts = bind_mounts(services["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"].endswith("deploy/prometheus/prometheus.yml")


def test_grafana_is_provisioned_with_the_dashboard(services: dict[str, dict]) -> None:
    """The dashboard's panels name the datasource uid that provisioning creates."""
    mounts = bind_mounts(services["grafana"])
    assert mounts["/etc/grafana/provisioning"].endswith("deploy/grafana/provisioning")
    assert mounts["/var/lib/grafana/dashboards"].endswith("deploy/grafana/dashboards")
    provisioning = ROOT / "deploy/grafana/provisioning"
    (source,) = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards/kvindex.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/kvindex.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {source["uid"]}


def test_replicas_get_the_token_from_the_environment(services: dict[str, dict]) -> None:
    """They listen on every interface, so without a token they would refuse to start."""
    apis = {n: a for n, a in kvindex_commands(services).items() if a.command == "api"}
    for name, args in apis.items():
        environment = services[name]["environment"]
        settings = resolve_auth_token(ApiSettings(), args.auth_token_file, environment)
        assert settings.auth_token == TOKEN, name
        refuse_open_door(args.host, settings)


def test_compose_refuses_to_run_without_a_token() -> None:
    result = compose("config", "--quiet", token=None)
    assert result.returncode != 0
    assert f"{AUTH_TOKEN_ENV}=<a secret> in .env" in result.stderr


def test_the_image_holds_what_the_package_installs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("indexer", "api", "producer", "answers"):
        assert f"COPY {package} ./{package}" in dockerfile
    # the lock's exact versions and hashes, then kvindex on them, nothing resolved anew
    assert "RUN pip install --require-hashes --no-deps -r locks/service.txt" in dockerfile
    assert "RUN pip install --no-deps --no-build-isolation ." in dockerfile
    assert "!locks/service.txt" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_image_build_checks_every_compiled_part() -> None:
    """The build stage's check (the one Python line after kvindex's install) runs and
    passes here, where every compiled part built: it names modules that exist."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    (check,) = re.findall(r'python -c "([^"]+)"', dockerfile)
    assert "compiled_status" in check
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_redis_persists_the_index(services: dict[str, dict]) -> None:
    """AOF on a named volume, never evicting: a restart loses at most the last second."""
    redis = services["redis"]
    command = redis["command"]
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert options == {
        "--appendonly": "yes",
        "--appendfsync": "everysec",
        "--maxmemory-policy": "noeviction",
    }
    assert redis["volumes"] == ["redis-data:/data:rw"]  # a named volume, not the container's disk
