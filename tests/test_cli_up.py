"""``adaserve up``: the README's first command serves the demo pair through the gateway, and stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from adaserve.server_process import free_port
from tests.servers import ROOT, demo_pair


def test_adaserve_up_answers_curl_and_openai_then_stops(tmp_path: Path) -> None:
    demo_pair()
    port = free_port()
    log = tmp_path / "up.log"
    env = {**os.environ, "ADASERVE_TORCH_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "adaserve", "up", "--port", str(port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "adaserve is up" not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        banner = log.read_text()
        assert url in banner and "curl" in banner and "from openai import OpenAI" in banner
        r = httpx.post(f"{url}/v1/completions", headers={"X-SLO-Class": "chat"}, timeout=60,
                       json={"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["text"]
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0,
            stream=True) if ch.choices)
        assert text
        assert httpx.get(f"{url}/v1/slo-classes").json()["default"] == "chat"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0, log.read_text()[-3000:]
    # the worker child went with it
    assert "draining" in log.read_text()


def test_adaserve_up_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--target", str(tmp_path / "nope")], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().startswith("adaserve: error: target model directory")
    assert "Traceback" not in r.stderr
    bad = tmp_path / "classes.json"
    bad.write_text('[{"name": "a", "tpotMs": 0}]')
    r = subprocess.run([sys.executable, "-m", "adaserve", "up", "--slo-classes-file", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "tpotMs" in r.stderr and "Traceback" not in r.stderr
