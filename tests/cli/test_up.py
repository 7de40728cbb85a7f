"""``adaserve up``: the README's first command serves SmolLM2-135M-Instruct through the gateway, with SLO
classes scaled to this machine, and stops cleanly (about two minutes here: conversion, profile, answers)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from adaserve.gateway.slo import LOCAL_MULTIPLIERS
from adaserve.server_process import free_port
from tests.servers import ROOT


def plain_answer(question: str, max_tokens: int) -> str:
    """Plain greedy decoding of one user turn on the default model, served as `up` serves it (weights auto)."""
    from adaserve.engine.build import build_engine
    from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve
    from adaserve.engine.loading.chat import instruction_ids
    from adaserve.engine.loading.loader import load_tokenizer
    from adaserve.engine.request import Request
    from adaserve.engine.speculation.sampling import SamplingParams

    pair = resolve(DEFAULT_MODEL, progress=False, weights="auto")
    tok = load_tokenizer(pair.target)
    eng = build_engine(target=pair.target, draft=None, policy="incremental", budget=16, profile=False,
                       progress=False, weights="auto").engine
    req = Request("plain", instruction_ids(tok, question), SamplingParams(max_tokens=max_tokens))
    eng.run([(0.0, req)])
    return tok.decode(req.output_ids, skip_special_tokens=True).strip()


def test_adaserve_up_serves_the_default_model_then_stops(tmp_path: Path) -> None:
    port, worker_port = free_port(), free_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "ADASERVE_TORCH_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "adaserve", "up", "--port", str(port),
                                 "--worker-port", str(worker_port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900  # a first start on a busy machine profiles it, slowly
        while "adaserve is up" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        banner = log.read_text()
        assert url in banner and "curl" in banner and "from openai import OpenAI" in banner
        assert "per-token latency: one forward" in banner and "a lone request served" in banner
        assert "INFEASIBLE" not in banner
        # the worker says what it serves: the answers depend on the kernels (docs/models.md)
        from adaserve.engine.model import native_kernels

        on = "on the integer kernels" if native_kernels.chosen() is not None else "on torch's kernels"
        assert f"adaserve: weights int4+int8 {on}" in banner, banner
        classes = httpx.get(f"{url}/v1/slo-classes").json()
        assert classes["default"] == "chat"
        tpot = {c["name"]: c["tpot_ms"] for c in classes["data"]}
        # each class is its multiplier (2x, 2.5x, 6x) times the slower of the TPOT a lone request of its own kind
        # measurably got at the worker's warm-up and the gateway's prediction for one (up.lone_bases): never below
        # the multiple of the worker's own measurement. Coding and chat are scaled from different measurements, so
        # their order is not a contract (on a loaded machine coding's lone TPOT read 1.28x chat's)
        measured = httpx.get(f"http://127.0.0.1:{worker_port}/v1/profile").json()["lone_tpot_ms_by_class"]
        lone = float(re.search(r"a lone request served: ([0-9.]+) ms", banner).group(1))
        for name, mult in LOCAL_MULTIPLIERS.items():
            assert tpot[name] >= round(mult * measured[name]), (name, tpot, measured)
            assert tpot[name] / mult <= 3 * lone, (name, tpot, lone)  # the prediction: a lone request's TPOT too
        assert max(tpot["coding"], tpot["chat"]) < tpot["summarization"]
        assert all(c["feasibility"] in ("plain", "speculation") for c in classes["data"])
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        answer = c.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24, temperature=0, extra_headers={"X-SLO-Class": "coding"})
        # the served model's own answer, through the whole stack with speculation: plain greedy decoding of the same
        # turn in this process, on the weights and kernels `up` serves here. (The shipped int4 model answers
        # "L'Étoile, la Marseillaise, ...", as llama.cpp does on the same GGUF; float32 says Paris: docs/models.md.)
        assert answer.choices[0].message.content.strip() == plain_answer("What is the capital of France?", 24)
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Name three primary colors."}],
            max_tokens=16, temperature=0, stream=True) if ch.choices)
        assert text.strip()
        r = httpx.post(f"{url}/v1/completions", headers={"X-SLO-Class": "chat"}, timeout=60,
                       json={"model": "smollm2-135m-instruct", "prompt": "def fibonacci(n):", "max_tokens": 8,
                             "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    # the worker child went with it
    assert "draining" in log.read_text()


def test_adaserve_up_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--model", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("adaserve: error: ") and "nope is not a model" in r.stderr
    assert "Traceback" not in r.stderr
    bad = tmp_path / "classes.json"
    bad.write_text('[{"name": "a", "tpotMs": 0}]')
    r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--slo-classes-file", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tpotMs" in r.stderr and "Traceback" not in r.stderr
    for bad in ("0", "-5", "nan"):
        r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--ready-timeout", bad], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--ready-timeout must be a positive number" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_adaserve_up_gives_up_after_its_ready_timeout_and_stops_the_worker(tmp_path: Path) -> None:
    """A worker still loading when --ready-timeout runs out: one line naming the flag, exit 2, no worker left."""
    name = f"ready-timeout-{os.getpid()}"  # names this test's worker alone among the processes
    r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--model", "demo-tiny", "--model-name", name,
                        "--port", str(free_port("127.0.0.1")), "--ready-timeout", "0.5"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "the worker was not ready after 0s" in r.stderr or "the worker was not ready after 1s" in r.stderr
    assert "--ready-timeout" in r.stderr and "Traceback" not in r.stderr
    left = subprocess.run(["pgrep", "-f", f"--model-name {name}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "the worker outlived adaserve up"
