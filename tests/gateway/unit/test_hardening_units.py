"""Issue 17's pure parts: where text cannot be encoded, who may read a record, the OpenAPI document the gateway
serves, and the tracker's one terminal outcome per request (the same against real processes:
tests/gateway/test_hardening.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from adaserve.contract.generate import GenerateRequest
from adaserve.contract.openai import ChatRequest, CompletionRequest
from adaserve.contract.text import unencodable
from adaserve.gateway.app import create_app
from adaserve.gateway.keys import ApiKey
from adaserve.gateway.metrics import GatewayMetrics
from adaserve.gateway.routes.models import may_read
from adaserve.gateway.service import Gateway
from adaserve.gateway.settings import GatewaySettings
from adaserve.gateway.slo import SloClass
from adaserve.gateway.state import MemoryStore
from adaserve.gateway.tracker import Tracker
from tests.gateway.unit.helpers import run
from tests.gateway.unit.test_tracker import admitted

BAD = "\ud800"


@pytest.mark.parametrize(("value", "where"), [
    ({"prompt": "fine", "stop": ["ok"]}, None),
    ({"prompt": BAD}, "prompt"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": f"x{BAD}y"}]},
     "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]}, "messages[0].content[0].text"),
    ({"stop": ["a", BAD]}, "stop[1]"),
    ({BAD: 1}, "body (a key)"),
    ([[[[BAD]]]], "[0][0][0][0]"),
    ({"prompt_token_ids": list(range(100_000))}, None),
])
def test_unencodable_names_where(value: Any, where: str | None) -> None:
    assert unencodable(value) == where


def test_deep_nesting_does_not_recurse() -> None:
    value: Any = BAD
    for _ in range(50_000):
        value = [value]
    assert unencodable(value) is not None and unencodable([[[]]] * 3) is None


@pytest.mark.parametrize("model", [CompletionRequest, ChatRequest, GenerateRequest])
def test_every_edge_refuses_a_lone_surrogate_by_field(model: Any) -> None:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": BAD}]} if model is ChatRequest \
        else {"model": "m", "prompt": BAD}
    if model is GenerateRequest:
        body.pop("model")
    with pytest.raises(ValidationError, match=r"(prompt|messages\[0\]\.content): text is not valid Unicode"):
        model.model_validate(body)


def test_whole_floats_are_integers_as_json_schema_says() -> None:
    """The OpenAPI document declares "integer", which JSON Schema satisfies with 0.0: so does the API."""
    req = CompletionRequest.model_validate({"model": "m", "prompt": [0.0, 7.0], "max_tokens": 2.0, "seed": 3.0})
    assert req.prompt == [0, 7] and all(type(t) is int for t in req.prompt) and req.max_tokens == 2
    for bad in ({"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": "2"}, {"prompt": [1.5]}, {"top_k": -1.0}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", **bad})
    assert GenerateRequest.model_validate({"prompt_token_ids": [1.0], "top_k": 4.0}).top_k == 4


def test_a_record_is_its_own_keys_and_admins() -> None:
    a, b = ApiKey(key="sk-a-01234567", name="a"), ApiKey(key="sk-b-01234567", name="b")
    admin = ApiKey(key="sk-o-01234567", name="ops", admin=True)
    record = {"id": "r", "api_key": "a"}
    assert may_read(a, record) and may_read(admin, record) and may_read(None, record)
    assert not may_read(b, record) and not may_read(a, {"id": "r", "api_key": ""})


# ---- the OpenAPI document ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    app = create_app(Gateway(GatewaySettings(workers=["http://127.0.0.1:9"])))  # connects nothing
    return app.openapi()


def test_openapi_declares_the_statuses_the_gateway_answers(doc: dict[str, Any]) -> None:
    assert '"422"' not in str(doc).replace("'", '"')
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "502", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        error = {"$ref": "#/components/schemas/ErrorResponse"}
        assert responses["400"]["content"]["application/json"]["schema"] == error
    assert {"400", "401", "404", "503"} <= set(doc["paths"]["/v1/requests/{request_id}"]["get"]["responses"])
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" in doc["paths"]["/readyz"]["get"]["responses"]


def test_openapi_declares_the_fields_rules(doc: dict[str, Any]) -> None:
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    prompt = props["prompt"]["anyOf"]
    assert {"type": "string", "minLength": 1} in prompt  # prompt "" is refused, and declared so
    assert any(p.get("maxItems") == 1 for p in prompt)
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 8)  # n > 1 is served (issue 33), up to 8
    assert (props["presence_penalty"]["minimum"], props["presence_penalty"]["maximum"]) == (-2.0, 2.0)
    assert props["repetition_penalty"]["exclusiveMinimum"] == 0.0 and props["min_tokens"]["minimum"] == 0
    bias = next(s for s in props["logit_bias"]["anyOf"] if s.get("type") == "object")
    assert bias["propertyNames"] == {"pattern": "^(0|[1-9][0-9]{0,8})$"}  # token ids, as JSON object keys
    assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
    assert {"type": "string", "minLength": 1} in props["stop"]["anyOf"]


def test_openapi_says_unknown_fields_are_ignored_or_refused_in_strict_mode() -> None:
    def schemas(strict: bool) -> dict[str, Any]:
        settings = GatewaySettings(workers=["http://127.0.0.1:9"], strict_openai_fields=strict)
        return create_app(Gateway(settings)).openapi()["components"]["schemas"]

    for strict in (False, True):
        docs = schemas(strict)
        for name in ("CompletionRequest", "ChatRequest", "Message", "StreamOptions", "MessageToolCall"):
            assert docs[name]["additionalProperties"] is (not strict), (name, strict)


# ---- one terminal outcome per request ----------------------------------------------------------------------


def _tracker(metrics: GatewayMetrics) -> Tracker:
    return Tracker(MemoryStore(), metrics, 60, "req-1", SloClass(name="chat", tpot_ms=50), api_key="a", model="m")


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_a_request_sent_ends_in_exactly_one_outcome() -> None:
    m = GatewayMetrics()

    async def main() -> None:
        for outcome in ("done", "aborted", "failed", "rejected"):
            t = _tracker(m)
            await t.routed("w1", admitted("w1"))
            assert _value(m, "adaserve_gateway_in_flight", slo_class="chat") == 1
            await t.routed("w2", admitted("w2"))  # a retry is the same request
            await t.finished(outcome, None, reason="because")
            await t.finished("done", "stop")  # a second end changes nothing

    run(main())
    assert _value(m, "adaserve_gateway_requests_total", slo_class="chat") == 4
    for outcome in ("done", "aborted", "failed", "rejected"):
        assert _value(m, "adaserve_gateway_finished_total", slo_class="chat", outcome=outcome) == 1
    assert _value(m, "adaserve_gateway_in_flight", slo_class="chat") == 0


def test_a_request_never_sent_is_not_counted_but_its_record_is_closed() -> None:
    m = GatewayMetrics()
    t = _tracker(m)

    async def main() -> dict[str, str] | None:
        await t.received()
        await t.finished("aborted", None)  # the client left while it waited in admission
        return await t.store.get_record("req-1")

    record = run(main())
    assert record is not None and record["status"] == "aborted"
    assert _value(m, "adaserve_gateway_requests_total", slo_class="chat") == 0
    assert _value(m, "adaserve_gateway_finished_total", slo_class="chat", outcome="aborted") == 0
