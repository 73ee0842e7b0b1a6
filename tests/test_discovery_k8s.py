"""Kubernetes discovery: pod JSON -> engines, churn -> register/deregister, the
list+watch loop against a real HTTP server speaking the API's JSON stream, and
the deploy/k8s manifests against the Kubernetes schemas.

No API server runs here: the pods under tests/fixtures/k8s are written by hand
in the shape ``GET /api/v1/namespaces/NS/pods`` returns (and checked against
the v1 Pod schema below); the watch server replays events in the watch
protocol's framing (one JSON object per line, ``ERROR`` with a Status, 410).
"""

from __future__ import annotations

import asyncio
import copy
import json
import queue
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY

from indexer.announcements import Leases
from indexer.discovery.kubernetes import Defaults, is_serving, pod_engine, pod_engines
from indexer.discovery.sync import diff
from indexer.discovery.watch import PodWatch
from indexer.engine_registry import EngineRegistry, EngineSpec
from kvindex.config import ConfigError, ServeConfig, load_config

from .conftest import wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "k8s"
DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
DEFAULTS = Defaults({"block_size": "16", "hash_algo": "sha256"}, replay_port=5558)
READY, DP2 = "vllm-llama-7c9d5b6f4-x2x9q", "vllm-llama-7c9d5b6f4-k8mzt"


def pod(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_a_ready_pod_is_an_engine_at_its_ip_with_its_annotations_over_the_defaults() -> None:
    assert pod_engine(pod("pod-ready"), DEFAULTS) == EngineSpec(
        READY,
        "tcp://10.244.1.17:5557",
        model="llama-3-8b",
        replay_endpoint="tcp://10.244.1.17:5558",
        block_size=32,
        hash_algo="sha256_cbor",
        blocks_per_chunk=8,
    )
    dp2 = pod_engine(pod("pod-ready-dp2"), DEFAULTS)
    assert (dp2.endpoint, dp2.replay_endpoint, dp2.dp_ranks) == (
        "tcp://10.244.2.9:6000",
        "tcp://10.244.2.9:6002",
        2,
    )


@pytest.mark.parametrize(
    "name, serving",
    [
        ("pod-ready", True),
        ("pod-pending", False),  # no IP yet, containers creating
        ("pod-not-ready", False),  # Running but its readiness probe fails
        ("pod-terminating", False),  # Ready still, but deletionTimestamp is set
    ],
)
def test_only_running_ready_pods_with_an_ip_that_are_not_terminating_serve(
    name: str, serving: bool
) -> None:
    assert is_serving(pod(name)) is serving


def test_a_pod_list_gives_the_serving_pods_and_refuses_a_misannotated_one_naming_the_key() -> None:
    items = json.loads((FIXTURES / "podlist.json").read_text())["items"]
    engines, rejected = pod_engines(items, DEFAULTS)
    assert list(engines) == [READY]
    assert list(rejected) == ["vllm-llama-7c9d5b6f4-z5w2n"]
    assert "unknown annotation 'kvindex.io/blocksize'" in rejected["vllm-llama-7c9d5b6f4-z5w2n"]


def test_a_bad_annotation_value_is_refused_naming_the_field() -> None:
    bad = pod("pod-ready")
    bad["metadata"]["annotations"]["kvindex.io/hash-algo"] = "md5"
    with pytest.raises(ValueError, match=r"pod 'vllm-llama-7c9d5b6f4-x2x9q': .*hash_algo"):
        pod_engine(bad, DEFAULTS)
    bad["metadata"]["annotations"]["kvindex.io/hash-algo"] = "sha256"
    bad["metadata"]["annotations"]["kvindex.io/port"] = "http"
    with pytest.raises(ValueError, match=r"kvindex\.io/port must be a port"):
        pod_engine(bad, DEFAULTS)


def test_churn_between_two_pod_sets_is_added_removed_and_changed() -> None:
    moved = pod("pod-ready-dp2")
    moved["status"]["podIP"] = "10.244.2.44"  # rescheduled: same name, new IP
    old, _ = pod_engines([pod("pod-ready"), pod("pod-ready-dp2")], DEFAULTS)
    new, _ = pod_engines([pod("pod-not-ready"), moved, pod("pod-pending")], DEFAULTS)
    assert diff(old, new).removed == (READY,)
    assert diff(old, new).changed == (DP2,)
    back, _ = pod_engines([pod("pod-ready"), moved], DEFAULTS)
    assert diff(new, back).added == (READY,)
    assert diff(back, back) == diff({}, {})


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("pod-*.json")), ids=lambda p: p.stem)
def test_the_pod_fixtures_are_valid_v1_pods(path: Path) -> None:
    kubernetes_validate.validate(json.loads(path.read_text()), KUBE, strict=True)


KUBE = kubernetes_validate.utils.latest_version()


class ApiServer:
    """Speaks the pods list and watch of the Kubernetes API on a free port.

    ``GET .../pods`` answers :attr:`pods` as a PodList at :attr:`version`;
    with ``watch=1`` it streams the lines put into :attr:`events` (one JSON
    event each), ending the stream at a None. Every request is recorded.
    """

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.version = "1"
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.requests: list[tuple[str, dict[str, list[str]], str | None]] = []
        self.failing_lists = 0  # answer this many lists with a 500 first
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends when the connection closes

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                server.requests.append((url.path, query, self.headers.get("Authorization")))
                if url.path != "/api/v1/namespaces/inference/pods":
                    self.send_error(404)
                    return
                if "watch" not in query and server.failing_lists:
                    server.failing_lists -= 1
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                if "watch" not in query:
                    items = copy.deepcopy(server.pods)
                    for item in items:
                        del item["kind"], item["apiVersion"]
                    self.wfile.write(json.dumps(server.pod_list(items)).encode())
                    return
                while (event := server.events.get()) is not None:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def pod_list(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "kind": "PodList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": self.version},
            "items": items,
        }

    def send(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.put({"type": kind, "object": obj})

    def watches(self) -> list[dict[str, list[str]]]:
        return [q for _, q, _ in self.requests if "watch" in q]

    def close(self) -> None:
        self.events.put(None)
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def api_server() -> Iterator[ApiServer]:
    server = ApiServer()
    yield server
    server.close()


def lookups(source: str, outcome: str) -> float:
    labels = {"source": source, "outcome": outcome}
    return REGISTRY.get_sample_value("kvindex_discovery_lookups_total", labels) or 0.0


@pytest.mark.slow
async def test_the_watch_loop_follows_churn_and_lists_again_after_410(
    api_server: ApiServer, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    api_server.pods, api_server.version = [pod("pod-ready"), pod("pod-pending")], "100"
    api_server.failing_lists = 2  # the API server fails at first: retried, counted
    watch = PodWatch(
        f"k8s://inference?selector=app%3Dvllm&replay_port=5558&grace=0"
        f"&api={api_server.url}&token_file={token}&retry=0.1"
    )
    registry = EngineRegistry()
    leases = Leases(registry)
    task = asyncio.create_task(watch.run(leases))

    def endpoints() -> dict[str, str | None]:
        return {s.name: s.endpoint for s in registry.all()}

    failed = lookups("k8s://inference", "failed")
    try:
        await wait_until(lambda: endpoints() == {READY: "tcp://10.244.1.17:5557"}, 5)
        assert lookups("k8s://inference", "failed") == failed + 2
        assert len([r for r in api_server.requests if "watch" not in r[1]]) == 3
        _, query, auth = api_server.requests[0]
        assert (query["labelSelector"], auth) == (["app=vllm"], "Bearer t0k3n")
        await wait_until(lambda: bool(api_server.watches()), 5)
        assert api_server.watches()[0]["resourceVersion"] == ["100"]
        assert api_server.watches()[0]["allowWatchBookmarks"] == ["true"]

        api_server.send("ADDED", pod("pod-ready-dp2"))
        await wait_until(lambda: DP2 in endpoints(), 5)
        assert registry.get(DP2).dp_ranks == 2

        moved = pod("pod-ready")
        moved["status"]["podIP"], moved["metadata"]["resourceVersion"] = "10.244.1.99", "101"
        api_server.send("MODIFIED", moved)
        await wait_until(lambda: endpoints().get(READY) == "tcp://10.244.1.99:5557", 5)

        before = lookups(watch.url.label, "rejected")
        api_server.send("ADDED", pod("pod-bad-annotation"))
        api_server.send("MODIFIED", pod("pod-not-ready"))
        await wait_until(lambda: READY not in endpoints(), 5)
        assert list(endpoints()) == [DP2]  # the misannotated pod is not registered
        assert lookups(watch.url.label, "rejected") == before + 1

        # the watch's version is too old: list again (with the rotated token), from its version
        token.write_text("r0tated\n")
        api_server.pods, api_server.version = [pod("pod-ready")], "200"
        api_server.send("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "150"}})
        api_server.send(
            "ERROR",
            {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired",
             "message": "too old resource version: 100 (481000)", "code": 410},
        )  # fmt: skip
        api_server.events.put(None)
        await wait_until(lambda: endpoints() == {READY: "tcp://10.244.1.17:5557"}, 5)
        relist = [r for r in api_server.requests if "watch" not in r[1]][-1]
        assert relist[2] == "Bearer r0tated"
        await wait_until(lambda: len(api_server.watches()) == 2, 5)
        assert api_server.watches()[1]["resourceVersion"] == ["200"]

        api_server.send("DELETED", pod("pod-terminating"))
        await wait_until(lambda: not endpoints(), 5)
        assert leases.lease(READY) is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await leases.close()


@pytest.mark.slow
async def test_a_pod_missing_shorter_than_the_grace_keeps_its_registration(
    api_server: ApiServer,
) -> None:
    api_server.pods, api_server.version = [pod("pod-ready")], "7"
    watch = PodWatch(f"k8s://inference?selector=app%3Dvllm&grace=1&api={api_server.url}")
    registry = EngineRegistry()
    leases = Leases(registry)
    task = asyncio.create_task(watch.run(leases))
    try:
        await wait_until(lambda: [s.name for s in registry.all()] == [READY], 5)
        api_server.send("MODIFIED", pod("pod-not-ready"))
        await asyncio.sleep(0.4)
        assert [s.name for s in registry.all()] == [READY]  # a flapping probe drops nothing
        api_server.send("MODIFIED", pod("pod-ready"))
        await asyncio.sleep(1.2)
        assert [s.name for s in registry.all()] == [READY]
        api_server.send("MODIFIED", pod("pod-not-ready"))
        await wait_until(lambda: not registry.all(), 5)  # gone for good after the grace
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await leases.close()


def manifests() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    return [yaml.safe_load((DEPLOY / name).read_text()) for name in kustomization["resources"]]


def test_the_manifests_are_valid_kubernetes_objects_and_kustomize_lists_them_all() -> None:
    listed = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"]
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk
    kinds = set()
    for resource in manifests():
        kubernetes_validate.validate(resource, KUBE, strict=True)
        kinds.add(resource["kind"])
    assert kinds == {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"}


def test_rbac_grants_get_list_watch_on_pods_only_to_the_deployments_account() -> None:
    by_kind = {r["kind"]: r for r in manifests()}
    role, binding, deployment = by_kind["Role"], by_kind["RoleBinding"], by_kind["Deployment"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = by_kind["ServiceAccount"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account


def test_the_configmap_is_a_kvindex_config_the_deployment_mounts_and_serve_can_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    by_kind = {r["kind"]: r for r in manifests()}
    pod_spec = by_kind["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod_spec["containers"]
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    config_path = container["args"][container["args"].index("--config") + 1]
    config_dir, config_name = config_path.rsplit("/", 1)
    assert mounts[config_dir]["configMap"]["name"] == by_kind["ConfigMap"]["metadata"]["name"]
    (tmp_path / config_name).write_text(by_kind["ConfigMap"]["data"][config_name])
    config = load_config(tmp_path / config_name)
    token_dir = config.api["auth_token_file"].rsplit("/", 1)[0]
    assert "secret" in mounts[token_dir]  # a non-loopback kvindex must have a token

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (watch,) = config.discovery_sources()
    assert isinstance(watch, PodWatch)
    assert (watch.api, watch.namespace, watch.selector) == (
        "https://10.96.0.1:443",
        yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"],
        "app=vllm",
    )
    assert watch.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    with pytest.raises(ConfigError, match="unknown field 'selektor'"):
        ServeConfig(discover=["k8s://x?api=http://a:1&selektor=b"]).discovery_sources()
