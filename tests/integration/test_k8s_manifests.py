"""The Kubernetes manifests as `kubectl kustomize` renders them (deploy/k8s): every overlay renders, and the rendered
objects are safe, consistent with each other, with the code, and with deploy/prometheus and deploy/grafana.

Overlays of two kinds: the whole federation in one cluster (dev, gpu, monitoring: the demo), and a real federation
split in two (central: the federation's services; site-example: one site's agent, in the site's own cluster, with the
site's data mounted read-only). Every check that applies to a component applies wherever that component is deployed.

Skips only when kubectl is absent. Network policies are checked by evaluating them (Kubernetes semantics: a pod
selected by a policy of a direction is isolated in that direction and reachable only as some rule allows) over every
pair of FairFL pods and a few outside peers and addresses, against the round lifecycle's flows written down below.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fairfl.config import experiment_from_yaml
from tests.k8s_support import (
    ALL_OVERLAYS,
    CENTRAL_OVERLAYS,
    COMPONENTS,
    GRPC_PORTS,
    HEALTH_PORTS,
    K8S,
    METRICS_PORTS,
    NAMESPACE,
    OVERLAYS,
    REPO,
    SERVICE_COMPONENTS,
    SITE_DATA_MOUNT,
    SITE_EXAMPLE,
    SITE_OVERLAYS,
    SITE_STANDALONE,
    TLS_MOUNT,
    Workload,
    by_component,
    container_ports,
    env_of,
    find,
    labels_match,
    load_manifest,
    of_kind,
    overlay_components,
    parse_dockerfile,
    quantity,
    render,
    render_overlay,
    selector_matches,
    workloads,
)

pytestmark = pytest.mark.integration

PROJECT_PACKAGES = {
    "aggregator": "aggregator_service",
    "clustering": "clustering_service",
    "privacy": "privacy_service",
    "agent": "client_agent",
}
# Set by the manifests but read by code that arrives with the observability issue (--metrics-port / env).
PENDING_ENV = {"FAIRFL_METRICS_PORT"}

# ------------------------------------------------------------------------------------------- the flows that may exist
# (source, destination, protocol, port). "dns" is the cluster DNS (kube-system, k8s-app=kube-dns); "prometheus" is
# the Prometheus Operator's Prometheus in namespace `monitoring`.
ROUND_LIFECYCLE_FLOWS = {
    ("agent", "aggregator", "TCP", 50051),  # register, poll tasks, fetch models, submit results (and heartbeats)
    ("aggregator", "clustering", "TCP", 50052),  # select clients, report signatures
    ("aggregator", "privacy", "TCP", 50053),  # register budgets, authorize spend
    ("agent", "dns", "UDP", 53),
    ("agent", "dns", "TCP", 53),
    ("aggregator", "dns", "UDP", 53),
    ("aggregator", "dns", "TCP", 53),
}
SCRAPE_FLOWS = {("prometheus", c, "TCP", port) for c, port in METRICS_PORTS.items()}
# A real federation: the sites' agents reach the aggregator from outside its cluster, by address (the example's
# documentation addresses: deploy/k8s/overlays/central/sites-ingress.yaml, site-example/aggregator-egress.yaml).
SITE_ADDRESSES = {"site-a-address": "198.51.100.7", "site-b-address": "198.51.100.8", "site-c-address": "203.0.113.9"}
AGGREGATOR_ADDRESS = "192.0.2.10"  # where fairfl.example.org, the site example's aggregator, resolves
CENTRAL_FLOWS = {
    *((site, "aggregator", "TCP", 50051) for site in SITE_ADDRESSES),  # the sites' agents, over mutual TLS
    ("aggregator", "clustering", "TCP", 50052),
    ("aggregator", "privacy", "TCP", 50053),
    ("aggregator", "dns", "UDP", 53),
    ("aggregator", "dns", "TCP", 53),
}
SITE_FLOWS = {
    ("agent", "aggregator-address", "TCP", 50051),  # the one flow out of a site besides DNS
    ("agent", "dns", "UDP", 53),
    ("agent", "dns", "TCP", 53),
}
EXPECTED_FLOWS = {
    "dev": ROUND_LIFECYCLE_FLOWS,
    "gpu": ROUND_LIFECYCLE_FLOWS,
    "monitoring": ROUND_LIFECYCLE_FLOWS | SCRAPE_FLOWS,
    "central": CENTRAL_FLOWS,
    "site-example": SITE_FLOWS,
}
# Addresses outside every cluster (not pods): only an ipBlock can match them.
OUTSIDE_ADDRESSES = {**SITE_ADDRESSES, "aggregator-address": AGGREGATOR_ADDRESS, "internet": "203.0.113.200"}
# Peers outside the FairFL pods: (namespace, namespace labels, pod labels); OUTSIDE_ADDRESSES are addresses instead.
OUTSIDE_PEERS: dict[str, tuple[str, dict[str, str], dict[str, str]] | None] = {
    "dns": ("kube-system", {"kubernetes.io/metadata.name": "kube-system"}, {"k8s-app": "kube-dns"}),
    "prometheus": (
        "monitoring",
        {"kubernetes.io/metadata.name": "monitoring"},
        {"app.kubernetes.io/name": "prometheus"},
    ),
    "prometheus-elsewhere": (
        "default",
        {"kubernetes.io/metadata.name": "default"},
        {"app.kubernetes.io/name": "prometheus"},
    ),
    "stranger-in-namespace": (NAMESPACE, {"kubernetes.io/metadata.name": NAMESPACE}, {"app": "debug"}),
    "stranger-elsewhere": ("default", {"kubernetes.io/metadata.name": "default"}, {"app": "debug"}),
    **dict.fromkeys(OUTSIDE_ADDRESSES),
}
PROBED_PORTS = sorted(
    {("TCP", p) for p in (*GRPC_PORTS.values(), *METRICS_PORTS.values(), 22, 80, 443, 53, 9090, 3000)}
    | {("UDP", 53), ("UDP", 123)}
)


@pytest.fixture(scope="module", params=ALL_OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render_overlay(request.param)


def _pods(docs: list[dict[str, Any]]) -> Iterable[tuple[Workload, dict[str, Any]]]:
    for w in workloads(docs):
        for c in w.containers + w.pod_spec.get("initContainers", []):
            yield w, c


# ------------------------------------------------------------------------------------------------------- rendering


def test_every_overlay_and_the_base_render() -> None:
    for name, directory in [("base", K8S / "base"), *((o, K8S / "overlays" / o) for o in ALL_OVERLAYS)]:
        docs = render(directory)
        assert {w.component for w in workloads(docs)} == overlay_components(name), directory
    assert sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir()) == sorted(ALL_OVERLAYS)


def test_everything_lands_in_the_fairfl_namespace(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    find(docs, "Namespace", NAMESPACE)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']} {d['metadata']['name']}"
    labels = find(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"


# --------------------------------------------------------------------------------------------- containers and pods


def test_every_container_has_probes(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for w, c in _pods(docs):
        ports = container_ports(c)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            assert probe, f"{w.name}/{c['name']}: no {kind}"
            if w.component in GRPC_PORTS:  # a gRPC service: native gRPC probe against its plaintext health port
                port = HEALTH_PORTS[w.component]
                assert probe.get("grpc", {}).get("port") == ports["health"] == port, (w.name, kind)
                assert env_of(c)["FAIRFL_HEALTH_BIND"] == f"0.0.0.0:{port}", "the health port the probes ask"
            else:  # the agent serves no gRPC: its metrics endpoint answers its probes
                get = probe.get("httpGet")
                assert get and get["path"] == "/metrics", (w.name, kind)
                port = get["port"]
                assert (ports[port] if isinstance(port, str) else port) == METRICS_PORTS[w.component]
        assert c["livenessProbe"].get("failureThreshold", 3) >= 3
        assert c["livenessProbe"].get("timeoutSeconds", 1) >= 2, "probe deadlines under load"


def test_every_container_has_requests_and_limits(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    for w, c in _pods(docs):
        res = c.get("resources", {})
        for key in ("cpu", "memory"):
            request, limit = res.get("requests", {}).get(key), res.get("limits", {}).get(key)
            assert request is not None and limit is not None, f"{w.name}/{c['name']}: {key} request and limit"
            assert 0 < quantity(request) <= quantity(limit), f"{w.name}/{c['name']}: {key} {request} > {limit}"
        gpus = res.get("limits", {}).get("nvidia.com/gpu")
        if name == "gpu" and w.component == "agent":
            assert gpus is not None and int(gpus) >= 1
            assert res.get("requests", {}).get("nvidia.com/gpu", gpus) == gpus, "GPU requests must equal limits"
        else:
            assert gpus is None, f"{w.name}: only gpu agents take GPUs"


def test_every_pod_and_container_is_locked_down(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for w in workloads(docs):
        spec = w.pod_spec
        pod_sc = spec.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True, w.name
        assert pod_sc.get("runAsUser", 0) > 0 and pod_sc.get("runAsGroup", 0) > 0, w.name
        assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", w.name
        assert spec.get("automountServiceAccountToken") is False, f"{w.name}: no component uses the API"
        assert spec.get("enableServiceLinks") is False, f"{w.name}: service links would inject FAIRFL_*_PORT"
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(host), w.name
        assert not [v for v in spec.get("volumes", []) if "hostPath" in v], w.name
        for c in w.containers:
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            assert sc.get("readOnlyRootFilesystem") is True, c["name"]
            assert not sc.get("privileged"), c["name"]
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), c["name"]
            assert not sc.get("capabilities", {}).get("add"), c["name"]
            assert sc.get("runAsUser", pod_sc["runAsUser"]) != 0


def test_read_only_root_leaves_the_writable_paths_the_code_needs(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for w, c in _pods(docs):
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts and "/home/fairfl" in mounts, f"{w.name}: /tmp and $HOME must be writable"
        for m in mounts.values():
            assert m["mountPath"] in ("/etc/fairfl", TLS_MOUNT, SITE_DATA_MOUNT) or not m.get("readOnly"), m
        db = env_of(c).get("FAIRFL_PRIVACY_DB")
        if db is not None:
            parent = str(Path(db).parent)
            claims = {t["metadata"]["name"] for t in w.obj["spec"].get("volumeClaimTemplates", [])}
            assert parent in mounts and mounts[parent]["name"] in claims, "the ledger must live on a volume"


def test_stateful_components_are_single_writers_with_volumes(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    comp = by_component(docs)
    assert set(comp) == overlay_components(name)
    for component in {"aggregator", "privacy"} & set(comp):
        w = comp[component]
        assert w.kind == "StatefulSet" and w.replicas == 1, component
        templates = w.obj["spec"]["volumeClaimTemplates"]
        assert templates and all(t["spec"]["accessModes"] == ["ReadWriteOnce"] for t in templates)
        mounted = {m["name"] for m in w.container.get("volumeMounts", [])}
        assert {t["metadata"]["name"] for t in templates} <= mounted
    if "clustering" in comp:
        assert comp["clustering"].kind == "Deployment" and comp["clustering"].replicas == 1, (
            "clustering state is per process"
        )
    if name in SITE_OVERLAYS:  # one pod at a time holds the site's identity and client ids, even during a rollout
        assert comp["agent"].kind == "StatefulSet" and comp["agent"].replicas == 1
    elif "agent" in comp:
        assert comp["agent"].kind == "StatefulSet", "agents derive their clients from their ordinal"
    for w in workloads(docs):
        if w.kind == "StatefulSet":
            service = find(docs, "Service", w.obj["spec"]["serviceName"])
            assert service["spec"].get("clusterIP") == "None", f"{w.name}: governing Service must be headless"


def test_pod_disruption_budgets_cover_every_workload(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    pdbs = of_kind(docs, "PodDisruptionBudget")
    for w in workloads(docs):
        covering = [p for p in pdbs if selector_matches(p["spec"]["selector"], w.labels)]
        assert len(covering) == 1, f"{w.name}: {len(covering)} PodDisruptionBudgets"
        spec = covering[0]["spec"]
        if w.component == "agent":
            assert spec.get("maxUnavailable") == 1
        else:  # single replicas on every round's path
            assert spec.get("minAvailable") == 1


# ---------------------------------------------------------------------------------------- services and addresses


def test_every_service_selects_pods_exposing_its_ports(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for svc in of_kind(docs, "Service"):
        selected = [w for w in workloads(docs) if labels_match(svc["spec"].get("selector", {}), w.labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in selected:
                exposed = [p for c in w.containers for p in c.get("ports", []) if p.get("protocol", "TCP") == "TCP"]
                names = {p["name"] for p in exposed}
                numbers = {p["containerPort"] for p in exposed}
                assert target in (names if isinstance(target, str) else numbers), (svc["metadata"]["name"], target)


def _service_target(docs: list[dict[str, Any]], address: str) -> tuple[Workload, int]:
    host, _, port = address.rpartition(":")
    svc = find(docs, "Service", host)
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    (w,) = [w for w in workloads(docs) if labels_match(svc["spec"]["selector"], w.labels)]
    target = sp.get("targetPort", sp["port"])
    return w, container_ports(w.container)[target] if isinstance(target, str) else int(target)


def test_service_addresses_reach_the_right_component(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    comp = by_component(docs)
    wanted = {
        ("aggregator", "FAIRFL_CLUSTERING_ADDRESS"): "clustering",
        ("aggregator", "FAIRFL_PRIVACY_ADDRESS"): "privacy",
        ("agent", "FAIRFL_AGGREGATOR_ADDRESS"): "aggregator",
    }
    for (src, var), dst in wanted.items():
        if src not in comp or dst not in comp:  # a site's aggregator is in another cluster: test_site_* below
            assert name in (*CENTRAL_OVERLAYS, *SITE_OVERLAYS), (name, src, dst)
            continue
        w, port = _service_target(docs, env_of(comp[src].container)[var])
        assert w.component == dst and port == GRPC_PORTS[dst], var
        bind = {"aggregator": "FAIRFL_AGGREGATOR_BIND", "clustering": "FAIRFL_CLUSTERING_BIND"}.get(dst)
        bind = bind or "FAIRFL_PRIVACY_BIND"
        assert env_of(w.container)[bind] == f"0.0.0.0:{port}", f"{dst} must listen where its Service points"


def test_every_component_speaks_mutual_tls_with_its_own_secret(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """Each workload mounts the Secret of its own identity (the directory `fairfl certs` writes for it) read-only
    where FAIRFL_TLS_DIR points, readable by its fsGroup only, and nothing asks for plaintext."""
    from fairfl import tls

    overlay_name, docs = overlay
    assert set(tls.SERVICES) == set(SERVICE_COMPONENTS), "one `fairfl certs` identity per component"
    for name, w in by_component(docs).items():
        env = env_of(w.container)
        assert env["FAIRFL_TLS_DIR"] == TLS_MOUNT and "FAIRFL_INSECURE" not in env, name
        mount = {m["mountPath"]: m for m in w.container["volumeMounts"]}[TLS_MOUNT]
        assert mount["readOnly"] is True
        secret = {v["name"]: v for v in w.pod_spec["volumes"]}[mount["name"]]["secret"]
        # A site's agent has the site's own identity (`fairfl certs --agent <site>=<ids>` writes certs/<site>/).
        identity = env["FAIRFL_AGENT_NAME"] if overlay_name in SITE_OVERLAYS else name
        assert secret["secretName"] == f"fairfl-tls-{identity}", name
        assert secret["defaultMode"] & 0o007 == 0, f"{name}: the key must not be world-readable"
        assert w.pod_spec["securityContext"]["fsGroup"] == w.pod_spec["securityContext"]["runAsGroup"]
    for svc in of_kind(docs, "Service"):
        for port in svc["spec"]["ports"]:
            assert port.get("appProtocol") != "kubernetes.io/h2c", "gRPC ports speak TLS, not cleartext HTTP/2"


def test_metrics_ports_are_fixed_and_configured(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    for name, w in by_component(docs).items():
        assert container_ports(w.container)["metrics"] == METRICS_PORTS[name]
        assert env_of(w.container)["FAIRFL_METRICS_PORT"] == str(METRICS_PORTS[name])


# ------------------------------------------------------------------------------------------ commands and settings


def test_container_commands_are_real_cli_entrypoints(
    overlay: tuple[str, list[dict[str, Any]]], capsys: pytest.CaptureFixture[str]
) -> None:
    import tomllib

    from fairfl.compose import cli

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fairfl"] == "fairfl.compose.cli:main"
    _, docs = overlay
    for name, w in by_component(docs).items():
        c = w.container
        assert c["command"] == ["fairfl"], "the image's entrypoint, the console script"
        assert c["args"] == ["serve", name]
        with pytest.raises(SystemExit) as exit_info:  # the real parser accepts it, down to the component's own
            cli.main([*c["args"], "--help"])
        assert exit_info.value.code == 0
        assert f"usage: {PROJECT_PACKAGES[name]}" in capsys.readouterr().out


def test_every_setting_is_read_by_the_component(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = overlay
    sources = {pkg: _python_text(REPO / pkg) for pkg in (*PROJECT_PACKAGES.values(), "fairfl")}
    for name, w in by_component(docs).items():
        for var in env_of(w.container):
            if not var.startswith("FAIRFL_"):
                continue
            if var in PENDING_ENV and not any(f'"{var}"' in text for text in sources.values()):
                continue
            assert f'"{var}"' in sources[PROJECT_PACKAGES[name]] + sources["fairfl"], f"{name}: nothing reads {var}"


def _python_text(directory: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(directory.rglob("*.py")))


@pytest.mark.parametrize("name", OVERLAYS)
def test_experiment_configmap_passes_validation_and_fits_the_agents(name: str) -> None:
    docs = render_overlay(name)
    data = find(docs, "ConfigMap", "fairfl-experiment")["data"]
    config = experiment_from_yaml(data["experiment.yaml"])  # the project's own validation
    agent = by_component(docs)["agent"]
    per_agent = int(env_of(agent.container)["FAIRFL_CLIENTS_PER_AGENT"])
    assert config.data.num_clients == agent.replicas * per_agent, "the run waits for every logical client"
    assert config.runtime.agents == agent.replicas
    assert config.data.dataset in ("fashion_mnist", "synthetic") and not config.data.download, "no internet egress"
    aggregator = by_component(docs)["aggregator"]
    mount = {m["name"]: m for m in aggregator.container["volumeMounts"]}["experiment"]
    assert mount["mountPath"] == "/etc/fairfl" and mount["readOnly"] is True
    volume = {v["name"]: v for v in aggregator.pod_spec["volumes"]}["experiment"]
    assert volume["configMap"]["name"] == "fairfl-experiment"


def test_gpu_overlay_puts_agents_on_gpus_and_services_not() -> None:
    docs = render_overlay("gpu")
    comp = by_component(docs)
    agent = comp["agent"]
    assert agent.container["image"].startswith("fairfl-cuda:")
    assert env_of(agent.container)["FAIRFL_DEVICE"] == "cuda"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent.pod_spec["tolerations"]
    assert agent.pod_spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    for name in ("aggregator", "clustering", "privacy"):
        spec = comp[name].pod_spec
        assert comp[name].container["image"].startswith("fairfl:") and "nodeSelector" not in spec
    for other in ("dev", "monitoring"):
        agent = by_component(render_overlay(other))["agent"]
        assert agent.container["image"].startswith("fairfl:") and env_of(agent.container)["FAIRFL_DEVICE"] == "cpu"


# ------------------------------------------------------------------------------ a real federation: central and sites


def _data_path(spec: str) -> str:
    """The path of a `--data SPEC`: its first comma-separated item (the rest are options)."""
    return spec.split(",", 1)[0].strip()


def test_site_data_is_mounted_read_only_from_a_claim(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    """A site agent's data (FAIRFL_DATA) is a PersistentVolumeClaim mounted read-only, on the volume and on the mount;
    no other workload is given a data path or the site data's mount."""
    name, docs = overlay
    served = []
    for w, c in _pods(docs):
        env = env_of(c)
        mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
        if "FAIRFL_DATA" not in env:
            assert SITE_DATA_MOUNT not in mounts, w.name
            continue
        served.append(w.name)
        assert w.component == "agent" and name in SITE_OVERLAYS, f"{name}/{w.name}: only a site's agent reads data"
        path = _data_path(env["FAIRFL_DATA"])
        assert path == SITE_DATA_MOUNT or path.startswith(SITE_DATA_MOUNT + "/"), path
        mount = mounts[SITE_DATA_MOUNT]
        assert mount["readOnly"] is True, "the agent must not be able to change the site's data"
        volume = {v["name"]: v for v in w.pod_spec["volumes"]}[mount["name"]]
        assert set(volume) == {"name", "persistentVolumeClaim"}, volume
        assert volume["persistentVolumeClaim"]["readOnly"] is True, "read-only on the volume too"
        others = [m for cc in w.containers + w.pod_spec.get("initContainers", []) for m in cc.get("volumeMounts", [])]
        assert all(m.get("readOnly") for m in others if m["name"] == mount["name"]), "no writable mount of the data"
    assert bool(served) == (name in SITE_OVERLAYS), (name, served)


@pytest.mark.parametrize("name", SITE_OVERLAYS)
def test_site_overlay_runs_one_agent_with_the_sites_identity(name: str, tmp_path: Path) -> None:
    """One agent, its site's settings all set and consistent: the client ids its certificate allows (issued by the
    documented `fairfl certs --agent <site>=<ids>`), an aggregator address outside the cluster, and nothing of the
    demo: no Fashion-MNIST, no experiment, no ordinal-derived client range."""
    from fairfl import tls

    docs = render_overlay(name)
    (w,) = workloads(docs)
    env = env_of(w.container)
    site, clients = env["FAIRFL_AGENT_NAME"], env["FAIRFL_CLIENTS"]
    assert site and site != "site", "the overlay names its site (the component's placeholder is `site`)"
    assert "FAIRFL_CLIENTS_PER_AGENT" not in env, "a site hosts the ids its certificate names, not an ordinal range"
    ranges = tls.parse_ranges(clients)
    written = tls.write_deployment(tmp_path, agents=[(site, ranges)])
    identity = tls.identity_of((written[site] / "tls.crt").read_bytes())
    assert identity.name == site and identity.role == tls.ROLE_AGENT
    ids = sorted({i for lo, hi in ranges for i in range(lo, hi + 1)})
    assert identity.unauthorized(ids) == [] and identity.unauthorized([ids[-1] + 1]) == [ids[-1] + 1]
    host, _, port = env["FAIRFL_AGGREGATOR_ADDRESS"].rpartition(":")
    assert host and port.isdigit() and not host.endswith(".invalid"), "the overlay sets the aggregator's address"
    assert not [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == host], "the aggregator is elsewhere"
    assert not of_kind(docs, "ConfigMap"), "a site submits no experiment: the federation's operator does"
    text = yaml.safe_dump_all(docs)
    assert "/usr/share/datasets" not in text and "fashion" not in text.lower(), "a site needs no public data set"
    assert not of_kind(docs, "PersistentVolumeClaim"), "the data's claim is the site's, applied on its own"


def test_site_data_files_fill_the_claim_the_agent_reads() -> None:
    """deploy/k8s/overlays/site-example/data-pvc.yaml is the claim the agent mounts; data-loader.yaml is the only pod
    that mounts it writable, runs as the agent's user (a read-only volume is not chowned to the pod's fsGroup: the
    files it copies in must be the agent's) and passes the Pod Security "restricted" profile."""
    agent = by_component(render(SITE_EXAMPLE))["agent"]
    mount = {m["mountPath"]: m for m in agent.container["volumeMounts"]}[SITE_DATA_MOUNT]
    claim = {v["name"]: v for v in agent.pod_spec["volumes"]}[mount["name"]]["persistentVolumeClaim"]["claimName"]
    pvc_path, loader_path = SITE_STANDALONE
    (pvc,) = load_manifest(pvc_path)
    (loader,) = load_manifest(loader_path)
    assert (pvc["kind"], pvc["metadata"]["name"], pvc["metadata"]["namespace"]) == (
        "PersistentVolumeClaim",
        claim,
        NAMESPACE,
    )
    assert "app.kubernetes.io/part-of" not in pvc["metadata"].get("labels", {}), "kept out of the label cleanup"
    assert loader["kind"] == "Pod" and loader["metadata"]["namespace"] == NAMESPACE
    spec = loader["spec"]
    (volume,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim
    (c,) = spec["containers"]
    (data_mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert data_mount["mountPath"] == SITE_DATA_MOUNT and not data_mount.get("readOnly")
    pod_sc, agent_sc = spec["securityContext"], agent.pod_spec["securityContext"]
    for key in ("runAsUser", "runAsGroup"):
        assert pod_sc[key] == agent_sc[key], key
    assert pod_sc["runAsNonRoot"] is True and pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert sc["readOnlyRootFilesystem"] is True and not sc.get("privileged")
    assert 0 < quantity(c["resources"]["requests"]["memory"]) <= quantity(c["resources"]["limits"]["memory"])


def test_central_overlay_knows_the_signature_never_the_data() -> None:
    """The federation's side: no agents, no data path anywhere, and a site-mode experiment whose signature is known
    without opening a file; the example site's client ids are among its clients."""
    from fairfl import tls
    from fairfl.data import resolve_dataset, run_signature

    docs = render_overlay("central")
    assert set(by_component(docs)) == set(SERVICE_COMPONENTS)
    for w, c in _pods(docs):
        assert "FAIRFL_DATA" not in env_of(c), w.name
    config = experiment_from_yaml(find(docs, "ConfigMap", "fairfl-experiment")["data"]["experiment.yaml"])
    assert getattr(resolve_dataset(config.data.dataset), "at_sites", False) is True, "data that stays at the sites"
    assert config.data.root is None and not config.data.download
    signature = run_signature(config)
    assert signature.input_shape and signature.num_classes >= 2
    assert "/usr/share/datasets" not in yaml.safe_dump_all(docs)
    assert config.runtime.agents == len(SITE_ADDRESSES), "one agent per site allowed in by sites-ingress.yaml"
    site = env_of(by_component(render(SITE_EXAMPLE))["agent"].container)
    ids = [i for lo, hi in tls.parse_ranges(site["FAIRFL_CLIENTS"]) for i in range(lo, hi + 1)]
    assert max(ids) < config.data.num_clients, "the site's clients are the run's"


def test_sites_reach_the_central_aggregator_where_it_listens() -> None:
    """The site's FAIRFL_AGGREGATOR_ADDRESS port is the central aggregator's public Service port, which leads to the
    aggregator's gRPC port; the load balancer admits the addresses the aggregator's NetworkPolicy admits."""
    central = render_overlay("central")
    site = env_of(by_component(render(SITE_EXAMPLE))["agent"].container)
    port = int(site["FAIRFL_AGGREGATOR_ADDRESS"].rpartition(":")[2])
    public = [s for s in of_kind(central, "Service") if s["spec"].get("type") == "LoadBalancer"]
    (svc,) = public
    assert svc["spec"]["externalTrafficPolicy"] == "Local", "keep the sites' addresses for the NetworkPolicy"
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == port]
    (w,) = [w for w in workloads(central) if labels_match(svc["spec"]["selector"], w.labels)]
    assert w.component == "aggregator"
    target = sp["targetPort"]
    assert (container_ports(w.container)[target] if isinstance(target, str) else target) == GRPC_PORTS["aggregator"]
    policy = find(central, "NetworkPolicy", "fairfl-aggregator")
    admitted = {peer["ipBlock"]["cidr"] for rule in policy["spec"]["ingress"] for peer in rule["from"]}
    assert set(svc["spec"]["loadBalancerSourceRanges"]) == admitted
    assert {f"{ip}/32" for ip in SITE_ADDRESSES.values()} == admitted


@pytest.mark.parametrize("name", (*CENTRAL_OVERLAYS, *SITE_OVERLAYS))
def test_split_overlays_fit_the_image(name: str) -> None:
    """What tests/unit/test_dockerfile.py checks for the demo overlays, for the overlays of a real federation: the
    image's user and entrypoint, ports the image exposes, and volumes under directories the image owns."""
    dockerfile = parse_dockerfile()
    stage = dockerfile.stage("runtime")
    user, _, group = stage.last("USER").partition(":")
    exposed = {int(p.split("/")[0]) for p in stage.last("EXPOSE").split()}
    runs = " ".join(stage.all("RUN"))
    owned = set(re.findall(r"install -d -o \d+ -g \d+ ((?:/\S+ ?)+)", runs)[0].split())
    home = stage.env()["HOME"]
    for w in workloads(render_overlay(name)):
        sc = w.pod_spec["securityContext"]
        assert (sc["runAsUser"], sc["runAsGroup"], sc["fsGroup"]) == (int(user), int(group), int(group)), w.name
        assert w.container["command"] == stage.exec_form("ENTRYPOINT"), w.name
        assert {p["containerPort"] for p in w.container.get("ports", [])} <= exposed, w.name
        for m in w.container["volumeMounts"]:
            path = m["mountPath"]
            assert path in (home, "/tmp") or any(path == d or path.startswith(d + "/") for d in owned), (w.name, path)


# ------------------------------------------------------------------------------------------------ network policies


def _endpoints(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    out: dict[str, dict[str, Any] | None] = {}
    for w in workloads(docs):
        ports = {p["name"]: (p.get("protocol", "TCP"), int(p["containerPort"])) for p in w.container.get("ports", [])}
        out[w.component] = {
            "namespace": NAMESPACE,
            "ns_labels": {"kubernetes.io/metadata.name": NAMESPACE},
            "labels": w.labels,
            "ports": ports,
            "ours": True,
        }
    for name, peer in OUTSIDE_PEERS.items():
        out[name] = (
            {"ip": OUTSIDE_ADDRESSES[name], "ours": False}
            if peer is None
            else {"namespace": peer[0], "ns_labels": peer[1], "labels": peer[2], "ports": {}, "ours": False}
        )
    return out


def _peer_matches(peer: dict[str, Any], endpoint: dict[str, Any] | None, policy_ns: str) -> bool:
    if endpoint is None:
        return False
    if "ipBlock" in peer:  # only ever used for addresses outside the cluster; pods' own addresses are not matched
        if "ip" not in endpoint:
            return False
        ip, block = ipaddress.ip_address(endpoint["ip"]), peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(cidr) for cidr in block.get("except", [])
        )
    if "ip" in endpoint:  # an address outside the cluster: no namespace or pod selector matches it
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], endpoint["ns_labels"]):
            return False
    elif endpoint["namespace"] != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], endpoint["labels"])


def _port_matches(rule_ports: list[dict[str, Any]] | None, proto: str, port: int, dst: dict[str, Any] | None) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != proto:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):  # a named port: the destination pod's container port of that name
            named = (dst or {}).get("ports", {}).get(want)
            if named == (proto, port):
                return True
        elif want <= port <= p.get("endPort", want):
            return True
    return False


def _direction_allows(
    policies: list[dict[str, Any]],
    subject: dict[str, Any],
    peer: dict[str, Any] | None,
    proto: str,
    port: int,
    direction: str,
    dst: dict[str, Any] | None,
) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    applying = []
    for pol in policies:
        spec = pol["spec"]
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        same_namespace = pol["metadata"]["namespace"] == subject["namespace"]
        if direction in types and same_namespace and selector_matches(spec.get("podSelector"), subject["labels"]):
            applying.append(pol)
    if not applying:
        return True  # not isolated in this direction
    for pol in applying:
        for rule in pol["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if peers and not any(_peer_matches(p, peer, pol["metadata"]["namespace"]) for p in peers):
                continue
            if _port_matches(rule.get("ports"), proto, port, dst):
                return True
    return False


def allowed_flows(docs: list[dict[str, Any]]) -> set[tuple[str, str, str, int]]:
    policies = of_kind(docs, "NetworkPolicy")
    endpoints = _endpoints(docs)
    flows = set()
    for src_name, src in endpoints.items():
        for dst_name, dst in endpoints.items():
            if not ((src and src["ours"]) or (dst and dst["ours"])):
                continue  # traffic between outside peers is not ours to police
            for proto, port in PROBED_PORTS:
                ingress = (
                    dst is None or not dst["ours"] or _direction_allows(policies, dst, src, proto, port, "Ingress", dst)
                )
                egress = (
                    src is None or not src["ours"] or _direction_allows(policies, src, dst, proto, port, "Egress", dst)
                )
                if ingress and egress:
                    flows.add((src_name, dst_name, proto, port))
    return flows


def test_network_policies_allow_the_round_lifecycle_and_no_more(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = overlay
    allowed = allowed_flows(docs)
    expected = EXPECTED_FLOWS[name]
    assert expected - allowed == set(), f"{name}: needed flows blocked"
    assert allowed - expected == set(), f"{name}: flows allowed beyond the architecture's"


def test_network_policy_evaluator_sees_an_open_namespace() -> None:
    """Guard for the evaluator itself: without the deny-all policy, everything flows."""
    docs = [d for d in render_overlay("dev") if d["kind"] != "NetworkPolicy"]
    assert ("stranger-elsewhere", "privacy", "TCP", 50053) in allowed_flows(docs)
    assert ("agent", "internet", "TCP", 443) in allowed_flows(docs)


def test_network_policy_evaluator_matches_addresses_by_ip_block() -> None:
    """Guard for the evaluator's ipBlock semantics: an address matches a block it lies in, minus `except`; pods never
    match an ipBlock here, and no pod selector matches an address."""
    docs = render_overlay("site-example")
    policy = find(docs, "NetworkPolicy", "fairfl-site-agent-aggregator")
    (rule,) = policy["spec"]["egress"]
    (peer,) = rule["to"]
    peer["ipBlock"] = {"cidr": "0.0.0.0/0"}
    flows = allowed_flows(docs)
    assert {("agent", "internet", "TCP", 50051), ("agent", "aggregator-address", "TCP", 50051)} <= flows
    peer["ipBlock"]["except"] = [f"{OUTSIDE_ADDRESSES['internet']}/32"]
    flows = allowed_flows(docs)
    assert ("agent", "internet", "TCP", 50051) not in flows and ("agent", "aggregator-address", "TCP", 50051) in flows
    assert not {f for f in flows if f[1] in ("dns", "stranger-in-namespace") and f[3] == 50051}


# ------------------------------------------------------------------------------------------------------ monitoring


def _rules_files() -> list[Path]:
    from deploy.k8s.sync_monitoring import rules_files

    return rules_files(REPO)


def test_generated_monitoring_objects_are_current() -> None:
    from deploy.k8s.sync_monitoring import stale

    assert stale(REPO) == [], "run: python deploy/k8s/sync_monitoring.py"


def _relabel(relabelings: list[dict[str, Any]], labels: dict[str, str]) -> dict[str, str]:
    """Prometheus' `replace` relabeling (the only action the PodMonitor uses)."""
    out = dict(labels)
    for r in relabelings:
        assert r.get("action", "replace") == "replace"
        value = r.get("separator", ";").join(out.get(name, "") for name in r.get("sourceLabels", []))
        match = re.fullmatch(r.get("regex", "(.*)"), value)
        if match:
            template = re.sub(r"\$\{?(\d+)\}?", r"\\\1", r.get("replacement", "$1"))
            out[r["targetLabel"]] = match.expand(template)
    return out


def _scrape_labels(monitor: dict[str, Any], w: Workload) -> dict[str, str]:
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    meta = {f"__meta_kubernetes_pod_label_{re.sub('[^a-zA-Z0-9_]', '_', k)}": v for k, v in w.labels.items()}
    return _relabel(endpoint.get("relabelings", []), {"job": "fairfl/fairfl", **meta})


def test_pod_monitor_scrapes_every_component_on_its_metrics_port() -> None:
    docs = render_overlay("monitoring")
    (monitor,) = of_kind(docs, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    scraped = [w for w in workloads(docs) if selector_matches(monitor["spec"]["selector"], w.labels)]
    assert sorted(w.component for w in scraped) == sorted(COMPONENTS)
    for w in scraped:
        assert container_ports(w.container)[endpoint["port"]] == METRICS_PORTS[w.component]
        labels = _scrape_labels(monitor, w)
        assert labels["job"] == f"fairfl-{w.component}" and labels["component"] == w.component
    for other in ("dev", "gpu", *CENTRAL_OVERLAYS, *SITE_OVERLAYS):
        assert not of_kind(render_overlay(other), "PodMonitor")


def test_prometheus_scrape_targets_match_the_metrics_ports() -> None:
    """deploy/prometheus/prometheus.yml (a local run's Prometheus) and the cluster's PodMonitor scrape the same jobs,
    with the same labels; the cluster's targets are the containers' fixed metrics ports."""
    path = REPO / "deploy" / "prometheus" / "prometheus.yml"
    assert path.is_file(), "deploy/prometheus/prometheus.yml is missing"
    local_jobs = {job["job_name"]: job for job in yaml.safe_load(path.read_text())["scrape_configs"]}
    docs = render_overlay("monitoring")
    (monitor,) = of_kind(docs, "PodMonitor")
    cluster = {_scrape_labels(monitor, w)["job"]: w for w in workloads(docs)}
    assert sorted(cluster) == sorted(local_jobs), "the same job names locally and in the cluster"
    for job, w in cluster.items():
        assert env_of(w.container)["FAIRFL_METRICS_PORT"] == str(METRICS_PORTS[w.component])
        for static in local_jobs[job].get("static_configs", []):
            for target in static.get("targets", []):
                assert int(str(target).rpartition(":")[2]) == METRICS_PORTS[w.component], (job, target)
            assert static.get("labels", {}).get("component", w.component) == w.component
        for sd in local_jobs[job].get("file_sd_configs", []):  # written by the local launcher, one file per component
            assert all(Path(f).stem == w.component for f in sd["files"]), (job, sd["files"])


def test_prometheus_rules_equal_deploy_prometheus() -> None:
    files = _rules_files()
    assert files, "deploy/prometheus has no rules files"
    rules = {
        r["metadata"]["annotations"]["fairfl.io/source"]: r
        for r in of_kind(render_overlay("monitoring"), "PrometheusRule")
    }
    assert sorted(rules) == sorted(str(p.relative_to(REPO)) for p in files)
    for path in files:
        assert rules[str(path.relative_to(REPO))]["spec"]["groups"] == yaml.safe_load(path.read_text())["groups"]


def test_grafana_dashboards_equal_deploy_grafana() -> None:
    files = sorted((REPO / "deploy" / "grafana" / "dashboards").glob("*.json"))
    assert files, "deploy/grafana/dashboards has no dashboards"
    maps = [
        m for m in of_kind(render_overlay("monitoring"), "ConfigMap") if "grafana_dashboard" in m["metadata"]["labels"]
    ]
    by_source = {m["metadata"]["annotations"]["fairfl.io/source"]: m for m in maps}
    assert sorted(by_source) == sorted(str(p.relative_to(REPO)) for p in files)
    for path in files:
        assert by_source[str(path.relative_to(REPO))]["data"] == {path.name: path.read_text()}
        json.loads(path.read_text())


def test_monitoring_pipeline_on_sample_sources(tmp_path: Path) -> None:
    """The generator and the overlay on a copy of deploy/ with sample rules and a dashboard: what lands in the
    cluster is exactly what the files say (independent of whether the real files exist yet)."""
    from deploy.k8s import sync_monitoring

    shutil.copytree(REPO / "deploy" / "k8s", tmp_path / "deploy" / "k8s")
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    (tmp_path / "deploy" / "grafana" / "dashboards").mkdir(parents=True)
    rules = {
        "groups": [
            {
                "name": "fairfl.sample",
                "rules": [
                    {"record": "fairfl:rounds:rate5m", "expr": "sum by (job) (\n  rate(fairfl_rounds_total[5m])\n)"},
                    {
                        "alert": "FairFLDown",
                        "expr": 'up{job=~"aggregator|clustering|privacy"} == 0',
                        "for": "5m",
                        "labels": {"severity": "critical"},
                        "annotations": {"summary": "{{ $labels.job }} is down"},
                    },
                ],
            }
        ]
    }
    (tmp_path / "deploy" / "prometheus" / "fairfl-rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "deploy" / "prometheus" / "prometheus.yml").write_text("scrape_configs: []\n")  # not a rules file
    dashboard = '{\n  "title": "FairFL",\n  "panels": []\n}\n'
    (tmp_path / "deploy" / "grafana" / "dashboards" / "fairfl-overview.json").write_text(dashboard)
    for rel, text in sync_monitoring.render(tmp_path).items():
        (tmp_path / rel).write_text(text)
    assert sync_monitoring.stale(tmp_path) == []
    docs = render(tmp_path / "deploy" / "k8s" / "overlays" / "monitoring")
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["metadata"]["name"] == "fairfl-rules" and rule["metadata"]["namespace"] == NAMESPACE
    assert rule["spec"]["groups"] == rules["groups"]
    (board,) = [m for m in of_kind(docs, "ConfigMap") if m["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert board["data"] == {"fairfl-overview.json": dashboard}
    (tmp_path / "deploy" / "grafana" / "dashboards" / "second.json").write_text("{}")
    assert sync_monitoring.stale(tmp_path) == [sync_monitoring.DASHBOARDS_OUT]


def test_docs_cover_the_deployment() -> None:
    text = (REPO / "docs" / "deploy.md").read_text()
    for needle in (
        "kind",
        "minikube",
        "kubectl apply -k deploy/k8s/overlays/dev",
        "fairfl run /etc/fairfl/experiment.yaml --aggregator 127.0.0.1:50051",
        "kubectl -n fairfl scale statefulset fairfl-agent",
        "deploy/k8s/overlays/gpu",
        "grafana",
        "python deploy/k8s/sync_monitoring.py",
        "--target runtime-cuda",
        "fairfl certs",
        "create secret generic fairfl-tls-",
        # one agent per site
        "## 6. One agent per site",
        "--agent site-a=0-49",
        "kubectl apply -k deploy/k8s/overlays/central",
        "cp -r deploy/k8s/overlays/site-example",
        "data-pvc.yaml",
        "kubectl -n fairfl logs -f statefulset/fairfl-site-agent",
        "fairfl runs watch",
        "fairfl model fetch",
    ):
        assert needle.lower() in text.lower(), needle
    # A site's own copy of the example (`cp -r deploy/k8s/overlays/site-example DEST`) exists only at the site.
    copies = re.findall(r"cp -r deploy/k8s/overlays/site-example (\S+)", text)
    for match in re.finditer(r"deploy/k8s/[\w/.-]+", text):
        path = match.group(0).rstrip(".")
        if any(path == c or path.startswith(c + "/") or c.startswith(path + "/") for c in copies):
            continue
        assert (REPO / path).exists(), match.group(0)
    for copy in copies:  # where kustomize still finds the component from
        assert (REPO / copy / "../../components/site-agent").resolve() == (K8S / "components" / "site-agent")
