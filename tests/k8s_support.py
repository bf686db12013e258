"""Shared by the Kubernetes and Dockerfile tests: render kustomize overlays, walk the rendered objects, parse the
Dockerfile. Rendering needs `kubectl` (with its built-in kustomize); tests skip only when it is absent."""

from __future__ import annotations

import functools
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
# The whole federation in one cluster (the demo: every component, the agents simulate clients from the image's
# Fashion-MNIST). tests/unit/test_dockerfile.py checks these against the image.
OVERLAYS = ("dev", "gpu", "monitoring")
# A real federation, split: the federation's services for agents at the sites, and one site's agent.
CENTRAL_OVERLAYS = ("central",)
SITE_OVERLAYS = ("site-example",)
ALL_OVERLAYS = (*OVERLAYS, *CENTRAL_OVERLAYS, *SITE_OVERLAYS)
SITE_EXAMPLE = K8S / "overlays" / "site-example"
# Applied on their own, never by the site's kustomization (deleting the agent's deployment must not delete the data).
SITE_STANDALONE = (SITE_EXAMPLE / "data-pvc.yaml", SITE_EXAMPLE / "data-loader.yaml")
SITE_DATA_MOUNT = "/var/lib/fairfl/data"  # where a site agent's data volume is mounted, read-only
# The Kubernetes version the manifests are validated against (kubernetes-validate's OpenAPI schemas, strict):
# the oldest that docs/deploy.md supports, and the newest the installed kubernetes-validate bundles.
KUBERNETES_VERSION = "1.25"
NAMESPACE = "fairfl"
COMPONENT_LABEL = "app.kubernetes.io/component"
PART_OF = {"app.kubernetes.io/part-of": "fairfl"}

# The fixed ports every manifest, scrape config and dashboard agrees on.
GRPC_PORTS = {"aggregator": 50051, "clustering": 50052, "privacy": 50053}
# Plaintext grpc.health.v1 only, for kubelet gRPC probes (the gRPC ports speak mutual TLS).
HEALTH_PORTS = {"aggregator": 50061, "clustering": 50062, "privacy": 50063}
TLS_MOUNT = "/etc/fairfl-tls"
METRICS_PORTS = {"aggregator": 9091, "clustering": 9092, "privacy": 9093, "agent": 9094}
COMPONENTS = ("aggregator", "clustering", "privacy", "agent")
SERVICE_COMPONENTS = ("aggregator", "clustering", "privacy")


def overlay_components(name: str) -> set[str]:
    """The components an overlay (or `base`) deploys."""
    if name in CENTRAL_OVERLAYS:
        return set(SERVICE_COMPONENTS)
    if name in SITE_OVERLAYS:
        return {"agent"}
    return set(COMPONENTS)


WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "ReplicaSet", "Pod"}


MIN_KUBECTL = (1, 27)  # kustomize v5 (components, `labels`), native gRPC probes


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not installed")
    _check_version(path)
    return path


@functools.cache
def _check_version(path: str) -> None:
    proc = subprocess.run([path, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=30)
    version = json.loads(proc.stdout)["clientVersion"]
    found = (int(version["major"]), int(re.sub(r"\D.*", "", version["minor"])))
    assert found >= MIN_KUBECTL, f"kubectl {found} is too old to render deploy/k8s: install {MIN_KUBECTL} or newer"


@functools.cache
def _render_text(directory: str) -> str:
    proc = subprocess.run([kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return proc.stdout


def render(directory: Path | str) -> list[dict[str, Any]]:
    """The objects `kubectl kustomize <directory>` renders (fresh copies; safe to modify)."""
    return [doc for doc in yaml.safe_load_all(_render_text(str(directory))) if doc]


def render_overlay(name: str) -> list[dict[str, Any]]:
    return render(K8S / "overlays" / name)


def load_manifest(path: Path) -> list[dict[str, Any]]:
    """The objects of a plain manifest file (one applied with `kubectl apply -f`)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise AssertionError(f"no {kind} {name!r} rendered")


@dataclass
class Workload:
    kind: str
    name: str
    obj: dict[str, Any]

    @property
    def template(self) -> dict[str, Any]:
        return self.obj["spec"]["template"]

    @property
    def pod_spec(self) -> dict[str, Any]:
        return self.template["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.template["metadata"].get("labels", {})

    @property
    def component(self) -> str:
        return self.labels.get(COMPONENT_LABEL, "")

    @property
    def replicas(self) -> int:
        return int(self.obj["spec"].get("replicas", 1))

    @property
    def containers(self) -> list[dict[str, Any]]:
        return self.pod_spec["containers"]

    @property
    def container(self) -> dict[str, Any]:
        (only,) = self.containers
        return only


def workloads(docs: list[dict[str, Any]]) -> list[Workload]:
    return [Workload(d["kind"], d["metadata"]["name"], d) for d in docs if d.get("kind") in WORKLOAD_KINDS]


def by_component(docs: list[dict[str, Any]]) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for w in workloads(docs):
        assert w.component not in out, f"two workloads for component {w.component}"
        out[w.component] = w
    return out


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """Plain `value` environment entries (the manifests use no valueFrom for FairFL settings)."""
    out = {}
    for entry in container.get("env", []):
        assert "value" in entry, f"{container['name']}: env {entry['name']} must be a literal value"
        out[entry["name"]] = str(entry["value"])
    return out


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports", [])}


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels and matchExpressions); an empty selector matches all."""
    if selector is None:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Service's plain selector map."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


_SUFFIX = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity as a number (cores or bytes)."""
    text = str(value)
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    assert match and match.group(2) in ("", *_SUFFIX), f"bad quantity {text!r}"
    return float(match.group(1)) * _SUFFIX.get(match.group(2), 1.0)


# --------------------------------------------------------------------------------------------------------- Dockerfile


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, op: str) -> list[str]:
        return [arg for o, arg in self.instructions if o == op]

    def last(self, op: str) -> str | None:
        found = self.all(op)
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for arg in self.all("ENV"):
            for token in shlex.split(arg):
                key, _, value = token.partition("=")
                out[key] = value
        return out

    def exec_form(self, op: str) -> list[str] | None:
        arg = self.last(op)
        return None if arg is None else json.loads(arg)

    def copies(self) -> list[tuple[dict[str, str], list[str], str]]:
        """(flags, sources, destination) of every COPY."""
        out = []
        for arg in self.all("COPY"):
            words = shlex.split(arg)
            flags = dict(w[2:].split("=", 1) for w in words if w.startswith("--"))
            paths = [w for w in words if not w.startswith("--")]
            out.append((flags, paths[:-1], paths[-1]))
        return out


@dataclass
class Dockerfile:
    args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise AssertionError(f"Dockerfile has no stage {name!r}")

    def resolve(self, text: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: self.args.get(m.group(1) or m.group(2), m.group(0)), text)

    def root_image(self, name: str) -> str:
        """The external image a stage is ultimately built FROM."""
        base = self.stage(name).base
        names = {s.name for s in self.stages}
        return self.root_image(base) if base in names else self.resolve(base)


def parse_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op, rest = op.upper(), rest.strip()
        if op == "FROM":
            words = rest.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else ""
            stages.append(Stage(words[0], name))
        elif op == "ARG" and not stages:
            key, _, value = rest.partition("=")
            args[key] = value
        else:
            assert stages, f"instruction before FROM: {line}"
            stages[-1].instructions.append((op, rest))
    return Dockerfile(args, stages)
