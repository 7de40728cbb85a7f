"""Train the demo target/draft pair that the project's benchmarks and tests serve, offline, on CPU.

No model hub is reachable from the project's machines, so this script builds a small real pair from
a corpus every machine has: the Python standard library's ``.py`` sources.

1. Files: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` excluded), in
   sorted order of their relative paths; a file is held out for evaluation when the SHA-1 of its
   relative path is 0 modulo ``--heldout-mod``.
2. Tokenizer: byte-level BPE (``tokenizers``) trained on the training files, with ``<s>`` (id 0,
   prepended by the post-processor) and ``</s>`` (id 1, ends every file in the training stream).
3. Target: a Llama (GQA) model trained with next-token cross-entropy on random windows.
4. Draft: a one-layer Llama distilled from the target: KL(target || draft) on the target's logits,
   mixed with cross-entropy on the data.
5. Both are saved in Hugging Face format (bf16 safetensors), reloaded from disk in fp32 and
   evaluated on the held-out files: perplexities against an add-one unigram baseline, the draft's
   top-1 agreement with the target's greedy token, and batch-1 decode latency.

Run: ``python -m adaserve.training.train_demo --out models/demo [--seed 0] [--steps 700]``.
Everything is deterministic under ``--seed`` (seeded generators, sorted files, fixed thread count).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import shutil
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

BOS, EOS = "<s>", "</s>"
BOS_ID, EOS_ID = 0, 1
SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef main():")


@dataclass(frozen=True)
class Args:
    out: Path
    seed: int
    steps: int
    draft_steps: int
    batch_size: int
    seq_len: int
    lr: float
    draft_lr: float
    warmup: int
    kl_weight: float
    vocab_size: int
    heldout_mod: int
    eval_windows: int
    eval_every: int
    log_every: int
    threads: int
    latency_iters: int


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


# head_dim 64 on both: the size every attention kernel (FlashInfer included) supports
TARGET_SHAPE = ModelShape(hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2)
DRAFT_SHAPE = ModelShape(hidden_size=192, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=3, num_key_value_heads=1)


def parse_args(argv: list[str]) -> Args:
    p = argparse.ArgumentParser(prog="python -m adaserve.training.train_demo",
                                description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("models/demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=900, help="target training steps")
    p.add_argument("--draft-steps", type=int, default=600, help="draft distillation steps")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--kl-weight", type=float, default=0.8, help="draft loss = w * KL + (1 - w) * CE")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--heldout-mod", type=int, default=20, help="hold out ~1/N of the files")
    p.add_argument("--eval-windows", type=int, default=128, help="held-out windows of --seq-len tokens")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training and evaluation")
    p.add_argument("--latency-iters", type=int, default=200)
    return Args(**vars(p.parse_args(argv)))


# ----------------------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path) -> list[Path]:
    """Every ``.py`` file of the standard library, sorted by relative path, third-party code excluded."""
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def is_heldout(rel: str, mod: int) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % mod == 0


def read_texts(root: Path, files: list[Path]) -> dict[str, str]:
    """Relative path -> text; files that are not UTF-8 (a few deliberate test cases) are skipped."""
    texts: dict[str, str] = {}
    for f in files:
        try:
            texts[f.relative_to(root).as_posix()] = f.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def split_corpus(texts: dict[str, str], mod: int) -> tuple[list[str], list[str]]:
    train = [t for rel, t in texts.items() if not is_heldout(rel, mod)]
    heldout = [t for rel, t in texts.items() if is_heldout(rel, mod)]
    return train, heldout


# -------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


def save_tokenizer(tok: Tokenizer, path: Path, max_len: int) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers 4.x and 5.x both load offline."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """One token stream: ``<s> file </s>`` for each file, in order."""
    encs = tok.encode_batch(texts, add_special_tokens=False)
    parts = [np.asarray([BOS_ID, *e.ids, EOS_ID], dtype=np.int64) for e in encs]
    return np.concatenate(parts)


# ----------------------------------------------------------------------------------------- models


def llama_config(shape: ModelShape, vocab_size: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        **asdict(shape),
        head_dim=shape.hidden_size // shape.num_attention_heads,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
    )


def build_model(shape: ModelShape, vocab_size: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, vocab_size)).float()


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied embeddings are counted once


def save_model(model: torch.nn.Module, tok: Tokenizer, path: Path, max_len: int) -> None:
    from transformers import GenerationConfig

    if path.exists():
        shutil.rmtree(path)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    model.float()
    gen = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False)
    gen.save_pretrained(path)
    add_legacy_config_keys(path / "config.json")
    save_tokenizer(tok, path, max_len)


def add_legacy_config_keys(path: Path) -> None:
    """transformers 5 writes ``rope_parameters`` and ``dtype``; add the 4.x spellings for older readers."""
    cfg = json.loads(path.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_fp32(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval()


# --------------------------------------------------------------------------------------- training


def sample_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.float()


def ce_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def kl_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher || student)."""
    t = F.log_softmax(teacher.reshape(-1, teacher.shape[-1]), dim=-1)
    s = F.log_softmax(student.reshape(-1, student.shape[-1]), dim=-1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


LossFn = Callable[[torch.nn.Module, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def target_loss_fn() -> LossFn:
    def fn(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        loss = ce_loss(logits_of(model, batch[:, :-1]), batch[:, 1:])
        return loss, {"ce": loss.item()}

    return fn


def draft_loss_fn(teacher: torch.nn.Module, kl_weight: float) -> LossFn:
    def fn(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        x, y = batch[:, :-1], batch[:, 1:]
        with torch.no_grad():
            t_logits = logits_of(teacher, x)
        s_logits = logits_of(model, x)
        kl, ce = kl_loss(s_logits, t_logits), ce_loss(s_logits, y)
        loss = kl_weight * kl + (1 - kl_weight) * ce
        return loss, {"kl": kl.item(), "ce": ce.item()}

    return fn


@dataclass
class TrainResult:
    steps: int
    seconds: float
    final: dict[str, float]


def train(name: str, model: torch.nn.Module, loss_fn: LossFn, stream: torch.Tensor,
          eval_windows: torch.Tensor, args: Args, steps: int, lr: float, seed: int, log: TextIO) -> TrainResult:
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, lr)
    model.train()
    t0 = time.perf_counter()
    running: dict[str, float] = {}
    bar = tqdm(range(steps), desc=f"train {name}", unit="step", mininterval=2.0, file=sys.stderr)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, args.warmup)
        loss, parts = loss_fn(model, sample_batch(stream, args.batch_size, args.seq_len, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for k, v in {"loss": loss.item(), **parts}.items():
            running[k] = running.get(k, 0.0) + v
        done = step + 1
        if done % args.log_every == 0 or done == steps:
            n = args.log_every if done % args.log_every == 0 else done % args.log_every
            avg = {k: v / n for k, v in running.items()}
            running = {}
            msg = " ".join(f"{k} {v:.4f}" for k, v in avg.items())
            extra = ""
            if done % args.eval_every == 0 or done == steps:
                extra = f" heldout_ce {heldout_ce(model, eval_windows):.4f}"
                model.train()
            log.write(f"{name} step {done} lr {lr_at(step, steps, lr, args.warmup):.2e} {msg}{extra} "
                      f"elapsed {time.perf_counter() - t0:.1f}s\n")
            log.flush()
            bar.set_postfix_str(msg + extra)
    model.eval()
    return TrainResult(steps=steps, seconds=time.perf_counter() - t0, final=avg if steps else {})


# ------------------------------------------------------------------------------------- evaluation


def eval_windows_of(stream: np.ndarray, seq: int, n: int) -> torch.Tensor:
    """``n`` non-overlapping windows of ``seq`` tokens spread evenly over the held-out stream."""
    total = len(stream) // seq
    n = min(n, total)
    picks = np.linspace(0, total - 1, n).round().astype(np.int64)
    return torch.from_numpy(np.stack([stream[i * seq : (i + 1) * seq] for i in picks]))


def iter_chunks(windows: torch.Tensor, size: int = 8) -> Iterator[torch.Tensor]:
    for i in range(0, windows.shape[0], size):
        yield windows[i : i + size]


@torch.no_grad()
def heldout_ce(model: torch.nn.Module, windows: torch.Tensor) -> float:
    model.eval()
    total, count = 0.0, 0
    for chunk in iter_chunks(windows[: max(1, windows.shape[0] // 8)]):
        logits = logits_of(model, chunk[:, :-1])
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += chunk[:, 1:].numel()
    return total / count


@dataclass
class EvalResult:
    tokens: int
    target_ppl: float
    draft_ppl: float
    unigram_ppl: float
    target_top1_acc: float
    draft_top1_acc: float
    draft_target_agreement: float


def unigram_logprobs(train_stream: np.ndarray, vocab_size: int) -> torch.Tensor:
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0  # add-one
    return torch.from_numpy(np.log(counts / counts.sum()))


@torch.no_grad()
def evaluate(target: torch.nn.Module, draft: torch.nn.Module, windows: torch.Tensor,
             unigram: torch.Tensor) -> EvalResult:
    nll_t = nll_d = nll_u = 0.0
    hit_t = hit_d = agree = n = 0
    for chunk in tqdm(list(iter_chunks(windows)), desc="evaluate", unit="chunk", file=sys.stderr):
        x, y = chunk[:, :-1], chunk[:, 1:].reshape(-1)
        lt = logits_of(target, x).reshape(-1, unigram.numel())
        ld = logits_of(draft, x).reshape(-1, unigram.numel())
        nll_t += F.cross_entropy(lt, y, reduction="sum").item()
        nll_d += F.cross_entropy(ld, y, reduction="sum").item()
        nll_u += -unigram[y].sum().item()
        gt, gd = lt.argmax(-1), ld.argmax(-1)
        hit_t += int((gt == y).sum())
        hit_d += int((gd == y).sum())
        agree += int((gt == gd).sum())
        n += y.numel()
    return EvalResult(
        tokens=n,
        target_ppl=math.exp(nll_t / n),
        draft_ppl=math.exp(nll_d / n),
        unigram_ppl=math.exp(nll_u / n),
        target_top1_acc=hit_t / n,
        draft_top1_acc=hit_d / n,
        draft_target_agreement=agree / n,
    )


@torch.no_grad()
def decode_step_times(model: torch.nn.Module, context: torch.Tensor, iters: int) -> list[float]:
    """Seconds per batch-1 single-token forward on top of a KV cache of ``len(context)`` tokens."""
    cache = model(input_ids=context[None], use_cache=True).past_key_values
    nxt = context[-1:][None]
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        model(input_ids=nxt, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t)
        cache.crop(-1)  # back to the context length
    return times


@torch.no_grad()
def prefill_times(model: torch.nn.Module, context: torch.Tensor, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        model(input_ids=context[None], use_cache=False)
        times.append(time.perf_counter() - t)
    return times


def measure_latency(target: torch.nn.Module, draft: torch.nn.Module, context: torch.Tensor, threads: int,
                    iters: int) -> dict[str, float]:
    """Median latencies, target and draft measured in alternating rounds after a warm-up."""
    torch.set_num_threads(threads)
    rounds = 10
    per = max(1, iters // rounds)
    for m in (target, draft):  # warm-up
        decode_step_times(m, context, 20)
        prefill_times(m, context, 3)
    dt: list[float] = []
    dd: list[float] = []
    pt: list[float] = []
    pd: list[float] = []
    for _ in range(rounds):
        dt += decode_step_times(target, context, per)
        dd += decode_step_times(draft, context, per)
        pt += prefill_times(target, context, max(1, per // 10))
        pd += prefill_times(draft, context, max(1, per // 10))
    res = {
        "threads": threads,
        "context_tokens": int(context.numel()),
        "target_decode_ms": statistics.median(dt) * 1e3,
        "draft_decode_ms": statistics.median(dd) * 1e3,
        "target_prefill_ms": statistics.median(pt) * 1e3,
        "draft_prefill_ms": statistics.median(pd) * 1e3,
    }
    res["decode_ratio"] = res["target_decode_ms"] / res["draft_decode_ms"]
    res["prefill_ratio"] = res["target_prefill_ms"] / res["draft_prefill_ms"]
    return res


def greedy_samples(path: Path, model: torch.nn.Module, max_new: int = 64) -> dict[str, str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    out: dict[str, str] = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=EOS_ID,
                             pad_token_id=EOS_ID)
        out[prompt] = tok.decode(gen[0], skip_special_tokens=True)
    return out


# ----------------------------------------------------------------------------------------- report


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_summary(model: torch.nn.Module, shape: ModelShape, path: Path) -> dict[str, Any]:
    return {**asdict(shape), "params": param_count(model), "tie_word_embeddings": True,
            "dir_bytes": dir_bytes(path)}


def fmt_table(rows: list[tuple[str, str]]) -> str:
    lines = ["| quantity | value |", "|---|---|"]
    return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows])


def readme(report: dict[str, Any]) -> str:
    ev, t, d = report["eval"], report["target"], report["draft"]
    lat = report["latency"]
    rows = [
        ("held-out tokens evaluated", f"{ev['tokens']}"),
        ("unigram perplexity (add-one, train counts)", f"{ev['unigram_ppl']:.2f}"),
        ("target perplexity", f"{ev['target_ppl']:.2f}"),
        ("draft perplexity", f"{ev['draft_ppl']:.2f}"),
        ("target top-1 accuracy", f"{ev['target_top1_acc']:.3f}"),
        ("draft top-1 accuracy", f"{ev['draft_top1_acc']:.3f}"),
        ("draft top-1 agreement with target greedy", f"{ev['draft_target_agreement']:.3f}"),
    ]
    rows += [(f"decode latency target/draft, {x['threads']} thread(s), ctx {x['context_tokens']}",
              f"{x['target_decode_ms']:.2f} ms / {x['draft_decode_ms']:.2f} ms = {x['decode_ratio']:.2f}x")
             for x in lat]
    rows += [(f"prefill latency target/draft, {x['threads']} thread(s), {x['context_tokens']} tokens",
              f"{x['target_prefill_ms']:.2f} ms / {x['draft_prefill_ms']:.2f} ms = {x['prefill_ratio']:.2f}x")
             for x in lat]
    shapes = [("", "target", "draft")] + [
        (k, str(t[k]), str(d[k])) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                            "num_attention_heads", "num_key_value_heads", "params",
                                            "tie_word_embeddings", "dir_bytes")
    ]
    shape_md = "\n".join(["| | target | draft |", "|---|---|---|"]
                         + [f"| {a} | {b} | {c} |" for a, b, c in shapes[1:]])
    tr = report["training"]
    samples = "\n\n".join(f"Target, greedy, prompt {p!r}:\n\n```python\n{s}\n```"
                          for p, s in report["samples"]["target"].items())
    return f"""# Demo target/draft pair (Llama architecture, trained on the Python standard library)

Generated by `adaserve/training/train_demo.py`; do not edit by hand. Command:

```
{report['command']}
```

Seed {report['seed']}, {tr['threads']} torch thread(s), Python {report['env']['python']},
torch {report['env']['torch']}, transformers {report['env']['transformers']}, tokenizers
{report['env']['tokenizers']}. Corpus: {report['corpus']['train_files']} training files /
{report['corpus']['heldout_files']} held-out files of the standard library
(held out: SHA-1 of the relative path = 0 mod {report['corpus']['heldout_mod']}),
{report['corpus']['train_tokens']} / {report['corpus']['heldout_tokens']} tokens.

- `target/`, `draft/`: Hugging Face checkpoints (`LlamaForCausalLM`, bf16 safetensors, tied
  embeddings, RoPE theta 10000, max_position_embeddings 2048) with the same byte-level BPE tokenizer
  (vocab {report['tokenizer']['vocab_size']}, `<s>`={BOS_ID} prepended, `</s>`={EOS_ID} = eos).
- The target is trained with cross-entropy; the draft is distilled from it with
  {report['training']['kl_weight']} x KL(target || draft) + {1 - report['training']['kl_weight']:.2f} x CE.
- `report.json`: every number below; `train_log.txt`: the loss every {tr['log_every']} steps.

## Models

{shape_md}

## Training

Target: {t['train_steps']} steps in {t['train_seconds']:.0f} s; draft: {d['train_steps']} steps in
{d['train_seconds']:.0f} s; batch {tr['batch_size']} x {tr['seq_len']} tokens; whole run
{report['total_seconds']:.0f} s.

## Held-out evaluation (weights reloaded from disk, fp32)

{fmt_table(rows)}

Latency: median batch-1 forward with Hugging Face `LlamaForCausalLM` on CPU (decode = one new token on a
KV cache of the context; prefill = the whole context), after warm-up, target and draft in alternating
rounds. At these sizes per-layer overhead dominates, so the ratio mostly tracks the layer count.

## Samples

{samples}
"""


# ------------------------------------------------------------------------------------------- main


def env_versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "train_log.txt").open("w")
    log.write(f"# python -m adaserve.training.train_demo {' '.join(argv)}\n")

    root = stdlib_root()
    texts = read_texts(root, list_sources(root))
    train_texts, heldout_texts = split_corpus(texts, args.heldout_mod)
    print(f"corpus: {len(train_texts)} train / {len(heldout_texts)} held-out files from {root}",
          file=sys.stderr)

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab_size)
    train_np = encode_stream(tok, train_texts)
    heldout_np = encode_stream(tok, heldout_texts)
    tok_seconds = time.perf_counter() - t0
    vocab = tok.get_vocab_size()
    log.write(f"tokenizer vocab {vocab} train_tokens {len(train_np)} heldout_tokens {len(heldout_np)} "
              f"({tok_seconds:.1f}s)\n")
    train_stream = torch.from_numpy(train_np)
    windows = eval_windows_of(heldout_np, args.seq_len + 1, args.eval_windows)

    target = build_model(TARGET_SHAPE, vocab, args.seed)
    t_res = train("target", target, target_loss_fn(), train_stream, windows, args, args.steps, args.lr,
                  args.seed, log)
    save_model(target, tok, args.out / "target", 2048)

    teacher = load_fp32(args.out / "target")  # distil from the weights that are actually served
    draft = build_model(DRAFT_SHAPE, vocab, args.seed + 1)
    d_res = train("draft", draft, draft_loss_fn(teacher, args.kl_weight), train_stream, windows, args,
                  args.draft_steps, args.draft_lr, args.seed + 1, log)
    save_model(draft, tok, args.out / "draft", 2048)
    log.close()

    target_l, draft_l = load_fp32(args.out / "target"), load_fp32(args.out / "draft")
    ev = evaluate(target_l, draft_l, windows, unigram_logprobs(train_np, vocab))
    context = torch.from_numpy(heldout_np[:128].copy())
    latency = [measure_latency(target_l, draft_l, context, th, args.latency_iters) for th in (1, 2)]
    torch.set_num_threads(args.threads)
    samples = {"target": greedy_samples(args.out / "target", target_l),
               "draft": greedy_samples(args.out / "draft", draft_l)}

    report: dict[str, Any] = {
        "command": "python -m adaserve.training.train_demo " + " ".join(argv),
        "seed": args.seed,
        "env": env_versions(),
        "corpus": {"stdlib": str(root), "train_files": len(train_texts), "heldout_files": len(heldout_texts),
                   "heldout_mod": args.heldout_mod, "train_tokens": len(train_np),
                   "heldout_tokens": len(heldout_np),
                   "train_bytes": sum(len(t.encode()) for t in train_texts)},
        "tokenizer": {"type": "byte-level BPE", "vocab_size": vocab, "bos": BOS, "eos": EOS,
                      "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "seconds": tok_seconds},
        "training": {"threads": args.threads, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "lr": args.lr, "draft_lr": args.draft_lr, "warmup": args.warmup,
                     "kl_weight": args.kl_weight, "log_every": args.log_every,
                     "weights_dtype": "bfloat16"},
        "target": {**model_summary(target_l, TARGET_SHAPE, args.out / "target"), "train_steps": t_res.steps,
                   "train_seconds": t_res.seconds, "final_train_losses": t_res.final},
        "draft": {**model_summary(draft_l, DRAFT_SHAPE, args.out / "draft"), "train_steps": d_res.steps,
                  "train_seconds": d_res.seconds, "final_train_losses": d_res.final},
        "eval": {**asdict(ev), "eval_windows": int(windows.shape[0]), "window_tokens": args.seq_len + 1},
        "latency": latency,
        "samples": samples,
        "total_seconds": time.perf_counter() - t_start,
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "README.md").write_text(readme(report))
    print(json.dumps({"eval": report["eval"], "latency": latency}, indent=2))
    return report


if __name__ == "__main__":
    main()
