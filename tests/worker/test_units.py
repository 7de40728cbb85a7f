"""Pure pieces of the worker: settings, incremental text, validation messages, CLI errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from adaserve.error_fields import field_path
from adaserve.server_process import free_port
from adaserve.worker.detok import IncrementalText
from adaserve.worker.routes.openai import _submit_all
from adaserve.worker.runtime import RequestRefused
from adaserve.worker.settings import WorkerSettings
from tests.models import make_checkpoint


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_settings_from_environment(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADASERVE_TARGET", str(model_dir))
    monkeypatch.setenv("ADASERVE_POLICY", "incremental")
    monkeypatch.setenv("ADASERVE_PORT", "9001")
    monkeypatch.setenv("ADASERVE_SLO_CLASSES", '{"chat": 50, "summarization": 150}')
    monkeypatch.setenv("ADASERVE_REDIS_URL", "")  # empty = unset: local mode
    s = WorkerSettings()
    assert s.port == 9001 and s.slo_classes == {"chat": 50.0, "summarization": 150.0}
    assert s.redis_url is None and s.worker_id.endswith("-9001")
    assert WorkerSettings(port=9002).port == 9002  # explicit values (the command line) win


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"port": 0}, "port"),
        ({"budget": 0}, "budget"),
        ({"device": "tpu"}, "device"),
        ({"slo_classes": {"chat": -1}}, "slo_classes"),
        ({"redis_url": "localhost:6379"}, "redis_url"),
        ({"heartbeat_s": 5, "registration_ttl_s": 5}, "registration_ttl_s"),
    ],
)
def test_settings_validation_names_the_field(model_dir: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        WorkerSettings(target=model_dir, policy="incremental", **kwargs)


def test_redis_auth_and_the_token_come_from_the_environment_and_never_show(model_dir: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADASERVE_REDIS_URL", "rediss://redis.example:6380/0")
    monkeypatch.setenv("ADASERVE_REDIS_PASSWORD", "pw-123")
    monkeypatch.setenv("ADASERVE_REDIS_USERNAME", "svc")
    monkeypatch.setenv("ADASERVE_AUTH_TOKEN", "tok-456")
    s = WorkerSettings(target=model_dir, policy="incremental")
    assert (s.redis_auth.password, s.redis_auth.username, s.redis_auth.ca_file) == ("pw-123", "svc", None)
    assert s.auth_token is not None and s.auth_token.get_secret_value() == "tok-456"
    assert "pw-123" not in repr(s) and "tok-456" not in repr(s) and "pw-123" not in repr(s.redis_auth)


@pytest.mark.parametrize(("env", "words"), [
    ({"ADASERVE_REDIS_PASSWORD": "p"}, "ADASERVE_REDIS_PASSWORD is set but there is no Redis URL"),
    ({"ADASERVE_REDIS_URL": "redis://r/0", "ADASERVE_REDIS_TLS_CA_FILE": "/etc/hosts"}, "needs a rediss:// URL"),
    ({"ADASERVE_REDIS_URL": "redis://:a@r/0", "ADASERVE_REDIS_PASSWORD": "b"}, "keep it out of the URL"),
    ({"ADASERVE_AUTH_TOKEN": "  "}, "ADASERVE_AUTH_TOKEN is empty"),
])
def test_redis_auth_and_token_settings_that_cannot_work_are_refused(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   env: dict[str, str], words: str) -> None:
    monkeypatch.delenv("ADASERVE_REDIS_URL", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError, match=words):
        WorkerSettings(target=model_dir, policy="incremental")


def test_settings_target_must_be_a_model(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"(?s)target.*config\.json.*smollm2-135m-instruct"):
        WorkerSettings(target=tmp_path)
    with pytest.raises(ValidationError, match=r"(?s)draft.*GGUF file .*missing\.gguf does not exist"):
        WorkerSettings(target="demo-tiny", draft=tmp_path / "missing.gguf")


def test_settings_name_the_served_model_after_the_reference(model_dir: Path) -> None:
    assert WorkerSettings().target == "smollm2-135m-instruct"  # the default model, no option needed
    assert WorkerSettings().served_model_name == "smollm2-135m-instruct"
    assert WorkerSettings(target="demo-tiny").served_model_name == "demo"
    plain = {"target": model_dir, "policy": "incremental"}
    assert WorkerSettings(**plain).served_model_name == model_dir.name
    assert WorkerSettings(**plain, model_name="mine").served_model_name == "mine"


def test_incremental_text_holds_back_partial_characters_and_stop_prefixes() -> None:
    pieces = {1: "ab", 2: "c\ufffd", 3: "é", 4: "<", 5: "/s", 6: ">tail"}

    def decode(ids: list[int]) -> str:
        text = "".join(pieces[i] for i in ids)
        return text.replace("\ufffdé", "é")  # a character split over tokens 2 and 3

    t = IncrementalText(decode, ("</s>",))
    assert t.push([1], finished=False) == "ab"
    assert t.push([2], finished=False) == "c"  # the half character waits
    assert t.push([3], finished=False) == "é"
    assert t.push([4], finished=False) == ""  # could be the start of "</s>"
    assert t.push([5], finished=False) == ""
    assert t.push([6], finished=True) == ""
    assert t.stopped and t.text == "abcé"


def test_incremental_text_flushes_everything_at_the_end() -> None:
    t = IncrementalText(lambda ids: "x<" * len(ids), ("<>",))
    assert t.push([1], finished=False) == "x"
    assert t.push([2], finished=True) == "<x<"
    assert not t.stopped and t.text == "x<x<"


def test_validation_field_names() -> None:
    assert field_path(("body", "prompt_token_ids", 2)) == "prompt_token_ids[2]"
    assert field_path(("body", "messages", 0, "role")) == "messages[0].role"
    assert field_path(("header", "X-SLO-Class")) == "X-SLO-Class"
    assert field_path(("body",)) == "body"


def test_worker_cli_rejects_bad_settings_in_one_line(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "adaserve", "worker", "--target", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.startswith("adaserve: error: target (--target or ADASERVE_TARGET)")
    assert "Traceback" not in res.stderr


def test_a_directory_target_without_a_draft_needs_policy_incremental(model_dir: Path) -> None:
    with pytest.raises(ValidationError, match="brings no draft"):
        WorkerSettings(target=model_dir)
    assert WorkerSettings(target=model_dir, policy="incremental").draft is None
    assert WorkerSettings(target="demo-tiny").draft is None  # a named model brings its own


def test_worker_exits_2_when_the_engine_cannot_be_built(tmp_path: Path) -> None:
    """Loading happens after the server is up (so /healthz answers meanwhile); a failure still exits 2."""
    bad = make_checkpoint(tmp_path / "gpt", "llama")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, "-m", "adaserve", "worker", "--target", str(bad), "--policy", "incremental",
                          "--port", str(free_port())], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("adaserve: error:")]
    assert len(errors) == 1 and "unsupported architecture" in errors[0]


@pytest.mark.parametrize(("size", "words"), [
    ("0", "greater than or equal to 1"),
    ("-2", "greater than or equal to 1"),
    # demo-tiny: 4 attention heads, 2 KV heads (3 ranks split them unevenly: parallel.split)
    ("5", "tensor parallel size 5 is more than num_attention_heads=4"),
    ("8", "tensor parallel size 8 is more than num_attention_heads=4"),
])
def test_worker_refuses_a_tensor_parallel_size_the_model_cannot_take(size: str, words: str) -> None:
    """Before anything loads, in one line, exit 2: a size below 1 or more ranks than the model has heads."""
    res = subprocess.run([sys.executable, "-m", "adaserve", "worker", "--target", "demo-tiny",
                          "--tensor-parallel-size", size, "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("adaserve: error: tensor_parallel_size (--tensor-parallel-size or "
                                 "ADASERVE_TENSOR_PARALLEL_SIZE): "), res.stderr
    assert words in res.stderr and "Traceback" not in res.stderr


def test_tensor_parallel_size_comes_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ADASERVE_TENSOR_PARALLEL_SIZE", "2")
    assert WorkerSettings(target="demo-tiny").tensor_parallel_size == 2
    assert WorkerSettings(target="demo-tiny", tensor_parallel_size=1).tensor_parallel_size == 1  # the option wins
    monkeypatch.setenv("ADASERVE_TENSOR_PARALLEL_SIZE", "5")
    with pytest.raises(ValidationError, match="is more than num_attention_heads=4"):
        WorkerSettings(target="demo-tiny")


def test_a_refused_sequence_aborts_those_already_submitted() -> None:
    """n > 1 on a worker's OpenAI route: when the engine refuses one sequence (overloaded), the answer is that
    refusal and the sequences already submitted are aborted, not left to run for nobody."""
    class Runtime:
        def __init__(self) -> None:
            self.submitted: list[str] = []
            self.aborted: list[str] = []

        async def submit(self, body: SimpleNamespace) -> SimpleNamespace:
            if len(self.submitted) == 2:
                raise RequestRefused(503, "overloaded: 2 requests in flight")
            self.submitted.append(body.request_id)
            return SimpleNamespace(request_id=body.request_id, done=False)

        def abort(self, request_id: str) -> bool:
            self.aborted.append(request_id)
            return True

    runtime = Runtime()
    with pytest.raises(RequestRefused, match="overloaded"):
        asyncio.run(_submit_all(runtime, [SimpleNamespace(request_id=f"c-{i}") for i in range(3)]))  # type: ignore[arg-type]
    assert runtime.aborted == runtime.submitted == ["c-0", "c-1"]
    ok = Runtime()
    flights = asyncio.run(_submit_all(ok, [SimpleNamespace(request_id=f"c-{i}") for i in range(2)]))  # type: ignore[arg-type]
    assert [f.request_id for f in flights] == ["c-0", "c-1"] and ok.aborted == []


def test_one_tokenizer_serves_the_event_loop_and_the_engine_thread() -> None:
    """A worker whose model takes adaserve's own tokenizer (loading/tokenizer.py: it is never changed after
    loading, so threads may share it) holds one copy, the engine's; the transformers fallback would load a
    second for the event loop (runtime.py says why)."""
    from adaserve.engine.loading.tokenizer import Tokenizer
    from adaserve.worker.runtime import Runtime

    runtime = Runtime(WorkerSettings(target="demo-tiny", budget=8, warmup=False))
    built, tokenizer, _ = runtime._prepare()
    assert isinstance(tokenizer, Tokenizer) and tokenizer is built.tokenizer
