"""Every object deploy/k8s renders is valid Kubernetes: checked against the OpenAPI schemas of the Kubernetes version
docs/deploy.md names (KUBERNETES_VERSION, the oldest supported) and of the newest version the installed
kubernetes-validate bundles, in strict mode (unknown fields are errors, as `kubectl apply --validate=strict` makes
them). Offline: the schemas ship with the package.

Custom resources (the Prometheus Operator's PodMonitor and PrometheusRule) have no built-in schema. They are not
skipped: their metadata is validated as ObjectMeta, and their spec by the tests CUSTOM_RESOURCES names (which build
them from, and compare them with, deploy/prometheus and the workloads' ports). A custom resource kind without such
checks fails here.

Skips only when kubectl is absent (rendering needs it).
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

from tests.integration import test_k8s_manifests
from tests.k8s_support import (
    ALL_OVERLAYS,
    K8S,
    KUBERNETES_VERSION,
    REPO,
    SITE_STANDALONE,
    load_manifest,
    render,
)

pytestmark = pytest.mark.integration

NEWEST = major_minor(all_versions()[-1])
VERSIONS = tuple(dict.fromkeys((KUBERNETES_VERSION, NEWEST)))

# (apiVersion, kind) -> the tests in tests/integration/test_k8s_manifests.py that check its spec instead of a schema.
CUSTOM_RESOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): (
        "test_pod_monitor_scrapes_every_component_on_its_metrics_port",
        "test_prometheus_scrape_targets_match_the_metrics_ports",
    ),
    ("monitoring.coreos.com/v1", "PrometheusRule"): (
        "test_prometheus_rules_equal_deploy_prometheus",
        "test_generated_monitoring_objects_are_current",
        "test_monitoring_pipeline_on_sample_sources",
    ),
}

SOURCES = [
    ("base", K8S / "base"),
    *((f"overlays/{name}", K8S / "overlays" / name) for name in ALL_OVERLAYS),
]


def _objects(label: str) -> list[dict[str, Any]]:
    if label.endswith(".yaml"):  # a manifest applied on its own (`kubectl apply -f`)
        return load_manifest(REPO / label)
    return render(dict(SOURCES)[label])


def _describe(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')} {obj.get('metadata', {}).get('name')}"


def _validate(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = "/".join(str(p) for p in err.absolute_path)
        pytest.fail(f"{_describe(obj)} is not valid Kubernetes {version} at {path or '/'}: {err.message}")


def _validate_metadata(obj: dict[str, Any], version: str) -> None:
    """A custom resource's metadata, checked as the ObjectMeta it is (wrapped in an object whose schema is known)."""
    _validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}, version)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("label", [label for label, _ in SOURCES] + [str(p.relative_to(REPO)) for p in SITE_STANDALONE])
def test_every_object_is_valid_kubernetes(label: str, version: str) -> None:
    objects = _objects(label)
    assert objects, f"{label} renders nothing"
    custom = []
    for obj in objects:
        try:
            _validate(obj, version)
        except kubernetes_validate.SchemaNotFoundError:
            key = (obj["apiVersion"], obj["kind"])
            assert key in CUSTOM_RESOURCES, (
                f"{label}: {_describe(obj)} ({obj['apiVersion']}) has no Kubernetes {version} schema and no checks "
                "in CUSTOM_RESOURCES"
            )
            _validate_metadata(obj, version)
            custom.append(key)
    if label == "overlays/monitoring":  # the one overlay with custom resources: all of them really met
        assert set(custom) == set(CUSTOM_RESOURCES)
    else:
        assert not custom, (label, custom)


def test_custom_resources_are_checked_by_named_tests() -> None:
    for key, names in CUSTOM_RESOURCES.items():
        for name in names:
            assert callable(getattr(test_k8s_manifests, name, None)), f"{key}: no test {name} in test_k8s_manifests"


def test_the_validator_rejects_what_kubernetes_rejects() -> None:
    """Guard: strict validation catches a misspelt field, a wrong type and a missing required field."""
    (agent,) = [o for o in render(K8S / "overlays" / "site-example") if o["kind"] == "StatefulSet"]
    _validate(agent, KUBERNETES_VERSION)
    container = agent["spec"]["template"]["spec"]["containers"][0]
    container["readinessprobe"] = container["readinessProbe"]  # misspelt: an unknown field in strict mode
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(agent, KUBERNETES_VERSION, strict=True)
    del container["readinessprobe"]
    volume = agent["spec"]["template"]["spec"]["volumes"][1]
    claim = volume["persistentVolumeClaim"]
    volume["persistentVolumeClaim"] = {"readOnly": True}  # claimName is required
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(agent, KUBERNETES_VERSION, strict=True)
    volume["persistentVolumeClaim"] = claim
    container["ports"][0]["containerPort"] = "metrics"  # an integer field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(agent, KUBERNETES_VERSION, strict=True)


def test_docs_name_the_validated_version() -> None:
    """docs/deploy.md names the Kubernetes version the schemas are checked at, and the installed package has it."""
    text = (REPO / "docs" / "deploy.md").read_text()
    assert f"Kubernetes {KUBERNETES_VERSION} or newer" in text
    assert KUBERNETES_VERSION in {major_minor(v) for v in all_versions()}, "kubernetes-validate lacks the schemas"
    named = re.findall(r"Kubernetes (\d+\.\d+) or newer", text)
    assert set(named) == {KUBERNETES_VERSION}, f"docs/deploy.md names {named}; the schemas checked are {VERSIONS}"


def test_standalone_manifests_are_not_rendered_by_the_overlay() -> None:
    """The site's data claim and loader are applied on their own: `kubectl delete -k` of the site never deletes data."""
    rendered = {(o["kind"], o["metadata"]["name"]) for o in render(K8S / "overlays" / "site-example")}
    for path in SITE_STANDALONE:
        for obj in load_manifest(path):
            assert (obj["kind"], obj["metadata"]["name"]) not in rendered, path
    kustomization = yaml.safe_load((K8S / "overlays" / "site-example" / "kustomization.yaml").read_text())
    assert not {p.name for p in SITE_STANDALONE} & set(kustomization.get("resources", []))
