"""Regenerate the vendored JSON schemas of the custom resources brisk's manifests use.

The schemas come from the CRDs of KEDA and the Prometheus operator, as published in the `cloudcoil-models-keda`
and `cloudcoil-models-prometheus-operator` PyPI packages (pydantic models generated from those CRDs). CRDs are
structural: an unknown field is pruned by the API server (or refused by `kubectl apply --validate=strict`), so
every object schema here is closed (`additionalProperties: false`) to catch a misspelt field the same way.

    pip install --target /tmp/crd cloudcoil-models-keda==2.16.1.0 cloudcoil-models-prometheus-operator==0.80.1.0
    PYTHONPATH=/tmp/crd python deploy/k8s/schemas/generate.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def close_objects(schema: Any) -> Any:
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            close_objects(value)
    elif isinstance(schema, list):
        for value in schema:
            close_objects(value)
    return schema


def main() -> None:
    from cloudcoil.models.keda import v1alpha1 as keda
    from cloudcoil.models.prometheus_operator import v1 as monitoring

    models = {
        "scaledobject-keda-v1alpha1.json": keda.ScaledObject,
        "servicemonitor-monitoring-v1.json": monitoring.ServiceMonitor,
        "podmonitor-monitoring-v1.json": monitoring.PodMonitor,
    }
    for filename, model in models.items():
        schema = close_objects(model.model_json_schema(by_alias=True))
        (HERE / filename).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
