"""Tensor parallelism: one target model over N processes, one per device (docs/architecture.md §11).

torch.distributed carries it: NCCL on CUDA, gloo on CPU. Rank r holds

- its share of the attention heads: ``q_proj`` rows (column-parallel), ``o_proj`` columns (row-parallel);
- its share of the KV heads, ``k_proj`` / ``v_proj`` rows and its own KV cache of those heads. With fewer
  KV heads than ranks (GQA), each KV head is replicated on the ranks whose query heads read it, as vLLM
  does;
- its share of the MLP columns: ``gate_proj`` / ``up_proj`` rows (column-parallel), ``down_proj`` columns
  (row-parallel);
- a whole copy of the embedding, the norms and the LM head (replicated, see below).

The shares need not be equal (``split``): heads are dealt out by KV group (a KV head with the query heads
that read it), as evenly as possible, earlier ranks taking one group more when N does not divide the
groups (SmolLM2-135M's 9 query heads in 3 groups over 2 ranks: 6 and 3 query heads, 2 and 1 KV heads), and
likewise the MLP columns. Every query head and column is on exactly one rank, so the sums are whole. Only
more ranks than query heads (or MLP columns) is refused. Rank 0 holds the most KV heads, so the KV page
count every rank uses is rank 0's (``pages_for``): the page accounting is rank 0's.

A rank builds the ordinary ``CausalLM`` from its *local* configuration (``local_config``: its head, KV head
and MLP counts), so the layer code is the same; what differs is ``reduce`` after ``o_proj`` and
``down_proj``: one all-reduce (a sum) after attention and one after the MLP, two per layer. A row-parallel
bias is kept on rank 0 only (zero elsewhere), so the sum adds it once.

The embedding and LM head are replicated rather than vocab-parallel. Replicated costs memory (each rank
holds ``2 * V * hidden`` parameters, ``V * hidden`` when tied: 2 GiB in bf16 for Llama-3-70B's head and
embedding, about 1.5% of the model) and saves two collectives per forward: a vocab-parallel embedding
needs an all-reduce of ``[T, hidden]``, a vocab-parallel head an all-gather of ``[rows, V]`` logits to the
rank that selects. Replicated, rank 0's logits are whole, as verification needs them; the other ranks
ask for no logits rows at all, so they never run the LM head.

The batch is rank 0's: the engine, the scheduler, the draft and the selection run there, on the
``TensorParallelRunner``. Before each forward it broadcasts the segments (each tree's tokens and parents,
its prefix and cached lengths and its sequence's pages) as one int64 array; the other ranks, in ``serve``,
rebuild the segments and run the same ``ModelRunner.compute``, so the layout, the attention plan and the
static-shape bucket are computed by the same code on every rank, and every rank issues the same
collectives in the same order. The KV page accounting is rank 0's alone; a KV move (committing an accepted
path) is broadcast too, so every shard moves the same slots.

Loading: each rank reads only its slices from the safetensors files (``safe_open(...).get_slice``); no
process ever holds the whole model (``read_tensor``). Quantization (quant.py) applies to a rank's slice, so
it shards before packing; a checkpoint stored quantized is refused under tensor parallelism for now (its
packed blocks would have to be sliced along their groups).

May import: numpy, torch, safetensors, engine.model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from adaserve.engine.model.batch import DeviceNodes, Segment
from adaserve.engine.model.config import ModelConfig, UnsupportedModelError
from adaserve.engine.model.kv_cache import KVCacheConfig, SequenceKV, num_pages
from adaserve.engine.model.layers import CausalLM, DecoderLayer
from adaserve.engine.model.runner import ForwardSettings, ModelRunner
from adaserve.engine.model.tree import TokenTree

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split over ranks
ROW = ("o_proj", "down_proj")  # input columns split over ranks; their outputs are summed


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None: the default (world) group

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1


# ---- the shards -------------------------------------------------------------------------------------
def even(total: int, parts: int, i: int) -> range:
    """Piece ``i`` of ``range(total)`` cut into ``parts`` contiguous pieces as even as possible: the first
    ``total % parts`` pieces are one longer (7 over 3: 0-2, 3-4, 5-6)."""
    base, extra = divmod(total, parts)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


@dataclass(frozen=True)
class Shard:
    """What one rank holds of every decoder layer, as indices into the whole model's: its query heads, its
    KV heads and its MLP columns (intermediate units)."""

    q_heads: range
    kv_heads: range
    columns: range


def split(cfg: ModelConfig, rank: int, size: int) -> Shard:
    """Rank ``rank``'s part of a model sharded over ``size`` ranks.

    Attention is split by KV group (a KV head and the ``g = H / Hkv`` query heads that read it):

    - ``size <= Hkv``: the groups are cut as evenly as possible (``even``), earlier ranks taking one more
      when ``size`` does not divide ``Hkv``; a rank's query heads are its groups' (9 heads in 3 groups over
      2 ranks: rank 0 KV heads 0-1 and query heads 0-5, rank 1 KV head 2 and query heads 6-8);
    - ``size > Hkv``: the ranks are cut into ``Hkv`` runs as evenly as possible, run j holds KV head j
      replicated and splits group j's query heads as evenly as possible (``size`` a multiple of ``Hkv``:
      every KV head on ``size / Hkv`` ranks, as vLLM does).

    The MLP columns are cut as evenly as possible. Every query head and every column is on exactly one
    rank, so the row-parallel sums (``o_proj``, ``down_proj``) add each exactly once. Refused
    (``UnsupportedModelError``) only when a rank would get no query head or no column."""
    h, hkv, n = cfg.num_heads, cfg.num_kv_heads, size
    if not 0 <= rank < n:
        raise ValueError(f"bad tensor-parallel rank {rank} of {n}")
    problems = [f"{name}={count}" for name, count in (("num_attention_heads", h),
                                                       ("intermediate_size", cfg.intermediate_size)) if count < n]
    if problems:
        raise UnsupportedModelError(f"tensor parallel size {n} is more than {' and '.join(problems)}: every rank "
                                    "needs at least one query head and one MLP column")
    g = h // hkv
    columns = even(cfg.intermediate_size, n, rank)
    if n <= hkv:
        kv = even(hkv, n, rank)
        return Shard(range(kv.start * g, kv.stop * g), kv, columns)
    group = next(j for j in range(hkv) if rank in even(n, hkv, j))
    ranks = even(n, hkv, group)  # at most ceil(n / hkv) <= g ranks, as n <= h
    mine = even(g, len(ranks), rank - ranks.start)
    return Shard(range(group * g + mine.start, group * g + mine.stop), range(group, group + 1), columns)


def local_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The configuration of rank ``tp.rank``'s part of the model: its heads, KV heads and MLP columns."""
    if tp.size == 1:
        return cfg
    mine = split(cfg, tp.rank, tp.size)
    return replace(cfg, num_heads=len(mine.q_heads), num_kv_heads=len(mine.kv_heads),
                   intermediate_size=len(mine.columns))


def pages_for(kv: KVCacheConfig, cfg: ModelConfig, size: int, dtype: torch.dtype) -> KVCacheConfig:
    """``kv`` with the page count of rank 0's cache fixed, for every rank of ``size``: rank 0 holds the most KV
    heads (``split``), so its memory holds the fewest pages, and the page accounting is its own. A rank with
    fewer KV heads then allocates less memory, not more pages it would never use."""
    if size == 1 or kv.num_pages is not None:
        return kv
    return replace(kv, num_pages=num_pages(local_config(cfg, TensorParallel(0, size)), kv, dtype))


def shard_of(name: str, cfg: ModelConfig, tp: TensorParallel) -> tuple[int, int, int] | None:
    """``(dim, start, stop)``: the part of checkpoint tensor ``name`` that rank ``tp.rank`` holds, or None
    when every rank holds it whole (embedding, norms, LM head, a row-parallel layer's bias)."""
    if tp.size == 1:
        return None
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    mine, d = split(cfg, tp.rank, tp.size), cfg.head_dim
    q, kv, cols = mine.q_heads, mine.kv_heads, mine.columns
    if module == "q_proj":
        return 0, q.start * d, q.stop * d
    if module in ("k_proj", "v_proj"):
        return 0, kv.start * d, kv.stop * d
    if module in ("gate_proj", "up_proj"):
        return 0, cols.start, cols.stop
    if kind == "weight" and module == "o_proj":
        return 1, q.start * d, q.stop * d
    if kind == "weight" and module == "down_proj":
        return 1, cols.start, cols.stop
    return None


def read_tensor(fh: Any, name: str, cfg: ModelConfig, tp: TensorParallel) -> torch.Tensor:
    """Rank ``tp.rank``'s part of tensor ``name`` from an open safetensors file, reading only that part."""
    spec = shard_of(name, cfg, tp)
    if spec is None:
        t = fh.get_tensor(name)
        module = name.rpartition(".")[0].rpartition(".")[2]
        if tp.rank != 0 and module in ROW and name.endswith(".bias"):
            return torch.zeros_like(t)  # added once, by rank 0, before the sum
        return t
    dim, start, stop = spec
    part = fh.get_slice(name)
    return part[start:stop] if dim == 0 else part[:, start:stop]


def install_all_reduce(model: CausalLM, tp: TensorParallel) -> None:
    """Sum the ranks' partial outputs after each layer's attention and MLP (two all-reduces a layer)."""
    if not tp.enabled:
        return

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=tp.group)
        return x

    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.reduce = all_reduce
        layer.mlp.reduce = all_reduce


# ---- process groups -------------------------------------------------------------------------------
def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_rank(rank: int, size: int, *, port: int, device: torch.device, host: str = "127.0.0.1",
              timeout_s: float = 24 * 3600.0) -> TensorParallel:
    """Join the group of ``size`` ranks rendezvousing at ``host:port``. On CUDA, rank r uses device r.

    ``timeout_s`` bounds every collective: the other ranks wait in a broadcast while rank 0 is idle, so it
    is long; a rank that dies is noticed by the process that started the ranks, not by this timeout."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    if size > 1 and dist.is_initialized():
        raise RuntimeError("this process is already a rank of a process group (one tensor-parallel target each)")
    if size > 1:
        dist.init_process_group(backend_for(device), init_method=f"tcp://{host}:{port}", rank=rank,
                                world_size=size, timeout=timedelta(seconds=timeout_s))
    return TensorParallel(rank, size)


def leave() -> None:
    """Leave the process group this process joined (``init_rank``), if any: a rank that exits with the group
    still up can die in gloo's threads at interpreter shutdown ("terminate called without an active exception",
    SIGABRT; one run in three of the tensor-parallel test did)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- rank 0 tells the others what to run ------------------------------------------------------------
FORWARD, MOVE, STOP = 1, 2, 3
SEGMENT_FIELDS = 4  # prefix_len, num_cached, tree size, pages held


class Channel:
    """Rank 0's commands to the other ranks: a header ``[command, payload length, segments]`` and an
    int64 payload, two broadcasts (on the device for NCCL, which sends no host tensors)."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp = tp
        self.device = device if backend_for(device) == "nccl" else torch.device("cpu")
        self.sent = 0  # commands broadcast (rank 0)

    def _broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` on every rank: the receivers' copy comes back to the host (they build the layout
        from it), the sender's never does (no wait on rank 0)."""
        t = t.to(self.device, non_blocking=True)
        dist.broadcast(t, src=0, group=self.tp.group)
        return t if self.tp.rank == 0 else t.cpu()

    def send(self, command: int, payload: np.ndarray, segments: int = 0) -> None:
        assert self.tp.rank == 0
        self._broadcast(torch.tensor([command, payload.size, segments], dtype=torch.int64))
        if payload.size:
            self._broadcast(torch.from_numpy(np.ascontiguousarray(payload, np.int64)))
        self.sent += 1

    def receive(self) -> tuple[int, np.ndarray, int]:
        header = self._broadcast(torch.zeros(3, dtype=torch.int64)).tolist()
        command, size, segments = header
        payload = np.zeros(0, np.int64)
        if size:
            payload = self._broadcast(torch.zeros(size, dtype=torch.int64)).numpy()
        return command, payload, segments

    # the forward's segments, flattened: [fields of every segment | tokens | parents | pages]
    def send_forward(self, segments: list[Segment]) -> None:
        fields = np.array([(s.prefix_len, s.num_cached, s.tree.size, len(s.seq.pages)) for s in segments],
                          np.int64).ravel()
        parts = [fields, *(s.tree.tokens for s in segments), *(s.tree.parents for s in segments),
                 *(np.asarray(s.seq.pages, np.int64) for s in segments)]
        self.send(FORWARD, np.concatenate(parts), len(segments))

    def send_move(self, src: np.ndarray, dst: np.ndarray) -> None:
        self.send(MOVE, np.concatenate([src, dst]))

    def send_stop(self) -> None:
        self.send(STOP, np.zeros(0, np.int64))


def decode_segments(payload: np.ndarray, n: int) -> list[Segment]:
    fields = payload[: n * SEGMENT_FIELDS].reshape(n, SEGMENT_FIELDS)
    sizes, pages = fields[:, 2], fields[:, 3]
    at = n * SEGMENT_FIELDS
    tokens = np.split(payload[at : at + sizes.sum()], np.cumsum(sizes)[:-1])
    at += int(sizes.sum())
    parents = np.split(payload[at : at + sizes.sum()], np.cumsum(sizes)[:-1])
    at += int(sizes.sum())
    page_lists = np.split(payload[at : at + pages.sum()], np.cumsum(pages)[:-1])
    out = []
    for (prefix, cached, size, _), tok, par, pg in zip(fields.tolist(), tokens, parents, page_lists, strict=True):
        tree = TokenTree.trusted(tok, par, np.zeros(size))
        out.append(Segment(SequenceKV(pg.tolist(), prefix + cached), prefix, tree, cached))
    return out


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner of a sharded model: every forward and every KV move is broadcast first, so the other
    ranks (``serve``) run the same. Its logits are whole (the LM head is replicated)."""

    def __init__(self, model: CausalLM, cfg: ForwardSettings | None, tp: TensorParallel) -> None:
        if tp.rank != 0:
            raise ValueError("only rank 0 drives a tensor-parallel model; the other ranks call serve()")
        super().__init__(model, cfg)
        if self.static is not None and self.device.type == "cuda":
            # a CUDA graph would have to capture the NCCL all-reduces: not done (nor tested) yet
            raise ValueError("static shapes (CUDA graphs) are not supported with tensor parallelism yet")
        self.tp = tp
        self.channel = Channel(tp, self.device)
        self.cache.move_listeners.append(self.channel.send_move)
        self.closed = False
        self.after_close: list[Callable[[], None]] = []

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size

    def compute(self, segments: list[Segment], rows: list[int], on_device: DeviceNodes | None = None) -> torch.Tensor:
        if on_device is not None:  # the sharded model is the target: beam levels run on the unsharded draft
            raise ValueError("a tensor-parallel runner takes its tokens from the host")
        if self.closed:
            raise RuntimeError("the tensor-parallel ranks were stopped")
        self.channel.send_forward(segments)  # pages are allocated: forward() ensured them
        return super().compute(segments, rows)

    def close(self) -> None:
        """Stop the other ranks' ``serve`` loops (once), then run ``after_close`` (joining their processes)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.channel.send_stop()
        finally:
            for hook in self.after_close:
                hook()


def serve(runner: ModelRunner, tp: TensorParallel) -> int:
    """A rank other than 0: run every forward rank 0 broadcasts, until it says stop; the forwards served."""
    channel = Channel(tp, runner.device)
    served = 0
    while True:
        command, payload, n = channel.receive()
        if command == STOP:
            return served
        if command == FORWARD:
            runner.compute(decode_segments(payload, n), [])  # no logits rows: rank 0 selects
            served += 1
        elif command == MOVE:
            half = payload.size // 2
            runner.cache.move_slot_arrays(payload[:half], payload[half:])
        else:
            raise RuntimeError(f"unknown tensor-parallel command {command}")
