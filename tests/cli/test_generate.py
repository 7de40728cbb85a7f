"""`adaserve generate`: the command-line contract, run as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.helpers import hf_greedy
from tests.models import make_checkpoint


def adaserve(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "adaserve", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_generate_greedy_matches_target_alone(tmp_path: Path, target_dir: Path, draft_dir: Path) -> None:
    rows = [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i][: 1 + i % 3] * (1 + i), "max_tokens": 4 + 3 * i}
            for i in range(8)]
    inp, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    for policy in ["beam:3,2", "incremental"]:
        res = adaserve("generate", "--target", target_dir, "--draft", draft_dir, "--input", inp, "--output", out,
                       "--policy", policy, "--budget", "16")
        assert res.returncode == 0, res.stderr
        got = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(got) == len(rows)
        for row, g in zip(rows, got, strict=True):
            assert g["token_ids"] == hf_greedy(target_dir, row["prompt_token_ids"], row["max_tokens"], eos=1)
            assert g["finish_reason"] == ("stop" if g["token_ids"][-1] == 1 else "length")
            assert g["ttft_ms"] is not None and g["ttft_ms"] >= 0
            assert isinstance(g["accepted_per_step"], list)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json\n", "not valid JSON"),
        ('{"prompt_token_ids": [1], "max_tokens": 0}\n', "max_tokens"),
        ('{"prompt_token_ids": [1], "temperature": -1}\n', "temperature"),
        ('{"prompt": "x", "prompt_token_ids": [1]}\n', "exactly one"),
        ('{"prompt_token_ids": [1], "colour": 1}\n', "unknown field"),
        ('{"prompt_token_ids": [1000]}\n', "token ids"),
        ('{"prompt_token_ids": [1], "max_tokens": 100000}\n', "context"),
        ("", "no prompts"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, target_dir: Path, content: str, message: str) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(content)
    res = adaserve("generate", "--target", target_dir, "--input", inp, "--output", tmp_path / "o.jsonl",
                   "--policy", "incremental")
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("adaserve: error:")]
    assert len(errors) == 1 and message in errors[0]


def test_missing_model_unsupported_arch_unreadable_input(tmp_path: Path) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2]}])
    res = adaserve("generate", "--target", tmp_path / "nope", "--input", inp, "--output", tmp_path / "o.jsonl",
                   "--policy", "incremental")
    assert res.returncode == 2 and "nope' not found" in res.stderr and "Traceback" not in res.stderr

    bad = make_checkpoint(tmp_path / "gpt", "llama")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    res = adaserve("generate", "--target", bad, "--input", inp, "--output", tmp_path / "o.jsonl",
                   "--policy", "incremental")
    assert res.returncode == 2 and "unsupported architecture" in res.stderr

    res = adaserve("generate", "--target", bad, "--input", tmp_path / "missing.jsonl", "--output",
                   tmp_path / "o.jsonl")
    assert res.returncode == 2 and "cannot read input" in res.stderr

    res = adaserve("generate", "--target", bad, "--input", inp, "--output", tmp_path / "o.jsonl",
                   "--policy", "warp-drive")
    assert res.returncode == 2 and "unknown policy" in res.stderr
