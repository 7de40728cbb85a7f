"""A worker's death mid-answer, survived: real worker processes (the demo pair), a real Redis, the official
``openai`` client.

The worker serving a request is frozen (SIGSTOP) once the client has tokens and the gateway has not seen the
request end, then killed (SIGKILL): the request is then certainly cut mid-answer, however loaded the machine
is. The client must get exactly the text an unbroken run gives, one id, the usage of the whole answer.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from tests.gateway.test_gateway import LAX, client, direct, record
from tests.redis_prefix import REDIS_URL, isolated_redis
from tests.servers import GatewayProcess, Service, demo_pair, metric, scrape, start_gateway, start_worker, wait_for

PROMPT = "def parse_args(argv):"
MESSAGES = [{"role": "user", "content": "Write a function that merges two sorted lists."}]
LONG = 400  # tokens: long enough that the answer is still going when its worker is frozen
CUT_AFTER_CHARS = 100  # the client has this much text (tens of tokens) when the worker is frozen
CUT_AFTER_TOKENS = 40  # the same for an answer that is not streamed (the gateway has them)
QUEUE_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def rds() -> Iterator[tuple[redis.Redis, str]]:
    yield from isolated_redis("failover")


class Fleet:
    """Workers registered under one prefix, by id; killed ones are replaced by fresh ones."""

    def __init__(self, tmp: Path, prefix: str, redis_url: str = REDIS_URL) -> None:
        self.tmp, self.prefix, self.redis_url = tmp, prefix, redis_url
        self.workers: dict[str, Service] = {}
        self.n = 0

    def start(self, **env: str) -> Service:
        self.n += 1
        wid = f"w-{self.n}"
        target, draft = demo_pair()
        w = start_worker(target, draft, self.tmp / f"{wid}.log", "--budget", "8", "--redis-url", self.redis_url,
                         "--worker-id", wid,
                         env={"ADASERVE_REDIS_PREFIX": self.prefix, "ADASERVE_MODEL_NAME": "demo",
                              "ADASERVE_HEARTBEAT_S": "0.5", "ADASERVE_REGISTRATION_TTL_S": "3", **env})
        self.workers[wid] = w
        return w

    def live(self) -> list[Service]:
        return [w for w in self.workers.values() if w.proc.poll() is None]

    def stop(self) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGCONT)
                w.stop()


@pytest.fixture(scope="module")
def fleet(rds: tuple[redis.Redis, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("failover-workers"), rds[1])
    try:
        for w in [f.start(), f.start()]:
            w.wait_ready()
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def gateway(rds: tuple[redis.Redis, str], fleet: Fleet,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("failover-gw")
    classes = tmp / "lax.json"
    classes.write_text("[" + ",".join(c.model_dump_json(by_alias=True, exclude_none=True) for c in LAX) + "]")
    gw = start_gateway(tmp / "gateway.log", "--redis-url", REDIS_URL, "--redis-prefix", rds[1],
                       "--slo-classes-file", str(classes), "--default-slo-class", "chat")
    try:
        gw.wait_workers(2)
        yield gw
    finally:
        assert gw.stop() == 0, gw.logs()[-3000:]


def two_ready(fleet: Fleet, gw: GatewayProcess) -> None:
    """Back to two live workers that the gateway routes to (a killed one replaced)."""
    while len(fleet.live()) < 2:
        fleet.start().wait_ready()
    gw.wait_workers(2)


def freeze_then_kill(fleet: Fleet, rds: tuple[redis.Redis, str], rid: str, worker_id: str) -> bool:
    """Freeze the worker; if the gateway has not seen the request end half a second later (so it cannot: the
    worker is frozen), kill it and return True. Otherwise let it go on and return False (try again)."""
    w = fleet.workers[worker_id]
    w.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.5)
    r, prefix = rds
    if r.hget(f"{prefix}:requests:{rid}", "status") != "running":
        w.proc.send_signal(signal.SIGCONT)
        return False
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait()
    return True


def reference(gw: GatewayProcess, kind: str, **params: Any) -> tuple[str, int, int]:
    """An unbroken run's text, prompt tokens and completion tokens, through the gateway."""
    c = client(gw)
    if kind == "chat":
        got = c.chat.completions.create(model="demo", messages=MESSAGES, **params)
        text = got.choices[0].message.content or ""
    else:
        got = c.completions.create(model="demo", prompt=PROMPT, **params)
        text = got.choices[0].text
    assert got.usage is not None
    return text, got.usage.prompt_tokens, got.usage.completion_tokens


def killed_stream(gw: GatewayProcess, fleet: Fleet, rds: tuple[redis.Redis, str], kind: str,
                  **params: Any) -> tuple[str, set[str], str | None, Any, str]:
    """A streamed answer whose worker is killed after its first tokens: (text, ids, finish, usage, rid)."""
    c = client(gw)
    for _ in range(3):
        create = c.chat.completions if kind == "chat" else c.completions
        body = {"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT}
        raw = create.with_raw_response.create(model="demo", stream=True, stream_options={"include_usage": True},
                                              **body, **params)
        rid, worker_id = raw.headers["X-Request-Id"], raw.headers["X-Adaserve-Worker"]
        parts: list[str] = []
        ids: set[str] = set()
        finish, usage, killed = None, None, False
        for chunk in raw.parse():
            ids.add(chunk.id)
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                piece = choice.delta.content if kind == "chat" else choice.text
                parts.append(piece or "")
                finish = choice.finish_reason or finish
            if not killed and len("".join(parts)) >= CUT_AFTER_CHARS:
                killed = freeze_then_kill(fleet, rds, rid, worker_id)
                if not killed:
                    break  # it had already ended: drop this one and try again
        if killed:
            return "".join(parts), ids, finish, usage, rid
    raise AssertionError("the answer always ended before its worker could be frozen")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_greedy_stream_survives_its_workers_kill(gateway: GatewayProcess, fleet: Fleet,
                                                   rds: tuple[redis.Redis, str], kind: str) -> None:
    two_ready(fleet, gateway)
    params = {"max_tokens": LONG, "temperature": 0, "extra_body": {"ignore_eos": True}}
    want, prompt_tokens, completion_tokens = reference(gateway, kind, **params)
    text, ids, finish, usage, rid = killed_stream(gateway, fleet, rds, kind, **params)
    assert text == want and len(want) > 100
    assert ids == {rid} and finish == "length"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    rec = record(rds, rid)
    assert rec["status"] == "done" and rec["attempts"] == "2" and rec["tokens"] == str(LONG), rec


def test_a_seeded_sample_goes_on_as_the_unbroken_run(gateway: GatewayProcess, fleet: Fleet,
                                                     rds: tuple[redis.Redis, str]) -> None:
    """The continuation skips the random draws of the tokens already sent: same seed, same tokens."""
    two_ready(fleet, gateway)
    params = {"max_tokens": LONG, "temperature": 0.8, "seed": 1234, "extra_body": {"ignore_eos": True}}
    want, _, _ = reference(gateway, "completion", **params)
    text, _, finish, usage, rid = killed_stream(gateway, fleet, rds, "completion", **params)
    assert text == want and finish == "length"
    assert usage is not None and usage.completion_tokens == LONG
    assert record(rds, rid)["attempts"] == "2"


def test_a_silent_worker_is_left_after_token_timeout_s(rds: tuple[redis.Redis, str], fleet: Fleet,
                                                      tmp_path: Path) -> None:
    """A worker that hangs (frozen, its connection open) is given up after ``token_timeout_s``: the answer goes
    on elsewhere, whole, and the hung worker is told to abort (it does, once it runs again)."""
    while len(fleet.live()) < 2:
        fleet.start().wait_ready()
    classes = tmp_path / "lax.json"
    classes.write_text("[" + ",".join(c.model_dump_json(by_alias=True, exclude_none=True) for c in LAX) + "]")
    gw = start_gateway(tmp_path / "gw-hang.log", "--redis-url", REDIS_URL, "--redis-prefix", rds[1],
                       "--slo-classes-file", str(classes), "--default-slo-class", "chat",
                       env={"ADASERVE_GATEWAY_TOKEN_TIMEOUT_S": "3"})
    frozen: Service | None = None
    try:
        gw.wait_workers(2)
        c = client(gw)
        params = {"max_tokens": LONG, "temperature": 0, "extra_body": {"ignore_eos": True}}
        want = c.completions.create(model="demo", prompt=PROMPT, **params).choices[0].text
        for _ in range(3):
            raw = c.completions.with_raw_response.create(model="demo", prompt=PROMPT, stream=True, **params)
            rid, wid = raw.headers["X-Request-Id"], raw.headers["X-Adaserve-Worker"]
            parts: list[str] = []
            stream = raw.parse()
            for chunk in stream:
                parts.append(chunk.choices[0].text if chunk.choices else "")
                if frozen is None and len("".join(parts)) >= CUT_AFTER_CHARS:
                    w = fleet.workers[wid]
                    w.proc.send_signal(signal.SIGSTOP)
                    time.sleep(0.5)
                    if rds[0].hget(f"{rds[1]}:requests:{rid}", "status") != "running":
                        w.proc.send_signal(signal.SIGCONT)  # it had already ended: try again
                        stream.close()
                        break
                    frozen = w
            if frozen is not None:
                break
        assert frozen is not None and "".join(parts) == want
        rec = record(rds, rid)
        assert rec["attempts"] == "2" and rec["worker"] != wid and rec["status"] == "done", rec
        assert "sent nothing for 3s" in gw.logs()
        frozen.proc.send_signal(signal.SIGCONT)
        # the abort reaches it once it runs: nothing left in flight there
        assert wait_for(lambda: metric(scrape(frozen.url), "adaserve_active_requests", slo_class="chat") == 0, 30)
    finally:
        if frozen is not None:
            frozen.proc.send_signal(signal.SIGCONT)
        assert gw.stop() == 0, gw.logs()[-3000:]


def test_a_json_answer_survives_its_workers_kill(gateway: GatewayProcess, fleet: Fleet,
                                                 rds: tuple[redis.Redis, str]) -> None:
    """Not streamed: the gateway has tokens the client has not seen yet; the answer still comes whole."""
    two_ready(fleet, gateway)
    params = {"max_tokens": LONG, "temperature": 0, "extra_body": {"ignore_eos": True}}
    want, prompt_tokens, _ = reference(gateway, "completion", **params)
    c = client(gateway)
    for _ in range(3):
        before = metric(scrape(gateway.url), "adaserve_gateway_output_tokens_total", slo_class="summarization")
        got: dict[str, Any] = {}

        def call(got: dict[str, Any] = got) -> None:
            raw = c.completions.with_raw_response.create(model="demo", prompt=PROMPT,
                                                         extra_headers={"X-SLO-Class": "summarization"}, **params)
            got["raw"], got["answer"] = raw, raw.parse()

        t = threading.Thread(target=call)
        t.start()
        # tokens have reached the gateway: the answer is under way on some worker
        assert wait_for(lambda b=before: metric(scrape(gateway.url), "adaserve_gateway_output_tokens_total",
                                                slo_class="summarization") >= b + CUT_AFTER_TOKENS, timeout=60,
                        interval=0.02)
        rid = wait_for(lambda: next(iter(k.rsplit(":", 1)[1] for k in rds[0].scan_iter(f"{rds[1]}:requests:cmpl-*")
                                          if rds[0].hget(k, "status") == "running"), None), timeout=10)
        assert rid
        killed = freeze_then_kill(fleet, rds, rid, rds[0].hget(f"{rds[1]}:requests:{rid}", "worker"))
        t.join(120)
        assert "answer" in got
        if killed:
            answer = got["answer"]
            assert answer.id == rid and answer.choices[0].text == want
            assert answer.usage.completion_tokens == LONG and answer.usage.prompt_tokens == prompt_tokens
            assert record(rds, rid)["attempts"] == "2"
            return
    raise AssertionError("the answer always ended before its worker could be frozen")


def test_a_continuation_on_the_worker_api(fleet: Fleet) -> None:
    """The contract's continuation, worker-side: the tokens given extend the prompt, are not output, and a
    seeded sample goes on with the draws of an unbroken run; the text goes on from the text shown."""
    w = fleet.live()[0]
    for temperature in (0.0, 0.9):
        body = {"prompt": PROMPT, "max_tokens": 40, "temperature": temperature, "seed": 5, "ignore_eos": True}
        whole = direct(w, **body)
        k = 13
        shown = httpx.post(f"{w.url}/v1/generate", timeout=60,
                           json={**body, "max_tokens": k}).json()["text"]
        rest = direct(w, **{**body, "max_tokens": 40 - k, "resume_token_ids": whole["token_ids"][:k],
                            "resume_text": shown})
        assert rest["token_ids"] == whole["token_ids"][k:]
        assert shown + rest["text"] == whole["text"]
        assert rest["prompt_tokens"] == whole["prompt_tokens"]
        assert rest["metrics"]["num_tokens"] == 40 - k
    bad = httpx.post(f"{w.url}/v1/generate", json={"prompt": "x", "resume_text": "y"}, timeout=10)
    assert bad.status_code in (400, 422)


def test_a_continuation_finds_a_stop_string_across_the_seam(fleet: Fleet) -> None:
    """A stop string begun in the tokens already sent and completed by the new worker still stops the answer,
    at the same token as an unbroken run (the engine's matcher is primed with the earlier tokens)."""
    w = fleet.live()[0]
    base = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    text = direct(w, **base)["text"]
    # a stop string of two characters: the last of token k-1's text and the first of token k's
    for k in range(10, 50):
        head = httpx.post(f"{w.url}/v1/generate", json={**base, "max_tokens": k}, timeout=60).json()["text"]
        stop = text[len(head) - 1: len(head) + 1]
        if 0 < len(head) < len(text) and text.find(stop) == len(head) - 1:
            break
    else:
        raise AssertionError(f"no two characters straddling a token boundary occur first there: {text!r}")
    whole = direct(w, **base, stop=[stop])
    cut = len(whole["token_ids"])
    assert whole["finish_reason"] == "stop" and cut < 60
    assert cut == k + 1, (cut, k)  # the stop string's last character is token k's
    # resume right before that token; no resume_text: the worker shows what the earlier one would have
    # (the stop string's first character held back), so there is nothing left to show
    rest = direct(w, **{**base, "stop": [stop], "max_tokens": 60 - k, "resume_token_ids": whole["token_ids"][:k]})
    assert rest["finish_reason"] == "stop" and rest["token_ids"] == whole["token_ids"][k:]
    assert rest["text"] == "" and whole["text"] == head[:-1]


def test_queued_requests_wait_through_a_drain_for_the_next_worker(rds: tuple[redis.Redis, str], tmp_path: Path
                                                                  ) -> None:
    """One worker, one slot: a long answer holds it and a second request queues in the gateway. The worker is
    drained with a grace shorter than the answer; a new worker comes up only later, well past the queue
    timeout. The queued request is served by the new worker, and the cut answer goes on there, whole."""
    r, prefix = rds
    fleet = Fleet(tmp_path, f"{prefix}-drain")
    gw = None
    try:
        first = fleet.start(ADASERVE_MAX_ACTIVE_REQUESTS="1", ADASERVE_DRAIN_GRACE_S="1")
        first.wait_ready()
        classes = tmp_path / "lax.json"
        classes.write_text("[" + ",".join(c.model_dump_json(by_alias=True, exclude_none=True) for c in LAX) + "]")
        gw = start_gateway(tmp_path / "gw.log", "--redis-url", REDIS_URL, "--redis-prefix", f"{prefix}-drain",
                           "--slo-classes-file", str(classes), "--default-slo-class", "chat",
                           "--queue-timeout-s", str(QUEUE_TIMEOUT_S), env={"ADASERVE_GATEWAY_WORKER_WAIT_S": "120"})
        gw.wait_workers(1)
        c = client(gw)
        params = {"max_tokens": 1500, "temperature": 0, "extra_body": {"ignore_eos": True}}
        want = direct(first, prompt=PROMPT, max_tokens=1500, temperature=0, ignore_eos=True)["text"]
        out: dict[str, Any] = {}

        def long_one() -> None:
            out["long"] = c.completions.create(model="demo", prompt=PROMPT, stream=True, **params)
            out["long_text"] = "".join(ch.choices[0].text for ch in out["long"] if ch.choices)

        def queued_one() -> None:
            try:
                out["queued"] = c.completions.create(model="demo", prompt="import sys", max_tokens=8, temperature=0)
            except openai.APIError as e:
                out["queued_error"] = e

        a = threading.Thread(target=long_one)
        a.start()
        assert wait_for(lambda: metric(scrape(first.url), "adaserve_active_requests", slo_class="chat") == 1, 60)
        b = threading.Thread(target=queued_one)
        b.start()
        assert wait_for(lambda: metric(scrape(gw.url), "adaserve_gateway_queued") == 1, 30), gw.logs()[-2000:]
        queued_at = time.monotonic()
        first.proc.send_signal(signal.SIGTERM)  # drain: grace 1 s, then the long answer is aborted there
        assert first.proc.wait(60) == 0
        time.sleep(max(0.0, queued_at + QUEUE_TIMEOUT_S + 2 - time.monotonic()))  # past the queue timeout
        assert "queued" not in out and "queued_error" not in out
        fleet.start().wait_ready()
        b.join(120)
        a.join(300)
        assert "queued" in out, out.get("queued_error")
        assert out["long_text"] == want
    finally:
        if gw is not None:
            assert gw.stop() == 0, gw.logs()[-3000:]
        fleet.stop()
        for key in r.scan_iter(f"{prefix}-drain:*"):
            r.delete(key)
