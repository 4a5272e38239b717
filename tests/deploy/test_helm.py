"""The Helm chart and the compose file, checked offline (no cluster runs here).

The chart is rendered and linted strictly by Helm's own Go SDK (helm-python-sdk), with each
values file under ci/; every object is checked against the Kubernetes 1.30 schemas with
unknown fields refused (kubernetes-validate); the tests then read the rendered objects for
what the schemas cannot say: where probes point, what the network policy opens.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from django.urls import resolve

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "llamafleet"
VALUES = sorted((CHART / "ci").glob("*.yaml"))
KUBE = "1.30.0"


def render(values: dict, name: str = "fleet") -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=name, namespace="llm", is_install=True)
    return [
        doc
        for path, text in sorted(out.items())
        if path.endswith(".yaml")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def one(objs: list[dict], kind: str, suffix: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"{kind} *{suffix}: {[o['metadata']['name'] for o in found]}"
    return found[0]


def container(obj: dict, name: str) -> dict:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@pytest.fixture(scope="module")
def minimal() -> list[dict]:
    return render(load(CHART / "ci" / "minimal-values.yaml"))


@pytest.mark.parametrize("values_file", VALUES, ids=lambda p: p.stem)
def test_lints_strictly_and_every_object_is_valid_kubernetes(values_file):
    values = load(values_file)
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE}")
    assert report["errors"] == [] and report["messages"] == [], report
    objs = render(values)
    assert len(objs) >= 11
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema offline; test_service_monitor reads it
        kubernetes_validate.validate(obj, KUBE, strict=True)


def test_a_schema_violation_or_a_missing_secret_is_refused_with_its_reason():
    values = load(CHART / "ci" / "minimal-values.yaml")
    with pytest.raises(helm.HelmError, match="database.url"):
        render({**values, "database": {"url": ""}})
    with pytest.raises(helm.HelmError, match="replicas"):
        render({**values, "web": {"replicas": 0}})
    with pytest.raises(helm.HelmError, match="redis"):
        render({**values, "redis": {"url": "http://not-redis"}})


def test_control_plane_shape(minimal):
    web = one(minimal, "Deployment", "-web")
    assert web["spec"]["replicas"] >= 2
    pdb = one(minimal, "PodDisruptionBudget", "-web")
    assert pdb["spec"]["selector"]["matchLabels"] == web["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["minAvailable"] >= 1
    beat = one(minimal, "Deployment", "-beat")
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"]["type"] == "Recreate"
    assert container(beat, "beat")["command"][:4] == ["celery", "-A", "controlplane", "beat"]
    worker = one(minimal, "Deployment", "-worker")
    assert "worker" in container(worker, "worker")["command"]
    job = one(minimal, "Job", "-migrate")
    assert set(job["metadata"]["annotations"]["helm.sh/hook"].split(",")) == {
        "post-install",
        "pre-upgrade",
    }
    assert job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == [
        "python",
        "manage.py",
        "migrate",
    ]
    # Pods of the control plane wait for the schema before they start.
    for obj in (web, worker, beat):
        inits = [c["name"] for c in obj["spec"]["template"]["spec"]["initContainers"]]
        assert inits == ["certificate", "wait-for-migrations"]


@pytest.mark.django_db
def test_web_probes_point_at_real_endpoints(minimal, client):
    web = one(minimal, "Deployment", "-web")
    c = container(web, "web")
    config = one(minimal, "ConfigMap", "-config")["data"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert f"--port={port['http']}" in c["command"]
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["port"] == "http"
        # The probe's Host header must be one Django accepts, or every probe gets a 400.
        host = {h["name"]: h["value"] for h in get["httpHeaders"]}["Host"]
        assert host in config["LLAMAFLEET_ALLOWED_HOSTS"].split(",")
        resolve(path)
        assert client.get(path).status_code == 200


@pytest.mark.django_db
def test_readiness_fails_when_redis_is_down(client, settings):
    from controlplane import redis as cp_redis

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # the fixture puts it back
    cp_redis._clients.clear()
    response = client.get("/readyz")
    cp_redis._clients.clear()
    assert response.status_code == 503
    assert response.json() == {"status": "unavailable", "database": "ok", "redis": "unavailable"}


def test_agent_is_a_daemonset_on_labelled_nodes_with_grpc_health_probes(minimal):
    values = load(CHART / "values.yaml")["agent"]
    ds = one(minimal, "DaemonSet", "-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"llamafleet.io/agent": "true"}
    assert spec["tolerations"] and spec["tolerations"][0]["key"] == "llamafleet.io/inference"
    c = container(ds, "agent")
    args = dict(a[2:].split("=", 1) for a in c["command"] if a.startswith("--"))
    health = int(args["health-listen"].rsplit(":", 1)[1])
    assert health == values["healthPort"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == health
    assert c["readinessProbe"]["grpc"]["service"] == "llamafleet.agent.v1.NodeAgent"
    # The agent advertises its pod IP and dials the web Service.
    assert args["advertise"] == f"$(POD_IP):{values['port']}"
    web_svc = one(minimal, "Service", "-web")
    assert args["control-plane"] == (
        f"http://{web_svc['metadata']['name']}:{web_svc['spec']['ports'][0]['port']}"
    )
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    cache = next(v for v in spec["volumes"] if v["name"] == "models")
    assert cache["hostPath"]["path"] == values["modelCache"]["hostPath"]
    # Agents get the node token, never the database or Redis credentials.
    env = {e["name"] for e in c["env"]}
    assert "LLAMAFLEET_NODE_TOKEN" in env
    assert not env & {"DATABASE_URL", "REDIS_URL", "LLAMAFLEET_SECRET_KEY"}


def test_the_agent_answers_the_health_probe_in_plaintext_while_its_api_needs_tls(tmp_path):
    """What the kubelet's grpc probe does, against a real agent with mutual TLS on."""
    import asyncio

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.conftest import free_port
    from workers import tls
    from workers.agent.server import Agent, AgentSettings

    tls.make_ca(tmp_path)
    files = tls.issue(tmp_path, "agent", ["127.0.0.1"])
    health_port, api_port = free_port(), free_port()

    async def scenario():
        agent = Agent(
            AgentSettings(
                name="probe",
                listen=f"127.0.0.1:{api_port}",
                advertise=f"127.0.0.1:{api_port}",
                control_plane="",
                node_token="t",
                models_dir=str(tmp_path / "models"),
                health_listen=f"127.0.0.1:{health_port}",
                tls=files,
            )
        )
        await agent.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service="llamafleet.agent.v1.NodeAgent"),
                    timeout=5,
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                # Only health is there: the agent's own API is not on the plaintext port.
                from llamafleet.agent.v1 import agent_pb2, agent_pb2_grpc

                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await agent_pb2_grpc.NodeAgentStub(ch).GetStatus(
                        agent_pb2.GetStatusRequest(), timeout=5
                    )
                assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            # A plaintext client cannot use the API port at all.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{api_port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=3
                    )
            await agent.drain(0)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        finally:
            await agent.stop()

    asyncio.run(scenario())


def _selects(peer: dict, component: str) -> bool:
    labels = peer.get("podSelector", {}).get("matchLabels", {})
    return labels.get("app.kubernetes.io/component") == component and not peer.get(
        "namespaceSelector"
    )


def test_rpc_ports_are_open_to_agent_pods_only(minimal):
    values = load(CHART / "values.yaml")["agent"]
    base = int(one(minimal, "ConfigMap", "-config")["data"]["LLAMAFLEET_RPC_PORT_BASE"])
    rpc = range(base, base + values["rpcPorts"]["count"])
    policy = one(minimal, "NetworkPolicy", "-agent")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "agent"
    opened = []
    for rule in policy["spec"]["ingress"]:
        for p in rule.get("ports", []):
            lo, hi = p["port"], p.get("endPort", p["port"])
            if any(lo <= port <= hi for port in rpc):
                opened.append((lo, hi, rule.get("from")))
    assert len(opened) == 1, opened
    lo, hi, peers = opened[0]
    assert (lo, hi) == (rpc.start, rpc.stop - 1)
    assert peers and all(_selects(peer, "agent") for peer in peers)
    # The agent's API port: the control plane and agents only.
    api = [
        r
        for r in policy["spec"]["ingress"]
        if {"port": values["port"], "protocol": "TCP"} in r.get("ports", [])
    ]
    assert len(api) == 1
    assert {
        p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in api[0]["from"]
    } == {
        "web",
        "worker",
        "beat",
        "agent",
    }


def test_service_monitor_scrapes_named_ports_with_the_metrics_token():
    objs = render(load(CHART / "ci" / "production-values.yaml"))
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == 2
    services = [o for o in objs if o["kind"] == "Service"]
    for m in monitors:
        labels = m["spec"]["selector"]["matchLabels"]
        target = [s for s in services if labels.items() <= s["metadata"]["labels"].items()]
        assert len(target) == 1, m["metadata"]["name"]
        ports = {p["name"] for p in target[0]["spec"]["ports"]}
        for ep in m["spec"]["endpoints"]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
            assert ep["authorization"]["credentials"]["key"] == "LLAMAFLEET_METRICS_TOKEN"
        assert m["metadata"]["labels"]["release"] == "prometheus"
    values = load(CHART / "ci" / "minimal-values.yaml")
    with pytest.raises(helm.HelmError, match="metricsToken"):
        render({**values, "serviceMonitor": {"enabled": True}})


def test_the_generated_ca_issues_pod_certificates(minimal, tmp_path):
    """What the certificate init container does with the CA the chart makes."""
    from cryptography import x509

    from workers import tls

    ca = one(minimal, "Secret", "-ca")["data"]
    for name in ("ca.pem", "ca-key.pem"):
        (tmp_path / name).write_bytes(base64.b64decode(ca[name]))
    out = subprocess.run(
        [
            os.sys.executable,
            "-m",
            "workers",
            "pki",
            "--dir",
            str(tmp_path),
            "--name",
            "pod",
            "--host",
            "10.1.2.3",
            "--host",
            "node-a",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "LLAMAFLEET_TLS_CERT" in out.stdout
    cert = x509.load_pem_x509_certificate((tmp_path / "pod.pem").read_bytes())
    issuer = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(issuer)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "node-a" in sans.get_values_for_type(x509.DNSName)
    assert tls.TLSFiles(
        str(tmp_path / "ca.pem"), str(tmp_path / "pod.pem"), str(tmp_path / "pod-key.pem")
    )


@pytest.mark.django_db
def test_dashboard_queries_name_only_metrics_the_processes_export(minimal):
    """A renamed metric would leave a panel empty without anyone noticing."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY

    from apps.serving.metrics import FLEET
    from workers.agent.metrics import AgentMetrics

    exported = {m.name for m in REGISTRY.collect()} | {m.name for m in FLEET.collect()}
    exported |= {m.name for m in AgentMetrics(SimpleNamespace(replicas={})).registry.collect()}
    board = json.loads(one(minimal, "ConfigMap", "-dashboard")["data"]["llamafleet.json"])
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("tokens/s", "first token", "queue", "replicas", "errors", "migrations", "cost"):
        assert topic in titles
    for panel in board["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bllamafleet_[a-z_]+", target["expr"]):
                family = re.sub(r"_(total|bucket|count|sum)$", "", name)
                assert family in exported, (panel["title"], name)


def test_docker_compose_config_is_valid(tmp_path):
    def config(env: dict) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "config", "-q"],
            env=env, capture_output=True, text=True, cwd=tmp_path,
        )  # fmt: skip

    base = {k: v for k, v in os.environ.items() if k != "LLAMAFLEET_NODE_TOKEN"}
    base["LLAMAFLEET_SECRET_KEY"] = "x" * 40
    done = config(base | {"LLAMAFLEET_NODE_TOKEN": "t"})
    assert done.returncode == 0, done.stderr
    done = config(base)  # a secret missing: refused, naming it
    assert done.returncode != 0 and "LLAMAFLEET_NODE_TOKEN" in done.stderr


@pytest.mark.django_db(transaction=True)  # /metrics checks the key from a pool thread
def test_metrics_carry_the_fleet_gauges_the_dashboard_draws(ops):
    from apps.nodes.models import Node

    Node.objects.create(name="n1", address="10.0.0.1:50051", state="ready", price_per_hour="2.50")
    Node.objects.create(name="n2", address="10.0.0.2:50051", state="ready", price_per_hour="1.25")
    Node.objects.create(name="n3", address="10.0.0.3:50051", state="unreachable", price_per_hour=9)
    text = ops.get("/metrics").content.decode()
    assert 'llamafleet_fleet_cost_per_hour{currency="USD"} 3.75' in text
