"""A small stand-in for the API server's CRD validation: structural checks, defaulting, OpenAPI, CEL.

The API server applies a structural schema in this order: defaults, then the OpenAPI validation, then the
x-kubernetes-validations CEL rules. Here the OpenAPI part is checked with jsonschema (after turning the
Kubernetes dialect into JSON Schema) and the CEL rules with cel-python, each rule on its node with
``self`` bound, the way the API server reports them: ``spec.redis: set exactly one of ...``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "adaserve.io_adaservedeployments.yaml"
EXAMPLE_PATH = ROOT / "examples" / "adaserve-deployment.yaml"

# keywords a structural schema may not use (apiextensions.k8s.io/v1 rejects the CRD otherwise)
FORBIDDEN = {"$ref", "definitions", "dependencies", "patternProperties", "additionalItems", "id", "$schema"}
_CEL = celpy.Environment()
# a workerPod that sets every field of the pod override (tests of the CRD, the builders and the operator)
FULL_POD = {
    "annotations": {"sidecar.istio.io/inject": "false"},
    "labels": {"team": "search"},
    "nodeSelector": {"cloud.example.com/gpu-pool": "h100"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                     "tolerationSeconds": 300}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100,
                 "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                     "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}}}}]}},
    "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                   "whenUnsatisfiable": "ScheduleAnyway"}],
    "imagePullSecrets": [{"name": "registry"}],
    "priorityClassName": "inference-high",
    "runtimeClassName": "nvidia",
    "serviceAccountName": "llm",
    "env": [{"name": "NCCL_DEBUG", "value": "WARN"},
            {"name": "ADASERVE_MAX_ACTIVE_REQUESTS", "value": "128"},
            {"name": "HF_HOME", "valueFrom": {"configMapKeyRef": {"name": "paths", "key": "hf"}}}],
    "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                {"name": "certs", "secret": {"secretName": "certs"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                     {"name": "certs", "mountPath": "/certs", "subPath": "tls"}],
}


def load_crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def openapi_schema(crd: dict[str, Any] | None = None) -> dict[str, Any]:
    crd = crd or load_crd()
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def structural_problems(node: dict[str, Any], path: str = "") -> Iterator[str]:
    """What makes the schema non-structural, or undocumented (every field must say what it is)."""
    for key in FORBIDDEN & node.keys():
        yield f"{path or '<root>'}: forbidden keyword {key}"
    if node.get("uniqueItems"):
        yield f"{path}: uniqueItems: true is forbidden"
    if "properties" in node and "additionalProperties" in node:
        yield f"{path}: properties and additionalProperties together"
    int_or_string = node.get("x-kubernetes-int-or-string")
    if "type" not in node and not int_or_string and not node.get("x-kubernetes-preserve-unknown-fields"):
        yield f"{path or '<root>'}: no type"
    if "description" not in node:
        yield f"{path or '<root>'}: no description"
    for branch in node.get("anyOf", []) + node.get("allOf", []) + node.get("oneOf", []):
        # inside a logical junctor only value validations; int-or-string's anyOf of the two types is the exception
        extra = set(branch) - ({"type"} if int_or_string else set()) - {
            "minimum", "maximum", "pattern", "enum", "minLength", "maxLength", "format", "required"}
        if extra:
            yield f"{path}: {sorted(extra)} inside anyOf/allOf/oneOf"
    for name, child in (node.get("properties") or {}).items():
        yield from structural_problems(child, f"{path}.{name}" if path else name)
    if isinstance(node.get("items"), dict):
        yield from structural_problems(node["items"], f"{path}[]")


def to_json_schema(node: Any) -> Any:
    """openAPIV3Schema -> JSON Schema: drop x-kubernetes-*, turn ``nullable`` into a null type and OpenAPI 3.0's
    boolean exclusiveMinimum/Maximum into JSON Schema's numeric ones."""
    if isinstance(node, list):
        return [to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), bool):  # OpenAPI 3.0's boolean flag; JSON Schema's is the bound itself
            del out[exclusive]
            if node[exclusive]:
                out[exclusive] = out.pop(bound)
    if "properties" in node:  # property names are not keywords: keep them all
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
    return out


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Fill ``default`` values in, depth first, as the API server does before it validates."""
    obj = copy.deepcopy(obj)

    def walk(node: dict[str, Any], value: Any) -> None:
        if isinstance(value, dict):
            for name, child in (node.get("properties") or {}).items():
                if name not in value and "default" in child:
                    value[name] = copy.deepcopy(child["default"])
                if name in value:
                    walk(child, value[name])
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                walk(node["items"], item)

    walk(schema, obj)
    return obj


def cel_errors(node: dict[str, Any], value: Any, path: str = "") -> Iterator[str]:
    """Every x-kubernetes-validations rule that fails, as ``path: message``."""
    for rule in node.get("x-kubernetes-validations", []):
        program = _CEL.program(_CEL.compile(rule["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(value)})
        if isinstance(result, celpy.CELEvalError) or not bool(result):
            yield f"{path}{rule.get('fieldPath', '')}: {rule['message']}"
    if isinstance(value, dict):
        for name, child in (node.get("properties") or {}).items():
            if name in value:
                yield from cel_errors(child, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            yield from cel_errors(node["items"], item, f"{path}[{i}]")


def validate(obj: dict[str, Any], crd: dict[str, Any] | None = None) -> list[str]:
    """The API server's verdict on creating ``obj``: [] if accepted, else readable errors."""
    schema = openapi_schema(crd)
    obj = apply_defaults(schema, obj)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = [f"{_path(e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    if errors:  # the API server runs CEL only on objects that pass the schema
        return sorted(errors)
    return list(cel_errors(schema, obj))


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out
