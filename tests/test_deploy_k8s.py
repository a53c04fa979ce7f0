"""deploy/k8s: every manifest valid against the Kubernetes schemas (CRDs: KEDA and Prometheus operator schemas
vendored in deploy/k8s/schemas), kustomizations complete, the drain fits the grace period, and every metric a
manifest names is one brisk exports."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from brisk.server.metrics import ServerMetrics
from brisk.server.shutdown import ABORT_GRACE_S

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (dev extra) is not installed"
)

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # oldest release the manifests target (native sidecars, autoscaling/v2, policy/v1)
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring-v1.json",
}
MANIFESTS = sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def validate(doc: dict) -> None:
    """Raise if `doc` is not a valid object of its kind (strict: unknown fields are errors)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CRD_SCHEMAS:
        schema = json.loads((K8S / "schemas" / CRD_SCHEMAS[key]).read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid(path: Path) -> None:
    docs = _documents(path)
    assert docs
    for doc in docs:
        validate(doc)


@pytest.mark.parametrize(
    ("path", "break_it"),
    [
        ("base/deployment.yaml", lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriod=1)),
        ("base/deployment.yaml", lambda d: d["spec"].update(replicas="two")),
        ("keda/scaledobject.yaml", lambda d: d["spec"].update(trigers=d["spec"].pop("triggers"))),
        ("base/servicemonitor.yaml", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
    ],
)
def test_validation_catches_broken_manifests(path: str, break_it) -> None:
    doc = copy.deepcopy(_documents(K8S / path)[0])
    break_it(doc)
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(doc)


def _kustomize_kinds(directory: Path) -> list[str]:
    """The kinds a kustomization builds, following bases; fails on a resource that does not exist."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert spec["kind"] == "Kustomization"
    kinds = []
    for resource in spec["resources"]:
        target = directory / resource
        assert target.exists(), f"{directory}: {resource} does not exist"
        kinds += _kustomize_kinds(target) if target.is_dir() else [d["kind"] for d in _documents(target)]
    return kinds


def test_kustomizations_name_existing_files_and_one_autoscaler_each() -> None:
    built = {k.parent.name: _kustomize_kinds(k.parent) for k in K8S.rglob("kustomization.yaml")}
    assert set(built) == {"base", "keda", "hpa"}
    for name, kinds in built.items():
        assert {"Deployment", "Service", "PodDisruptionBudget", "ServiceMonitor"} <= set(kinds), name
    assert [k for k in built["keda"] if k in ("ScaledObject", "HorizontalPodAutoscaler")] == ["ScaledObject"]
    assert [k for k in built["hpa"] if k in ("ScaledObject", "HorizontalPodAutoscaler")] == ["HorizontalPodAutoscaler"]


def test_drain_fits_in_the_grace_period() -> None:
    pod = _documents(K8S / "base" / "deployment.yaml")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    shutdown_timeout = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + shutdown_timeout + ABORT_GRACE_S
    assert needed <= pod["terminationGracePeriodSeconds"] <= needed + 30
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in container and container["resources"]["limits"]["nvidia.com/gpu"]


def test_every_referenced_metric_is_exported() -> None:
    exported = ServerMetrics("m").exported_names()
    referenced = {
        name
        for path in MANIFESTS
        for line in path.read_text().splitlines()
        if not line.strip().startswith("image:")  # brisk:cuda is an image tag
        for name in re.findall(r"brisk:[A-Za-z0-9_:]+", line)
    }
    assert referenced, "the manifests reference no brisk metric"
    assert referenced <= exported, f"not exported by brisk: {sorted(referenced - exported)}"
    assert {"brisk:num_requests_waiting", "brisk:time_to_first_token_seconds_bucket"} <= referenced
