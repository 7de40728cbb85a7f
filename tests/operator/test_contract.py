"""What the operator renders, read by the components themselves: the worker's and the gateway's own settings
accept the environment the builders give them, and the gateway parses the SLO ConfigMap's file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import load_catalog
from adaserve.operator import builders
from adaserve.operator.spec import parse_spec
from adaserve.worker.settings import WorkerSettings
from tests.operator.schema import EXAMPLE_PATH


def plain_env(deployment: dict[str, Any]) -> dict[str, str]:
    """The container's variables with literal values (fieldRefs are the kubelet's, tested by the builders)."""
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e["value"] for e in env if "value" in e}


@pytest.fixture
def spec() -> Any:
    return parse_spec(yaml.safe_load(EXAMPLE_PATH.read_text())["spec"])


def test_worker_settings_accept_the_rendered_env(spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = plain_env(builders.worker_deployment(spec, name="llama", namespace="serving"))
    for key in ("ADASERVE_TARGET", "ADASERVE_DRAFT"):  # model directories exist only in the pod: stand-ins here
        model = tmp_path / key.lower()
        model.mkdir()
        (model / "config.json").write_text("{}")
        env[key] = str(model)
    env["ADASERVE_ADVERTISE_URL"] = "http://10.0.0.7:8000"  # what the kubelet makes of $(POD_IP)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = WorkerSettings()
    assert s.slo_classes == {"coding": 40.0, "chat": 50.0, "summarization": 150.0}
    assert (s.default_slo_class, s.policy, s.budget, s.max_depth, s.max_width) == ("chat", "adaserve", None, 4, 2)
    assert (s.device, s.dtype, s.host, s.port, s.model_name) == ("cuda", "bfloat16", "0.0.0.0", 8000, "llama-3.1-8b")
    assert (s.redis_url, s.redis_prefix) == ("redis://llama-redis.serving.svc:6379/0", "adaserve:serving:llama")
    assert s.drain_grace_s == 30


def test_gateway_settings_and_classes_file(spec: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = plain_env(builders.gateway_deployment(spec, name="llama", namespace="serving"))
    classes_file = tmp_path / "slo-classes.json"  # the ConfigMap, as mounted
    classes_file.write_text(builders.slo_configmap(spec, name="llama", namespace="serving")["data"]["slo-classes.json"])
    env["ADASERVE_GATEWAY_SLO_CLASSES_FILE"] = str(classes_file)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s = GatewaySettings()
    assert (s.host, s.port, s.routing, s.model_name) == ("0.0.0.0", 8080, "headroom", "llama-3.1-8b")
    assert (s.redis_url, s.redis_prefix) == ("redis://llama-redis.serving.svc:6379/0", "adaserve:serving:llama")
    catalog = load_catalog(file=s.slo_classes_file, inline=s.slo_classes, default=s.default_slo_class)
    assert list(catalog.classes) == ["coding", "chat", "summarization"] and catalog.default == "chat"
    assert catalog.classes["summarization"].sheddable and catalog.classes["coding"].priority == 10
