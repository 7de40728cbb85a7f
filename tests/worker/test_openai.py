"""The OpenAI API on a worker alone (no gateway): the official ``openai`` client over real HTTP on loopback against a
worker process on the demo pair, in local mode."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests import openai_choices
from tests.servers import Service, demo_pair, metric, scrape, start_worker

CLASSES = {"coding": 40.0, "summarization": 400.0}
MODEL = "demo"


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    target, draft = demo_pair()
    log = tmp_path_factory.mktemp("oai-worker") / "worker.log"
    w = start_worker(target, draft, log, "--budget", "8",
                     env={"ADASERVE_SLO_CLASSES": json.dumps(CLASSES), "ADASERVE_REDIS_URL": "",
                          "ADASERVE_MODEL_NAME": MODEL})
    try:
        w.wait_ready()
        yield w
    finally:
        assert w.stop() == 0, w.logs()[-3000:]


@pytest.fixture
def client(worker: Service) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture
def http(worker: Service) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=worker.url, timeout=120) as c:
        yield c


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "adaserve"


def test_chat_non_streamed(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def add(a, b):"}],
                                         max_tokens=8, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None and out.usage.completion_tokens <= 8 and out.usage.prompt_tokens > 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_streamed_equals_non_streamed(client: openai.OpenAI) -> None:
    """The done-when of issue 32: the official client streams a chat completion from a worker directly."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def fib(n):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12 == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10, temperature=0)
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-")
    parts = list(client.completions.create(model=MODEL, prompt="def fibonacci(n):", max_tokens=10, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", [0, 300, 301, 302]])
def test_greedy_output_equals_generate(http: httpx.Client, prompt: str | list[int]) -> None:
    """The OpenAI route serves exactly what /v1/generate serves for the same request."""
    key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
    gen = http.post("/v1/generate", json={key: prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    oai = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                            "ignore_eos": True})
    assert gen.status_code == oai.status_code == 200, oai.text
    assert oai.json()["choices"][0]["text"] == gen.json()["text"]
    assert oai.json()["usage"]["completion_tokens"] == len(gen.json()["token_ids"]) == 16
    assert oai.json()["usage"]["prompt_tokens"] == gen.json()["prompt_tokens"]
    messages = [{"role": "user", "content": "hello"}]
    gen = http.post("/v1/generate", json={"messages": messages, "max_tokens": 8, "temperature": 0})
    oai = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                 "temperature": 0})
    assert oai.json()["choices"][0]["message"]["content"] == gen.json()["text"]


def test_slo_from_header_class_or_explicit_target(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x = 1", "max_tokens": 4, "temperature": 0, "slo_class": "summarization"}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["X-SLO-Class"] == "summarization"
    assert r.json()["adaserve"]["tpot_slo_ms"] == 400.0  # the worker's own class
    r = http.post("/v1/completions", json=body, headers={"X-SLO-Class": "coding"})  # the header wins, as at a gateway
    assert r.json()["adaserve"]["slo_class"] == "coding" and r.json()["adaserve"]["tpot_slo_ms"] == 40.0
    r = http.post("/v1/completions", json={**body, "tpot_slo_ms": 123.0})
    assert r.json()["adaserve"]["tpot_slo_ms"] == 123.0
    # the TTFT target echoed is the engine Request's own (stream.py reads it there): it reached the engine, where
    # the SLO prefill rule reads it (issue 29)
    r = http.post("/v1/completions", json=body, headers={"X-TPOT-SLO-Ms": "77", "X-TTFT-SLO-Ms": "5000"})
    assert r.json()["adaserve"]["tpot_slo_ms"] == 77.0 and r.json()["adaserve"]["ttft_slo_ms"] == 5000.0


def test_unknown_fields_are_ignored_and_named(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "store": True, "metadata": {"a": "b"}})
    assert r.status_code == 200, r.text
    assert r.headers["X-Ignored-Fields"] == "store, metadata"


@pytest.mark.parametrize(("body", "headers", "status", "param"), [
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 9}, {}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 2, "best_of": 1}, {}, 400, None),
    ({"model": MODEL, "messages": []}, {}, 400, "messages"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, {}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "slo_class": "nope"}, {}, 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, {}, 400, None),
    ({"model": MODEL, "prompt": "x"}, {"X-SLO-Class": "bad class!"}, 400, "X-SLO-Class"),
    ({"model": MODEL, "prompt": "x"}, {"X-TPOT-SLO-Ms": "-1"}, 400, "X-TPOT-SLO-Ms"),
    ({"model": "other", "prompt": "x"}, {}, 404, "model"),
])
def test_bad_requests_get_openai_errors(http: httpx.Client, body: dict[str, object], headers: dict[str, str],
                                        status: int, param: str | None) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert "Traceback" not in r.text


def test_bad_request_raises_the_clients_typed_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_malformed_json_is_a_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_generate_keeps_its_own_error_shape(http: httpx.Client) -> None:
    r = http.post("/v1/generate", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 422 and "max_tokens" in r.json()["detail"]


def test_openapi_declares_the_openai_routes(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "404", "503"} <= set(responses)
        shape = responses["400"]["content"]["application/json"]["schema"]
        assert shape == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "/v1/models" in doc["paths"]




# ---- metrics, scraped as the Gateway API Inference Extension's endpoint picker and Prometheus would -----------

def test_metrics_as_gie_scrapes_them(worker: Service, client: openai.OpenAI) -> None:
    before = scrape(worker.url)
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def f(x):"}],
                                        max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
                                        extra_headers={"X-SLO-Class": "coding"}))
    after = scrape(worker.url)
    # every series of the worker names its model, as vLLM's do
    unlabelled = sorted({name for name, labels in after if ("model_name", MODEL) not in labels})
    assert unlabelled == [], unlabelled
    # the model-server protocol's gauges, under the names GIE's endpoint picker reads by default
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:gpu_cache_usage_perc",
                 "vllm:kv_cache_usage_perc"):
        assert (name, (("model_name", MODEL),)) in after, name
    assert metric(after, "vllm:num_requests_waiting") == metric(after, "adaserve_queue_length") == 0
    assert metric(after, "vllm:kv_cache_usage_perc") == metric(after, "adaserve_kv_cache_usage_ratio")

    def moved(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    coding = {"slo_class": "coding"}
    assert moved("adaserve_inter_token_latency_seconds_count", **coding) == 11  # 12 tokens: 11 gaps
    assert moved("adaserve_inter_token_latency_seconds_sum", **coding) > 0
    for name in ("adaserve_e2e_request_latency_seconds_count", "adaserve_request_queue_time_seconds_count",
                 "adaserve_request_prompt_tokens_count", "adaserve_request_generation_tokens_count"):
        assert moved(name, **coding) == 1, name
    assert moved("adaserve_request_generation_tokens_sum", **coding) == 12
    assert moved("adaserve_request_prompt_tokens_sum", **coding) > 3
    assert moved("adaserve_request_generation_tokens_bucket", le="10.0", **coding) == 0
    assert moved("adaserve_request_generation_tokens_bucket", le="20.0", **coding) == 1
    # acceptance = accepted / drafted: drafted counts tree nodes without their roots, so it is at most 1
    drafted, accepted = moved("adaserve_spec_draft_tokens_total"), moved("adaserve_spec_accepted_tokens_total")
    verified, verifications = moved("adaserve_tokens_verified_total"), moved("adaserve_verifications_total")
    assert drafted == verified - verifications and drafted > 0
    assert accepted == moved("adaserve_tokens_accepted_total") and 0 <= accepted <= drafted
    # the old names stay
    assert ("adaserve_queue_length", (("model_name", MODEL),)) in after


# ---- n, best_of, echo (issue 33; tests/openai_choices.py, also run through a gateway) ----------------------------


def _generate(http: httpx.Client) -> openai_choices.Generate:
    def generate(**body: object) -> dict[str, object]:
        r = http.post("/v1/generate", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    return generate


def test_n_seeded_sampled_choices_are_the_plain_runs(client: openai.OpenAI, http: httpx.Client) -> None:
    openai_choices.n_seeded_sampled(client, MODEL, _generate(http))


def test_n_greedy_choices_are_equal_and_streamed_with_indices(client: openai.OpenAI) -> None:
    openai_choices.n_greedy_and_streamed(client, MODEL)


def test_best_of_picks_by_cumulative_logprob(client: openai.OpenAI) -> None:
    openai_choices.best_of_picks_by_logprob(client, MODEL)


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    openai_choices.echo_prepends_the_prompt(client, MODEL)


def test_bad_choice_combinations_are_400(client: openai.OpenAI) -> None:
    openai_choices.bad_combinations_are_400(client, MODEL)
