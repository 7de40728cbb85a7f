"""Several drafts on a worker (issue 18): settings, the command line, what it publishes, and a real worker
serving the default model with both of its catalog drafts, greedy output equal to the target's own."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from pydantic import ValidationError

from adaserve.cli.worker import OPTIONS, draft_options, load_settings
from adaserve.engine.loading import catalog
from adaserve.worker.published import model_names
from adaserve.worker.settings import WorkerSettings
from tests.models import smollm2_pair
from tests.servers import Service, metric, scrape, start_worker

DRAFTS = ["smollm2-draft", "smollm2-draft-small"]  # the default model's two, by their catalog names


@pytest.fixture
def model_dirs(tmp_path: Path) -> tuple[str, str, str]:
    out = []
    for name in ("target", "d0", "d1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        out.append(str(tmp_path / name))
    return out[0], out[1], out[2]


def test_drafts_from_the_environment_as_a_json_list(model_dirs: tuple[str, str, str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    target, d0, d1 = model_dirs
    monkeypatch.setenv("ADASERVE_TARGET", target)
    monkeypatch.setenv("ADASERVE_DRAFTS", json.dumps([d0, d1]))
    s = WorkerSettings()
    assert s.drafts == [d0, d1] and s.draft is None and s.draft_refs == [d0, d1]
    names = model_names(s)
    assert (names.draft, names.drafts) == (d0, [d0, d1])  # the first is the profiled one


def test_one_draft_is_as_before(model_dirs: tuple[str, str, str]) -> None:
    target, d0, _ = model_dirs
    s = WorkerSettings(target=target, draft=d0)
    assert s.draft_refs == [d0] and s.drafts == []
    assert (model_names(s).draft, model_names(s).drafts) == (d0, [])
    assert WorkerSettings(target="demo-tiny").draft_refs == []  # a named model brings its own


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"draft": "D0", "drafts": ["D0", "D1"]}, "set draft or drafts, not both"),
        ({"drafts": ["D0", "D0"]}, "a draft is named twice"),
        ({"drafts": ["D0", "/no/such/draft"]}, r"drafts\.1|/no/such/draft"),
        ({"drafts": ["D0", "D1"], "policy": "spin@d2"}, r"pins draft 2, but there are 2 drafts \(d0\.\.d1\)"),
    ],
)
def test_bad_drafts_are_one_clear_settings_error(model_dirs: tuple[str, str, str], extra: dict, words: str) -> None:
    target, d0, d1 = model_dirs
    real = {k: ([{"D0": d0, "D1": d1}.get(x, x) for x in v] if isinstance(v, list) else {"D0": d0}.get(v, v))
            for k, v in extra.items()}
    with pytest.raises(ValidationError, match=words):
        WorkerSettings(target=target, **real)


def test_repeated_draft_option_is_drafts_and_wins_over_the_environment(
        model_dirs: tuple[str, str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    target, d0, d1 = model_dirs
    assert draft_options(None) == {} and draft_options([d0]) == {"draft": d0, "drafts": []}
    assert draft_options([d0, d1]) == {"draft": None, "drafts": [d0, d1]}
    monkeypatch.setenv("ADASERVE_DRAFTS", json.dumps([d1, d0]))
    # every option unset (the parser's None), so that a new option cannot break this test
    args = argparse.Namespace(**{name: None for name in (*OPTIONS, "draft", "reprofile")})
    args.target, args.draft = target, [d0]
    s = load_settings(args)
    assert (s.draft, s.drafts) == (d0, [])  # one --draft replaces the environment's list
    args.draft = [d0, d1]
    assert load_settings(args).draft_refs == [d0, d1]


# A real worker: the default model (SmolLM2-135M-Instruct from its GGUF file) with both catalog drafts, the
# UCB selector choosing per slot. Every draft first gets 8 slots of 4 verifications (draft_bandit.py), so
# four concurrent 40-token requests (about 18 slots) run on both. The output must be the target's own greedy
# output.
PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a list.",
           "Name three primary colors.", "def fibonacci(n):")
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def pair() -> catalog.ModelPair:
    return smollm2_pair(with_draft=False)


@pytest.fixture(scope="module")
def worker(pair: catalog.ModelPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    log = tmp_path_factory.mktemp("drafts") / "worker.log"
    w = start_worker(catalog.DEFAULT_MODEL, DRAFTS[0], log, "--draft", DRAFTS[1], "--policy", "spin",
                     "--budget", "16", "--dtype", "float32", "--weights", "float",  # the reference is float32
                     env={"ADASERVE_REDIS_URL": "", "ADASERVE_WARMUP": "false"})
    try:
        w.wait_ready()
        yield w
    finally:
        assert w.stop() == 0, w.logs()[-3000:]


def test_worker_with_two_catalog_drafts_serves_the_targets_greedy_output(pair: catalog.ModelPair,
                                                                          worker: Service) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(pair.target))
    prompts = [list(tok.encode(p, add_special_tokens=True)) for p in PROMPTS]
    with httpx.Client(base_url=worker.url, timeout=300) as client:
        status = client.get("/v1/status").json()
        assert status["models"]["drafts"] == DRAFTS and status["models"]["draft"] == DRAFTS[0]
        body = {"max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0}
        with ThreadPoolExecutor(len(prompts)) as pool:  # together: one batch, drafts chosen per request
            answers = list(pool.map(
                lambda ids: client.post("/v1/generate", json={**body, "prompt_token_ids": ids}).json(), prompts))
    samples = scrape(worker.url)
    used = {d: metric(samples, "adaserve_draft_verifications_total", draft=d) for d in DRAFTS}
    assert all(n > 0 for n in used.values()), used  # each draft proposed some of the trees verified
    model = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()
    for ids, answer in zip(prompts, answers, strict=True):
        ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
        assert answer["token_ids"] == ref, answer
