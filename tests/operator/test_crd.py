"""The CRD: structural and documented, the example accepted, bad specs refused with readable messages.

Every bad spec is also refused by the operator's own parser (adaserve/operator/spec.py), at the same
field and, for the CEL rules, in the same words: on a cluster without CEL the user sees the same error
in the resource's status.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from typing import Any

import celpy
import pytest
import yaml

from adaserve.operator import names, spec
from adaserve.operator.builders import gateway_deployment, worker_deployment, worker_env
from adaserve.operator.spec import SpecError, parse_spec
from tests.operator.schema import (
    EXAMPLE_PATH,
    FULL_POD,
    apply_defaults,
    load_crd,
    openapi_schema,
    structural_problems,
    validate,
)


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return load_crd()


@pytest.fixture
def example() -> dict[str, Any]:
    return yaml.safe_load(EXAMPLE_PATH.read_text())


def test_schema_is_structural_and_every_field_is_described(crd: dict[str, Any]) -> None:
    assert list(structural_problems(openapi_schema(crd))) == []


def test_names_subresources_and_columns(crd: dict[str, Any]) -> None:
    s = crd["spec"]
    assert crd["metadata"]["name"] == f"{names.PLURAL}.{names.GROUP}"
    assert (s["group"], s["scope"]) == ("adaserve.io", "Namespaced")
    assert s["names"]["kind"] == "AdaServeDeployment" and s["names"]["shortNames"] == ["asd"]
    assert [v["name"] for v in s["versions"]] == ["v1alpha1"]
    version = s["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    assert version["subresources"]["scale"]["statusReplicasPath"] == ".status.replicas"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Phase": ".status.phase", "Ready": ".status.readyWorkers", "Replicas": ".spec.replicas",
                       "Gateway": ".status.gatewayUrl", "Age": ".metadata.creationTimestamp"}


def _rules(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = list(node.get("x-kubernetes-validations", []))
    for child in (node.get("properties") or {}).values():
        out += _rules(child)
    if isinstance(node.get("items"), dict):
        out += _rules(node["items"])
    return out


def test_every_cel_rule_compiles_and_has_a_message(crd: dict[str, Any]) -> None:
    rules = _rules(openapi_schema(crd))
    env = celpy.Environment()
    for rule in rules:
        env.compile(rule["rule"])
        assert rule.get("message"), rule["rule"]
    # one rule per check the operator mirrors, in the same words: no rule the parser lacks, nor the reverse;
    # workerPod and gateway.pod share one schema (a YAML anchor), so its rules come twice
    props = openapi_schema(crd)["properties"]["spec"]["properties"]
    assert props["gateway"]["properties"]["pod"] == props["workerPod"]
    pod_rules = [r["message"] for r in _rules(props["workerPod"])]
    assert sorted(r["message"] for r in rules) == sorted(
        [*(v for k, v in vars(spec).items() if k.startswith("MSG_")), *pod_rules])


def test_example_is_accepted_by_the_crd_and_the_operator(crd: dict[str, Any], example: dict[str, Any]) -> None:
    assert validate(example, crd) == []
    parsed = parse_spec(example["spec"])
    assert parsed.replicas == 2 and parsed.default_class == "chat" and parsed.redis.managed


def test_minimal_spec_gets_the_defaults(crd: dict[str, Any]) -> None:
    minimal = {"apiVersion": "adaserve.io/v1alpha1", "kind": "AdaServeDeployment", "metadata": {"name": "m"},
               "spec": {"model": {"target": "/m/t", "draft": "/m/d"}, "image": "w", "gateway": {"image": "g"},
                        "sloClasses": [{"name": "chat", "tpotMs": 50}], "redis": {"url": "redis://r:6379/0"}}}
    assert validate(minimal, crd) == []
    s = parse_spec(minimal["spec"])
    assert (s.replicas, s.resources.gpus_per_worker, s.speculation.budget, s.gateway.port) == (1, 1, "auto", 80)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation of the example's spec: ``_set("sloClasses[1].tpotMs", 0)``; value ... deletes."""
    def mutate(s: dict[str, Any]) -> None:
        parts = path.replace("[", ".").replace("]", "").split(".")
        node: Any = s
        for p in parts[:-1]:
            node = node[int(p)] if p.isdigit() else node[p]
        last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
        if value is ...:
            del node[last]
        else:
            node[last] = value
    return mutate


def _dup_class(s: dict[str, Any]) -> None:
    s["sloClasses"].append({"name": "chat", "tpotMs": 70})


def _drafts(*drafts: str, policy: str | None = None) -> Callable[[dict[str, Any]], None]:
    """The example with ``model.drafts`` instead of its one draft (and ``policy`` if given)."""
    def mutate(s: dict[str, Any]) -> None:
        del s["model"]["draft"]
        s["model"]["drafts"] = list(drafts)
        if policy is not None:
            s["speculation"]["policy"] = policy
    return mutate


def _builtin(**model: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(s: dict[str, Any]) -> None:
        s["model"] = {"source": "builtin", "target": "smollm2-135m-instruct", **model}
    return mutate


# (mutation, the API server's error) for the CEL rules: the operator must say exactly the same
CEL_CASES = [
    (_dup_class, f"spec.sloClasses: {spec.MSG_UNIQUE_CLASSES}"),
    (_set("sloClasses[1].tpotMs", 0), f"spec.sloClasses[1].tpotMs: {spec.MSG_TPOT}"),
    (_set("sloClasses[1].tpotMs", -5), f"spec.sloClasses[1].tpotMs: {spec.MSG_TPOT}"),
    (_set("sloClasses[0].ttftMs", 0), f"spec.sloClasses[0].ttftMs: {spec.MSG_TTFT}"),
    (_set("defaultSloClass", "batch"), f"spec.defaultSloClass: {spec.MSG_DEFAULT_CLASS}"),
    (_set("redis", {"managed": True, "url": "redis://r:6379/0"}), f"spec.redis: {spec.MSG_REDIS_ONE}"),
    (_set("redis", {}), f"spec.redis: {spec.MSG_REDIS_ONE}"),
    (_set("redis", {"managed": False}), f"spec.redis: {spec.MSG_REDIS_ONE}"),
    (_set("speculation.budget", "lots"), f"spec.speculation.budget: {spec.MSG_BUDGET}"),
    (_set("speculation.budget", 0), f"spec.speculation.budget: {spec.MSG_BUDGET}"),
    (_set("model.pvc", ...), f"spec.model: {spec.MSG_PVC}"),
    (_set("model.source", "image"), f"spec.model: {spec.MSG_PVC}"),
    (_set("model.hub", {"tokenSecret": {"name": "hf-token"}}), f"spec.model: {spec.MSG_HUB}"),  # source pvc
    (_set("model.hub", {}), f"spec.model: {spec.MSG_HUB}"),
    (_set("model.target", "models/llama"), f"spec.model: {spec.MSG_TARGET_PATH}"),
    (_set("model.draft", ...), f"spec.speculation.policy: {spec.MSG_DRAFT}"),
    (_set("model.drafts", ["/models/a", "/models/b"]), f"spec.model: {spec.MSG_DRAFT_OR_DRAFTS}"),
    (_drafts("/models/a", "models/b"), f"spec.model: {spec.MSG_TARGET_PATH}"),
    (_drafts("/models/a", "/models/a"), f"spec.model.drafts: {spec.MSG_UNIQUE_DRAFTS}"),
    (_drafts("/models/a", "/models/b", policy="spin@d2"), f"spec.speculation.policy: {spec.MSG_PINNED_DRAFT}"),
    (_builtin(drafts=["smollm2-draft", "/models/x"]), f"spec.model: {spec.MSG_BUILTIN_DRAFTS}"),
    (_builtin(target="demo-tiny", drafts=["smollm2-draft"]), f"spec.model: {spec.MSG_BUILTIN_DRAFTS}"),
    # one rank per GPU: more ranks than GPUs (the example has one), or fewer, which would leave GPUs idle
    (_set("resources.tensorParallelSize", 4), f"spec.resources.tensorParallelSize: {spec.MSG_TENSOR_PARALLEL}"),
    (_set("resources", {"gpusPerWorker": 4, "tensorParallelSize": 2}),
     f"spec.resources.tensorParallelSize: {spec.MSG_TENSOR_PARALLEL}"),
    (_set("resources", {"kvMemory": "8Gi", "kvMemoryFraction": 0.8}), f"spec.resources: {spec.MSG_KV_MEMORY}"),
    (_set("resources.requests", {"memory": "8Gi"}), f"spec.resources: {spec.MSG_OWN_RESOURCES}"),
    (_set("resources.limits", {"ephemeral-storage": "20Gi", "nvidia.com/gpu": 2}),
     f"spec.resources: {spec.MSG_OWN_RESOURCES}"),
    (_set("disruptionBudget", {}), f"spec.disruptionBudget: {spec.MSG_DISRUPTION_BUDGET}"),
    (_set("disruptionBudget", {"maxUnavailable": 1, "minAvailable": "50%"}),
     f"spec.disruptionBudget: {spec.MSG_DISRUPTION_BUDGET}"),
    (_set("workerPod", {"env": [{"name": "ADASERVE_POLICY", "value": "incremental"}]}),
     f"spec.workerPod.env: {spec.MSG_RESERVED_ENV}"),
    (_set("gateway.pod", {"env": [{"name": "ADASERVE_GATEWAY_REDIS_URL", "value": "redis://elsewhere"}]}),
     f"spec.gateway.pod.env: {spec.MSG_RESERVED_ENV}"),
    (_set("workerPod", {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "NCCL_DEBUG", "value": "WARN"}]}),
     f"spec.workerPod.env: {spec.MSG_UNIQUE_ENV}"),
    (_set("workerPod", {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}),
     f"spec.workerPod.env[0]: {spec.MSG_ENV_VALUE}"),
    (_set("workerPod", {"volumes": [{"name": "models", "emptyDir": {}}]}),
     f"spec.workerPod.volumes: {spec.MSG_RESERVED_VOLUME}"),
    (_set("workerPod", {"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]}),
     f"spec.workerPod.volumes: {spec.MSG_UNIQUE_VOLUMES}"),
    (_set("workerPod", {"volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
     f"spec.workerPod.volumeMounts: {spec.MSG_MOUNT_VOLUME}"),
    (_set("workerPod", {"volumes": [{"name": "data", "emptyDir": {}}],
                        "volumeMounts": [{"name": "data", "mountPath": "/etc/adaserve/slo"}]}),
     f"spec.workerPod.volumeMounts: {spec.MSG_RESERVED_MOUNT}"),
    (_set("gateway.pod", {"volumes": [{"name": "data", "emptyDir": {}}],
                          "volumeMounts": [{"name": "data", "mountPath": "/dev/shm"}]}),
     f"spec.gateway.pod.volumeMounts: {spec.MSG_RESERVED_MOUNT}"),
    (_set("workerPod", {"labels": {"app.kubernetes.io/instance": "other"}}),
     f"spec.workerPod.labels: {spec.MSG_RESERVED_LABELS}"),
    (_set("workerPod", {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "true"}]}),
     f"spec.workerPod.tolerations[0]: {spec.MSG_TOLERATION_EXISTS}"),
    (_set("workerPod", {"tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 60}]}),
     f"spec.workerPod.tolerations[0]: {spec.MSG_TOLERATION_SECONDS}"),
    (_set("redis", {"managed": True, "tls": {}}), f"spec.redis: {spec.MSG_REDIS_TLS}"),
    (_set("redis", {"url": "redis://r:6379/0", "tls": {"caSecret": {"name": "ca"}}}),
     f"spec.redis: {spec.MSG_REDIS_TLS}"),
    (_set("redis", {"managed": True, "passwordSecret": {"name": "p"}, "username": "svc"}),
     f"spec.redis: {spec.MSG_REDIS_USERNAME}"),
    (_set("redis", {"url": "redis://r:6379/0", "username": "svc"}), f"spec.redis: {spec.MSG_REDIS_USERNAME}"),
]


@pytest.mark.parametrize(("mutate", "error"), CEL_CASES, ids=[e for _, e in CEL_CASES])
def test_cel_rules_refuse_with_the_operators_words(crd: dict[str, Any], example: dict[str, Any],
                                                   mutate: Callable[[dict[str, Any]], None], error: str) -> None:
    mutate(example["spec"])
    assert validate(example, crd) == [error]
    with pytest.raises(SpecError) as e:
        parse_spec(example["spec"])
    # the operator names the offending field (the CRD reports some rules on the parent object)
    assert e.value.message in error and str(e.value).split(":")[0].startswith(error.split(":")[0])


# (mutation, the field both must name) for the OpenAPI part: the wording differs, the field does not
SCHEMA_CASES = [
    (_set("model.target", ...), "spec.model", "'target' is a required property"),
    (_set("replicas", -1), "spec.replicas", "less than the minimum of 0"),
    (_set("speculation.maxDepth", 33), "spec.speculation.maxDepth", "greater than the maximum of 32"),
    (_set("speculation.maxWidth", 0), "spec.speculation.maxWidth", "less than the minimum of 1"),
    (_set("speculation.policy", "fast"), "spec.speculation.policy", "does not match"),
    (_set("sloClasses[0].name", "no spaces"), "spec.sloClasses[0].name", "does not match"),
    (_set("resources.memory", "lots"), "spec.resources.memory", "does not match"),
    (_set("resources.tensorParallelSize", 0), "spec.resources.tensorParallelSize", "less than the minimum of 1"),
    (_set("resources.tensorParallelSize", 17), "spec.resources.tensorParallelSize", "greater than the maximum of 16"),
    (_set("resources.shmSize", "lots"), "spec.resources.shmSize", "does not match"),
    (_set("redis", {"url": "http://r"}), "spec.redis.url", "does not match"),
    (_set("gateway.serviceType", "Ingress"), "spec.gateway.serviceType", "is not one of"),
    (_set("sloClasses", []), "spec.sloClasses", "should be non-empty"),
    (_drafts(), "spec.model.drafts", "should be non-empty"),
    (_drafts(*(f"/models/d{i}" for i in range(9))), "spec.model.drafts", "is too long"),
    (_drafts("/models/a", policy="spin@ucb2"), "spec.speculation.policy", "does not match"),
    (_set("model.hub", {"tokenSecret": {"key": "token"}}), "spec.model.hub.tokenSecret",
     "'name' is a required property"),
    (_set("model.hub", {"tokenSecret": {"name": ""}}), "spec.model.hub.tokenSecret.name", "non-empty"),
    (_set("model.hub", {"tokenSecret": {"name": "hf", "key": ""}}), "spec.model.hub.tokenSecret.key", "non-empty"),
    (_set("resources.kvMemory", "8GB"), "spec.resources.kvMemory", "does not match"),
    (_set("resources.kvMemory", "512Ki"), "spec.resources.kvMemory", "does not match"),
    (_set("resources.requests", {"ephemeral-storage": "lots"}), "spec.resources.requests.ephemeral-storage",
     "does not match"),
    (_set("disruptionBudget", {"maxUnavailable": "half"}), "spec.disruptionBudget.maxUnavailable", "does not match"),
    (_set("workerPod", {"tolerations": [{"key": "gpu", "operator": "In"}]}), "spec.workerPod.tolerations[0].operator",
     "is not one of"),
    (_set("workerPod", {"tolerations": [{"key": "gpu", "effect": "NoRun"}]}), "spec.workerPod.tolerations[0].effect",
     "is not one of"),
    (_set("workerPod", {"nodeSelector": {"pool": 1}}), "spec.workerPod.nodeSelector.pool", "is not of type"),
    (_set("workerPod", {"imagePullSecrets": [{}]}), "spec.workerPod.imagePullSecrets[0]", "'name' is a required"),
    (_set("workerPod", {"env": [{"name": "1 bad"}]}), "spec.workerPod.env[0].name", "does not match"),
    (_set("workerPod", {"volumes": [{"name": "Data", "emptyDir": {}}]}), "spec.workerPod.volumes[0].name",
     "does not match"),
    (_set("workerPod", {"volumes": [{"name": "d", "emptyDir": {}}], "volumeMounts": [{"name": "d", "mountPath": "d"}]}),
     "spec.workerPod.volumeMounts[0].mountPath", "does not match"),
    (_set("gateway.resources", {"requests": {"cpu": "fast"}}), "spec.gateway.resources.requests.cpu",
     "does not match"),
    (_set("workerAuth", {}), "spec.workerAuth", "'tokenSecret' is a required property"),
    (_set("workerPod", {"env": [{"name": f"V{i}", "value": "x"} for i in range(65)]}), "spec.workerPod.env",
     "is too long"),
    (_set("workerPod", {"labels": {f"l{i}": "x" for i in range(65)}}), "spec.workerPod.labels",
     "too many properties"),
    (_set("redis", {"managed": True, "passwordSecret": {}}), "spec.redis.passwordSecret",
     "'name' is a required property"),
]


@pytest.mark.parametrize(("mutate", "field", "words"), SCHEMA_CASES, ids=[f for _, f, _ in SCHEMA_CASES])
def test_schema_refuses_and_so_does_the_operator(crd: dict[str, Any], example: dict[str, Any],
                                                 mutate: Callable[[dict[str, Any]], None], field: str,
                                                 words: str) -> None:
    mutate(example["spec"])
    errors = validate(example, crd)
    assert len(errors) == 1 and errors[0].startswith(f"{field}: ") and words in errors[0], errors
    with pytest.raises(SpecError) as e:
        parse_spec(example["spec"])
    assert e.value.path.startswith(field)


def test_hub_source_wants_hub_ids(crd: dict[str, Any], example: dict[str, Any]) -> None:
    s = example["spec"]
    del s["model"]["pvc"]
    s["model"].update(source="hub", target="meta-llama/Llama-3.1-8B-Instruct", draft="meta-llama/Llama-3.2-1B")
    assert validate(example, crd) == []
    parse_spec(s)
    s["model"]["draft"] = "/models/draft"
    assert validate(example, crd) == [f"spec.model: {spec.MSG_TARGET_HUB}"]
    with pytest.raises(SpecError, match="hub ids"):
        parse_spec(s)


def test_hub_token_secret_is_accepted_with_source_hub_and_its_key_defaults(crd: dict[str, Any],
                                                                           example: dict[str, Any]) -> None:
    s = example["spec"]
    del s["model"]["pvc"]
    s["model"].update(source="hub", target="meta-llama/Llama-3.1-8B-Instruct", draft="meta-llama/Llama-3.2-1B",
                      hub={"tokenSecret": {"name": "hf-token"}})
    assert validate(example, crd) == []
    defaulted = apply_defaults(openapi_schema(crd), example)["spec"]["model"]["hub"]
    assert defaulted == {"tokenSecret": {"name": "hf-token", "key": "token"}}  # the API server's default
    parsed = parse_spec(s).model.hub
    assert parsed is not None and parsed.token_secret is not None
    assert (parsed.token_secret.name, parsed.token_secret.key) == ("hf-token", "token")  # and the operator's
    s["model"]["hub"] = {}  # settings without a token are allowed (nothing to render)
    assert validate(example, crd) == []
    parse_spec(s)


def test_budget_integer_and_incremental_without_draft_are_fine(crd: dict[str, Any], example: dict[str, Any]) -> None:
    s = example["spec"]
    s["speculation"].update(budget=96, policy="incremental")
    del s["model"]["draft"]
    assert validate(example, crd) == []
    assert parse_spec(s).speculation.budget == 96


def test_cel_rules_hold_for_a_spec_that_passes_the_schema_only(crd: dict[str, Any], example: dict[str, Any]) -> None:
    """Two broken rules at once are both reported (the API server lists every failed rule)."""
    s = example["spec"]
    _dup_class(s)
    s["redis"]["url"] = "redis://r:6379/0"
    assert validate(example, crd) == [f"spec.sloClasses: {spec.MSG_UNIQUE_CLASSES}",
                                      f"spec.redis: {spec.MSG_REDIS_ONE}"]


def test_unknown_fields_are_refused_by_the_operator(example: dict[str, Any]) -> None:
    # the API server prunes unknown fields; an emulator or an old server does not, and a typo must not pass silently
    s = copy.deepcopy(example["spec"])
    s["gateway"]["replica"] = 3
    with pytest.raises(SpecError, match=r"spec\.gateway\.replica: unknown field"):
        parse_spec(s)


def test_builtin_source_names_a_model_the_image_carries(crd: dict[str, Any], example: dict[str, Any]) -> None:
    from adaserve.engine.loading.catalog import NAMES

    # the CRD's list, its message, the operator's and the worker's catalog agree
    assert spec.BUILTIN_MODELS == NAMES
    rule = next(r["rule"] for r in _rules(openapi_schema(crd)) if "builtin" in r["message"])
    assert all(f"'{n}'" in rule and n in spec.MSG_BUILTIN for n in NAMES)
    s = example["spec"]
    s["model"] = {"source": "builtin", "target": "smollm2-135m-instruct", "dtype": "float32"}
    assert validate(example, crd) == []  # speculates with no draft: the named model brings its own
    parsed = parse_spec(s)
    env = {e["name"]: e.get("value") for e in worker_env(parsed, name="m", namespace="ns")}
    assert env["ADASERVE_TARGET"] == "smollm2-135m-instruct" and "ADASERVE_DRAFT" not in env
    for bad in ({"target": "llama-3"}, {"target": "/models/x"}, {"draft": "/models/d"}):
        s["model"] = {"source": "builtin", "target": "smollm2-135m-instruct", **bad}
        assert validate(example, crd) == [f"spec.model: {spec.MSG_BUILTIN}"], bad
        with pytest.raises(SpecError, match="source builtin"):
            parse_spec(s)


def test_gguf_file_on_a_volume_is_a_target_path(crd: dict[str, Any], example: dict[str, Any]) -> None:
    example["spec"]["model"]["target"] = "/models/smollm2.Q4_1.gguf"
    assert validate(example, crd) == []
    assert parse_spec(example["spec"]).model.target.endswith(".gguf")


def test_several_drafts_reach_the_workers_as_one_json_list(crd: dict[str, Any], example: dict[str, Any]) -> None:
    _drafts("/models/llama-3.2-1b-instruct", "/models/llama-3.2-3b-instruct", policy="spin")(example["spec"])
    assert validate(example, crd) == []
    env = {e["name"]: e.get("value") for e in worker_env(parse_spec(example["spec"]), name="m", namespace="ns")}
    assert "ADASERVE_DRAFT" not in env and env["ADASERVE_POLICY"] == "spin"
    assert json.loads(env["ADASERVE_DRAFTS"]) == ["/models/llama-3.2-1b-instruct", "/models/llama-3.2-3b-instruct"]
    for policy in ("adaserve@d1", "chain:4@eps", "spin-length", "beam:3,2@ucb"):
        example["spec"]["speculation"]["policy"] = policy
        assert validate(example, crd) == [], policy
        parse_spec(example["spec"])


def test_builtin_source_may_name_the_default_models_two_drafts(crd: dict[str, Any], example: dict[str, Any]) -> None:
    from adaserve.engine.loading.catalog import DRAFT_NAMES

    assert spec.BUILTIN_DRAFTS == DRAFT_NAMES  # the operator's list and the worker's catalog agree
    rule = next(r["rule"] for r in _rules(openapi_schema(crd)) if r["message"] == spec.MSG_BUILTIN_DRAFTS)
    assert all(f"'{n}'" in rule and n in spec.MSG_BUILTIN_DRAFTS for n in DRAFT_NAMES)
    _builtin(drafts=list(DRAFT_NAMES), dtype="float32")(example["spec"])
    example["spec"]["speculation"]["policy"] = "spin"
    assert validate(example, crd) == []
    env = {e["name"]: e.get("value") for e in worker_env(parse_spec(example["spec"]), name="m", namespace="ns")}
    assert json.loads(env["ADASERVE_DRAFTS"]) == list(DRAFT_NAMES)  # names as given: the catalog resolves them


def test_hub_drafts_are_hub_ids_and_all_downloaded(crd: dict[str, Any], example: dict[str, Any]) -> None:
    s = example["spec"]
    del s["model"]["pvc"]
    s["model"].update(source="hub", target="meta-llama/Llama-3.1-8B-Instruct")
    _drafts("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-3B")(s)
    assert validate(example, crd) == []
    parsed = parse_spec(s)
    env = {e["name"]: e.get("value") for e in worker_env(parsed, name="m", namespace="ns")}
    assert json.loads(env["ADASERVE_DRAFTS"]) == ["/models/meta-llama/Llama-3.2-1B", "/models/meta-llama/Llama-3.2-3B"]
    fetch = worker_deployment(parsed, name="m", namespace="ns")["spec"]["template"]["spec"]["initContainers"][0]
    assert all(f"hf download {i} " in fetch["command"][-1] for i in (s["model"]["target"], *s["model"]["drafts"]))
    s["model"]["drafts"] = ["meta-llama/Llama-3.2-1B", "/models/draft"]
    assert validate(example, crd) == [f"spec.model: {spec.MSG_TARGET_HUB}"]
    with pytest.raises(SpecError, match=r"spec\.model\.drafts\[1\]: with source hub"):
        parse_spec(s)


def test_the_sheddable_field_documents_the_status_the_gateway_sends(crd: dict[str, Any]) -> None:
    """The CRD told users a shed request gets 429 while the gateway sends 503 (issue 32): the description
    must name the gateway's own status and code for a shed request, and not the rate limit's 429."""
    from adaserve.gateway.admission import Refused

    shed = Refused("x", reason="shed", retry_after=1)
    text = json.dumps(openapi_schema(crd))
    described = [d for d in _descriptions(openapi_schema(crd)) if "refused under overload" in d]
    assert len(described) == 1, text[:200]
    assert f"{shed.status} with code {shed.code}" in described[0]
    assert "(429)" not in text


def _descriptions(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["description"]] if isinstance(node.get("description"), str) else []
        return own + [d for v in node.values() for d in _descriptions(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descriptions(v)]
    return []


@pytest.mark.parametrize("resources", [
    {"gpusPerWorker": 4, "tensorParallelSize": 4, "shmSize": "4Gi"},
    {"gpusPerWorker": 0, "tensorParallelSize": 2},  # CPU ranks (gloo): no GPU to match
    {"gpusPerWorker": 2},  # unset is one rank, as before the field existed
])
def test_tensor_parallel_sizes_the_crd_and_the_operator_accept(crd: dict[str, Any], example: dict[str, Any],
                                                               resources: dict[str, Any]) -> None:
    example["spec"]["resources"] = resources
    assert validate(example, crd) == []
    r = parse_spec(example["spec"]).resources
    assert r.ranks == resources.get("tensorParallelSize", 1)
    pod = worker_deployment(parse_spec(example["spec"]), name="m", namespace="ns")["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    shm = [v for v in pod["volumes"] if v["name"] == "shm"]
    if r.ranks > 1:
        assert command == ["adaserve", "worker", "--tensor-parallel-size", str(r.ranks)]
        assert shm == [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": resources.get("shmSize", "1Gi")}}]
    else:
        assert command == ["adaserve", "worker"] and shm == []


def test_a_full_pod_override_is_accepted_and_defaulted(crd: dict[str, Any], example: dict[str, Any]) -> None:
    example["spec"]["workerPod"] = copy.deepcopy(FULL_POD)
    example["spec"]["gateway"]["pod"] = {"imagePullSecrets": [{"name": "registry"}], "nodeSelector": {"pool": "cpu"}}
    assert validate(example, crd) == []
    defaulted = apply_defaults(openapi_schema(crd), example)["spec"]
    assert defaulted["workerPod"]["volumeMounts"][1]["readOnly"] is False
    pod = parse_spec(defaulted).worker_pod  # the API server's defaults, then the operator's parse
    assert [t.operator for t in pod.tolerations] == ["Exists", "Equal"]
    assert pod.volumes[0].model_dump() == {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}
    assert parse_spec(example["spec"]) == parse_spec(defaulted)  # the operator's defaults are the CRD's


def test_reserved_env_in_the_crd_is_the_operators_list_and_covers_what_it_renders(crd: dict[str, Any],
                                                                                 example: dict[str, Any]) -> None:
    """The CEL rule lists exactly spec.RESERVED_ENV, and every variable the operator renders, with every option that
    adds one on, is in it: a pod override can never shadow one of them."""
    rule = next(r["rule"] for r in _rules(openapi_schema(crd)) if r["message"] == spec.MSG_RESERVED_ENV)
    assert sorted(set(re.findall(r"'([A-Z_]+)'", rule))) == sorted(spec.RESERVED_ENV)
    s = example["spec"]
    del s["model"]["pvc"]
    s["model"].update(source="hub", hub={"tokenSecret": {"name": "hf"}}, target="a/b")
    del s["model"]["draft"]
    s["model"]["drafts"] = ["a/c"]
    s["speculation"]["budget"] = 64
    s["resources"]["kvMemoryFraction"] = 0.5
    s["gateway"]["apiKeysSecret"] = {"name": "keys"}
    s["redis"] = {"url": "rediss://r:6379/0", "passwordSecret": {"name": "p"}, "username": "u",
                  "tls": {"caSecret": {"name": "ca"}}}
    s["workerAuth"] = {"tokenSecret": {"name": "t"}}
    parsed = parse_spec(s)
    rendered = set()
    for d in (worker_deployment(parsed, name="m", namespace="ns"),
              gateway_deployment(parsed, name="m", namespace="ns")):
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            rendered |= {e["name"] for e in c["env"]}
    s["resources"] = {"kvMemory": "2Gi"}
    rendered |= {e["name"] for e in worker_env(parse_spec(s), name="m", namespace="ns")}
    assert rendered - set(spec.RESERVED_ENV) == set()
    assert {"ADASERVE_KV_MEMORY_MB", "ADASERVE_REDIS_PASSWORD", "ADASERVE_AUTH_TOKEN", "HF_TOKEN",
            "ADASERVE_GATEWAY_WORKER_TOKEN", "ADASERVE_GATEWAY_REDIS_TLS_CA_FILE"} <= rendered


@pytest.mark.parametrize(("kv_memory", "mb"), [("512Mi", 512), ("8Gi", 8192), ("1Ti", 1024 * 1024)])
def test_kv_memory_as_a_size_reaches_the_worker_in_mib(crd: dict[str, Any], example: dict[str, Any],
                                                       kv_memory: str, mb: int) -> None:
    example["spec"]["resources"]["kvMemory"] = kv_memory
    assert validate(example, crd) == []
    env = {e["name"]: e.get("value") for e in worker_env(parse_spec(example["spec"]), name="m", namespace="ns")}
    assert env["ADASERVE_KV_MEMORY_MB"] == str(mb) and "ADASERVE_KV_MEMORY_FRACTION" not in env


def test_a_disruption_budget_a_worker_token_and_redis_auth_are_accepted(crd: dict[str, Any],
                                                                        example: dict[str, Any]) -> None:
    s = example["spec"]
    s["disruptionBudget"] = {"maxUnavailable": "25%"}
    s["workerAuth"] = {"tokenSecret": {"name": "worker-token"}}
    s["redis"]["passwordSecret"] = {"name": "redis"}
    assert validate(example, crd) == []
    defaulted = apply_defaults(openapi_schema(crd), example)["spec"]
    assert defaulted["workerAuth"]["tokenSecret"]["key"] == "token"
    assert defaulted["redis"]["passwordSecret"]["key"] == "password"
    assert parse_spec(s) == parse_spec(defaulted)
    s["disruptionBudget"] = {"minAvailable": 1}
    s["redis"] = {"url": "rediss://r.example:6380/0", "passwordSecret": {"name": "redis"}, "username": "svc",
                  "tls": {"caSecret": {"name": "redis-ca"}}}
    assert validate(example, crd) == []
    assert parse_spec(s).redis.tls is not None
