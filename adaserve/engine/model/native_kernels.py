"""CPU kernels for models served quantized, on x86-64 with AVX2, built at first use: integer dot products for the
quantized layers (``native/q8dot.c``), RMSNorm, and attention over the paged cache (``native/attend.c``).

Why: torch's CPU int4 and int8 kernels run on bfloat16 activations. A CPU without AVX512-BF16 has no bfloat16
arithmetic (there they are ~70% of a lone int4 decode step, and llama.cpp is ~2.5x faster on the same GGUF), and
one with it still runs a lone int4 step ~1.5x slower on them than on these (docs/benchmarks.md). llama.cpp
quantizes the activations to int8 in blocks of 32 and multiplies integers (``maddubs``); these kernels do the
same, so a block's products are exact integers and every output is computed in one fixed order, whatever the
batch (the C file's comment gives the maths). The served function is then that of int8 activations, not
bfloat16 ones: another quantized model, equally the target of every path (decode, prefill, verification), so
speculation stays lossless against it.

Attention has its own kernel because torch's CPU SDPA sums a row in an order that follows the grid around it,
which the int8 rounding of the next layer's input turns into different tokens (attention/base.py); attend.c
computes a row from the keys it sees alone, in float32, in one call a layer.

The C files are compiled once per machine with the system's C compiler (``$CC``, else ``cc``) into the cache
directory (cache_dir.py), keyed by the sources, the flags (VNNI added where the CPU has it) and the compiler,
and loaded with ctypes; the OpenMP runtime is the one torch already loaded (the same ``libgomp.so.1``), so the
kernels use torch's thread count without a second pool. Where that cannot happen (not x86-64 Linux, no
AVX2/FMA, no compiler, a failed build), ``kernels()`` returns None and the layers keep torch's kernels. By
default (``ADASERVE_NATIVE_KERNELS=auto``) they serve wherever they build; ``off`` keeps torch's kernels (see
``chosen``).

The library also holds two kernels that are not a model's (``native/picks.c``): a beam search level's picks, the
vocabulary-wide log-softmax and top-k a draft level reduces its logits by, in one call instead of a dozen torch
ops, and the first maximum of each row that greedy draws take (issue 30: on a CPU this arithmetic ran in the host
time of every speculative iteration). Beam search (speculation/speculate.py) and the draws (verify.py) take them
on the CPU wherever the library loads and the kernels are not ``off``.

May import numpy, torch and cache_dir only: quant.py decides which layers use it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from adaserve.engine.cache_dir import default_cache_dir

ENV = "ADASERVE_NATIVE_KERNELS"  # auto (default) | on | off: see ``chosen``
SOURCES = tuple(Path(__file__).parent / "native" / name for name in ("q8dot.c", "attend.c", "picks.c"))
HEADERS = (Path(__file__).parent / "native" / "vexp.h",)  # included by the sources: part of the build's key
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
VNNI_FLAGS = {  # CPU flag(s) -> what lets the C file form a block's products in one instruction (same results)
    ("avx512_vnni", "avx512vl"): ("-mavx512vl", "-mavx512vnni"),
    ("avx_vnni",): ("-mavxvnni",),
}
BLOCK = 32  # activation block (and int4 weight group) the kernels take
# beam_picks' limits (native/picks.c keeps a row's k picks and a request's F * k candidates on the stack)
PICKS_MAX_K, PICKS_MAX_CANDIDATES = 64, 1024
BUILD_TIMEOUT_S = 120

_P, _I = ctypes.c_void_p, ctypes.c_int


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library and where it came from."""

    lib: ctypes.CDLL
    path: Path

    def quantize_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x float32 [M, K] -> (a int8 [M, K], s [M, K/32], s * sum(a) [M, K/32]) per 32-block (Q8)."""
        m, k = x.shape
        a = torch.empty(m, k, dtype=torch.int8)
        s = torch.empty(m, k // BLOCK)
        s_sum = torch.empty(m, k // BLOCK)
        self.lib.quantize_rows_q8(x.data_ptr(), m, k, a.data_ptr(), s.data_ptr(), s_sum.data_ptr())
        return a, s, s_sum

    def mm_q4(self, x: torch.Tensor, w: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        """x float32 [M, K] contiguous; w uint8 [N, K/32, 16] (``q4_blocks``); d, m float32 [N, K/32]."""
        y = torch.empty(x.shape[0], w.shape[0])
        if x.shape[0] == 0:
            return y
        if self.lib.linear_q4(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), d.data_ptr(), m.data_ptr(),
                              w.shape[0], y.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the int4 kernel could not allocate its activation scratch")
        return y

    def mm_q8(self, x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x float32 [M, K] contiguous; w int8 [N, K]; c float32 [N] (one scale per output row)."""
        y = torch.empty(x.shape[0], w.shape[0])
        if x.shape[0] == 0:
            return y
        if self.lib.linear_q8(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), c.data_ptr(), w.shape[0],
                              y.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the int8 kernel could not allocate its activation scratch")
        return y

    @staticmethod
    def can_attend(q: torch.Tensor) -> bool:
        """Whether ``attend`` takes these query rows: float32 on the CPU, a head size that is a multiple of 8 up to
        256 (a model's backends keep SDPA otherwise: CausalLM.attention_kernels)."""
        return NativeKernels.attends(q.dtype, q.device, q.shape[-1])

    @staticmethod
    def attends(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
        """``can_attend`` for rows of this dtype, device and head size, without a tensor (a static forward asks for
        its grid's attention every forward on a CPU: no op for it)."""
        return dtype == torch.float32 and device.type == "cpu" and head_dim % 8 == 0 and head_dim <= 256

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_slots: torch.Tensor,
               mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of q [G, Q, H, D] (rows evenly strided or copied so) over one layer's cache [slots, Hkv, D]:
        grid g's key j is ``key_slots[g, j]`` (int64 [G, K]), row (g, r) sees it where ``mask`` (bool [G, Q, K],
        or None: every key) is set. Returns [G * Q, H, D]; float32 throughout (native/attend.c)."""
        g, rows, h, d = q.shape
        k = key_slots.shape[1]
        if not (self.can_attend(q) and k_cache.dtype == v_cache.dtype == torch.float32
                and key_slots.dtype == torch.int64):
            raise ValueError("attend: float32 rows and cache on the CPU, int64 key slots, head size a multiple of 8 "
                             "up to 256 (check can_attend first)")
        out = torch.empty(g * rows, h, d)
        flat = q.reshape(g * rows, h, d)  # a view where the rows are evenly strided (a fused q/k/v's slice is)
        if flat.stride(2) != 1 or (h > 1 and flat.stride(1) != d):
            flat = flat.contiguous()
        if mask is not None and (mask.dtype != torch.bool or not mask.is_contiguous()):
            raise ValueError("attend: the mask must be a contiguous bool tensor")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous() and key_slots.is_contiguous()):
            raise ValueError("attend: the cache and the key slots must be contiguous")
        if self.lib.attend_paged(flat.data_ptr(), flat.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                                 key_slots.data_ptr(), mask.data_ptr() if mask is not None else None, g, rows, k,
                                 h, k_cache.shape[1], d, scale, out.data_ptr(), torch.get_num_threads()):
            raise MemoryError("the attention kernel could not allocate its scratch")
        return out

    def beam_picks(self, x: torch.Tensor, base: torch.Tensor, *, k: int, width: int | None, frontier: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """One beam level's picks (native/picks.c): x float32 [n * F, V] contiguous, the frontier rows' logits;
        base float64 [n, F] contiguous, their log path probabilities; each row's top ``k`` children, then the top
        ``width`` of a request's F * k candidates (None: all of them, in order, a static tree's level). Returns
        (tokens, parents as tree indices from ``frontier``, log path probabilities), each [n, kept], or None when
        a logit is not finite."""
        n, f = base.shape
        v = x.shape[1]
        # the C code reads raw pointers: refuse what it would misread (~1 us)
        if (x.dtype != torch.float32 or base.dtype != torch.float64 or x.device.type != "cpu"
                or base.device.type != "cpu" or not x.is_contiguous() or not base.is_contiguous()
                or x.shape[0] != n * f or not 1 <= k <= v):
            raise ValueError("beam_picks: float32 [n * F, V] logits and float64 [n, F] bases, contiguous, on the "
                             "CPU, 1 <= k <= V")
        kept = f * k if width is None else min(width, f * k)
        # the three outputs in one numpy allocation (a third of torch.empty's cost), each handed to torch as its own
        # numpy view: the tokens, the parents, then the scores' float64 bits (issue 30: a level's calls, not its
        # arithmetic, cost; numpy's views and three from_numpy cost less than indexing one torch tensor thrice)
        out = np.empty((3, n, kept), np.int64)
        tok, parent = torch.from_numpy(out[0]), torch.from_numpy(out[1])
        value = torch.from_numpy(out[2].view(np.float64))
        at, part = tok.data_ptr(), n * kept * 8  # the buffer's start, each part's bytes
        status = self.lib.beam_picks(x.data_ptr(), n, f, v, base.data_ptr(), f, k, 0 if width is None else width,
                                     frontier, at, at + part, at + 2 * part, kept, None, 0, torch.get_num_threads())
        if status < 0:
            raise MemoryError("the beam picks kernel could not allocate its scratch")
        return None if status else (tok, parent, value)

    def first_argmax(self, rows: torch.Tensor) -> torch.Tensor:
        """rows float32 [n, V] contiguous -> [n] int64: each row's ``argmax`` (its first maximum, a NaN counting as
        the maximum), bit for bit: comparisons only (native/picks.c)."""
        n, v = rows.shape
        if rows.dtype != torch.float32 or rows.device.type != "cpu" or not rows.is_contiguous():
            raise ValueError("first_argmax: float32 [n, V] rows, contiguous, on the CPU")
        out = torch.from_numpy(np.empty(n, np.int64))
        self.lib.first_argmax(rows.data_ptr(), n, v, out.data_ptr(), torch.get_num_threads())
        return out

    def head_refine(self, y: torch.Tensor, x: torch.Tensor, q: torch.Tensor, c: torch.Tensor, k: int) -> torch.Tensor:
        """The int8 LM head's refinement, in place, and its greedy draws (native/picks.c, head_refine): y float32
        [n, V] the head's output for x float32 [n, K], q int8 [V, K] and c float32 [V] its weights; each row's ``k``
        greatest logits (ties to the lower token id) recomputed in float32 from the weights, then the row's first
        maximum (``first_argmax`` of the refined row, bit for bit). Returns [n] int64; 1 <= k < V."""
        n, v = y.shape
        if (y.dtype != torch.float32 or x.dtype != torch.float32 or q.dtype != torch.int8 or c.dtype != torch.float32
                or any(t.device.type != "cpu" or not t.is_contiguous() for t in (y, x, q, c))
                or x.shape != (n, q.shape[1]) or q.shape[0] != v or c.shape != (v,) or not 1 <= k < v):
            raise ValueError("head_refine: float32 y [n, V] and x [n, K], int8 q [V, K], float32 c [V], contiguous, "
                             "on the CPU, 1 <= k < V")
        out = torch.from_numpy(np.empty(n, np.int64))
        self.lib.head_refine(y.data_ptr(), n, v, x.data_ptr(), x.shape[1], q.data_ptr(), c.data_ptr(), k,
                             out.data_ptr(), torch.get_num_threads())
        return out

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of x float32 [M, K] contiguous, weight w float32 [K]."""
        y = torch.empty_like(x)
        self.lib.rms_norm_f32(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), eps, y.data_ptr())
        return y


def q4_blocks(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] (0..15) in the kernel's layout [N, K/32, 16] uint8: byte j of a block holds column j
    in its low nibble and column j + 16 in its high one."""
    n, k = codes.shape
    c = codes.reshape(n, k // BLOCK, BLOCK).to(torch.uint8)
    return (c[:, :, :16] | (c[:, :, 16:] << 4)).contiguous()


class SearchPicks:
    """One beam search's levels picked by ``beam_picks`` straight into host arrays (speculate.beam_search on a CPU).

    ``tokens``, ``parents`` (tree indices) and ``log_probs`` (log path probabilities, float64) are [n, K], K the
    tree's nodes after the root: each level writes its columns, the next one reads the previous one's log path
    probabilities there as its base, and the trees are built from them as they stand (issue 30: no torch tensor
    per output and level, and no copy or join at the end). With ``anc`` (bool [n, S, S] ancestor rows,
    ``beam_ops.ancestor_rows``: beam_search passes the whole tree's, which the trees then take as their ancestor
    matrices) a level called with ``grow`` fills its nodes' rows in the same call. Every pointer the C code is handed
    is one of these arrays', checked here against the level's shape. ``levels`` (each level's node count, as beam_search
    knows them before the first pick): a lone request's level ids are made as views up front, not sliced after each
    forward. ``NativeKernels.beam_picks`` is the same call for one level with its own bases and outputs
    (``speculate.expand_level``)."""

    def __init__(self, kernels: NativeKernels, n: int, nodes: int, anc: torch.Tensor | None,
                 levels: Sequence[int] = ()) -> None:
        if anc is not None:  # each property read is a torch call: the shape once
            shape = anc.shape
            if (anc.dtype != torch.bool or not anc.is_cpu or not anc.is_contiguous() or len(shape) != 3
                    or shape[0] != n or shape[1] != shape[2]):
                raise ValueError("SearchPicks: the ancestor rows must be a contiguous bool [n, S, S] tensor on the CPU")
        # one numpy buffer, its address read once (issue 30: numpy's ``ctypes.data`` builds a Python object each time it
        # is read). Made by numpy, and the torch views of it by ``from_numpy``, which the search's plan has just run:
        # a torch ``empty``, an index and a ``split`` were entry points of their own, each cold after the draft's last
        # forward (on an AVX2 EPYC ~4% of a lone request's host time; docs/benchmarks.md, thirty-fourth round)
        buf = np.empty((3, n, nodes), np.int64)
        self.tokens, self.parents, self.log_probs = buf[0], buf[1], buf[2].view(np.float64)
        # one request's tokens as torch: each level's ids are a slice of them (a batch's are copied, request-major).
        # ``levels`` (each level's node count, when the caller knows them): those slices made here, keyed by their
        # first column (issue 30: a level's slice, made right after the draft's forward, ran cold there)
        self._row = buf[0, 0] if n == 1 else None
        self._level_ids: dict[int, tuple[int, torch.Tensor]] = {}
        if self._row is not None and levels and sum(levels) <= nodes:
            starts = itertools.accumulate(levels, initial=0)
            self._level_ids = {c: (size, torch.from_numpy(self._row[c : c + size]))
                               for c, size in zip(starts, levels, strict=False)}
        self._at, self._plane = buf.__array_interface__["data"][0], n * nodes * 8  # the address, each output's bytes
        # the first level's base: the roots' log path probability, 0 (held here, read at its address)
        self._roots = _zero_bases(n)
        self._root = self._roots.data_ptr()
        self.finite = True  # every level's logits finite so far
        self._lib, self._n, self._nodes = kernels.lib, n, nodes
        self._anc, self._side = anc, 0 if anc is None else int(anc.shape[1])
        self._anc_at = 0 if anc is None else anc.data_ptr()
        self._threads = torch.get_num_threads()  # one search's levels run under one setting
        self._column, self._width = 0, 1  # the next level's first column; the frontier's nodes (columns before it)

    def level(self, x: torch.Tensor, *, k: int, width: int | None, frontier: int, grow: bool) -> torch.Tensor:
        """The next level from its frontier's logits x [n * F, V] (F: the previous level's nodes): each row's top
        ``k`` children, then each request's top ``width`` (None: all of them, a static tree's level), written into
        the level's columns; returns its tokens as a flat [n * kept] tensor, request-major (the next level's input
        ids: a view of the columns for one request, a copy of them for more). A logit that is not finite leaves
        ``finite`` False and the level's picks zero (token 0, the frontier's first node, log probability 0)."""
        # each torch property read here is a call that runs cold after the draft's forward: the shape is read once
        n, f, shape = self._n, self._width, x.shape
        v = shape[-1]
        if x.dtype != torch.float32:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        kept = f * k if width is None else min(width, f * k)
        c = self._column
        if (len(shape) != 2 or shape[0] != n * f or not x.is_cpu or not 1 <= k <= min(v, PICKS_MAX_K)
                or f * k > PICKS_MAX_CANDIDATES or c + kept > self._nodes):
            raise ValueError(f"SearchPicks.level: float32 logits [{n} * {f}, V] on the CPU, 1 <= k <= "
                             f"min(V, {PICKS_MAX_K}), at most {PICKS_MAX_CANDIDATES} candidates and "
                             f"{self._nodes - c} nodes left")
        anc = None
        if grow:
            if self._anc is None or frontier + f + kept > self._side:
                raise ValueError("SearchPicks.level: no ancestor rows for the level's nodes")
            anc = self._anc_at
        base, ld_base = ((self._root, 1) if c == 0
                         else (self._at + 2 * self._plane + 8 * (c - f), self._nodes))
        at = self._at + 8 * c
        status = self._lib.beam_picks(x.data_ptr(), n, f, v, base, ld_base, k, 0 if width is None else width,
                                      frontier, at, at + self._plane, at + 2 * self._plane, self._nodes, anc,
                                      self._side, self._threads)
        if status < 0:
            raise MemoryError("the beam picks kernel could not allocate its scratch")
        end = c + kept
        if status:
            self.finite = False
            self.tokens[:, c:end], self.parents[:, c:end], self.log_probs[:, c:end] = 0, frontier, 0.0
        self._column, self._width = end, kept
        if self._row is None:
            return torch.from_numpy(self.tokens[:, c:end].reshape(-1))
        size, ids = self._level_ids.get(c, (0, None))
        return ids if size == kept and ids is not None else torch.from_numpy(self._row[c:end])


@functools.lru_cache(maxsize=8)
def _zero_bases(n: int) -> torch.Tensor:
    """n float64 zeros, never written: a search's first level reads its base there (one array per request count)."""
    return torch.zeros(n, dtype=torch.float64)


def mode() -> str:
    value = os.environ.get(ENV, "auto").lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"{ENV}={value!r}: use auto, on or off")
    return value


def chosen() -> NativeKernels | None:
    """The kernels a new CPU layer should use, or None for torch's. ``auto`` (the default) and ``on``: wherever
    they build; ``off``: never. Every CPU measured runs a lone int4 step faster on them: an AVX2-only EPYC 1.7-2.2x,
    an AVX512-BF16 EPYC 1.5x, where torch's kernels have bfloat16 instructions (docs/benchmarks.md, issue 35; an
    AMX Xeon was not measured with them). The served model is then the one with int8 activations (llama.cpp's on
    the same GGUF: docs/models.md); speculation stays lossless against it because every row of every layer is one
    function of its own inputs, attention included (attend.c)."""
    return None if mode() == "off" else kernels()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def supported_cpu() -> bool:
    """x86-64 Linux with AVX2 and FMA (torch's own dispatch level says AVX2 or better)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    return {"avx2", "fma"} <= _cpu_flags()


_loaded: dict[str, NativeKernels | None] = {}


def kernels() -> NativeKernels | None:
    """The kernels, built (once per machine) and loaded (once per process); None where they cannot be."""
    if "lib" not in _loaded:
        _loaded["lib"] = _build_and_load() if supported_cpu() else None
    return _loaded["lib"]


def build_flags() -> tuple[str, ...]:
    """The compiler flags for this CPU: AVX2 and FMA, plus VNNI where it has it (about a tenth faster)."""
    flags = _cpu_flags()
    extra = next((v for need, v in VNNI_FLAGS.items() if set(need) <= flags), ())
    return FLAGS + extra


def _build_and_load() -> NativeKernels | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    failure = ""
    for flags in dict.fromkeys((build_flags(), FLAGS)):  # VNNI where the CPU has it; AVX2 alone if that fails
        path, failure = _built(cc, version, flags)
        if path is not None:
            break
    else:
        print(f"adaserve: the integer kernels did not build ({failure}); quantized layers use torch's kernels",
              file=sys.stderr)
        return None
    # earlier sources' builds (a process using one keeps its map); q8dot-*: before attend.c joined the library
    for old in [*path.parent.glob("q8dot-*.so"), *path.parent.glob("cpu-kernels-*.so")]:
        if old != path:
            old.unlink(missing_ok=True)
    try:
        return load(path)
    except OSError:
        return None


def _built(cc: str, version: str, flags: tuple[str, ...]) -> tuple[Path | None, str]:
    """The library built from the source with ``flags`` (from the cache, or compiled into it now), or None and
    the compiler's last line."""
    key = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join(flags).encode()
                         + version.encode()).hexdigest()[:16]
    path = default_cache_dir() / "native" / f"cpu-kernels-{key}.so"
    if path.exists():
        return path, ""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        try:
            done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", str(out)], capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            return None, str(e)
        if done.returncode != 0:
            return None, (done.stderr.strip().splitlines() or ["no output"])[-1]
        os.replace(out, path)  # atomic: a process beside this one loads a whole library or builds its own
    return path, ""


def load(path: Path) -> NativeKernels:
    """A built library, its functions typed."""
    lib = ctypes.CDLL(str(path))
    lib.quantize_rows_q8.argtypes = [_P, _I, _I, _P, _P, _P]
    lib.quantize_rows_q8.restype = None
    lib.mm_q4_q8.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _I, _P, _I]
    lib.mm_q4_q8.restype = None
    lib.mm_q8_q8.argtypes = [_P, _P, _I, _I, _P, _P, _I, _P, _I]
    lib.mm_q8_q8.restype = None
    lib.linear_q4.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _I]
    lib.linear_q4.restype = _I
    lib.linear_q8.argtypes = [_P, _I, _I, _P, _P, _I, _P, _I]
    lib.linear_q8.restype = _I
    lib.rms_norm_f32.argtypes = [_P, _I, _I, _P, ctypes.c_float, _P]
    lib.rms_norm_f32.restype = None
    lib.attend_paged.argtypes = [_P, ctypes.c_long, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _I]
    lib.attend_paged.restype = _I
    lib.beam_picks.argtypes = [_P, _I, _I, _I, _P, ctypes.c_long, _I, _I, ctypes.c_int64, _P, _P, _P, ctypes.c_long,
                               _P, _I, _I]
    lib.beam_picks.restype = _I
    lib.first_argmax.argtypes = [_P, ctypes.c_long, _I, _P, _I]
    lib.first_argmax.restype = None
    lib.head_refine.argtypes = [_P, ctypes.c_long, _I, _P, _I, _P, _P, _I, _P, _I]
    lib.head_refine.restype = _I
    return NativeKernels(lib, path)
