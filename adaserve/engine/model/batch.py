"""The ragged batch: many requests' new tokens in one forward (docs/architecture.md §2).

Each request contributes a *segment*: ``prefix_len`` committed tokens every new token may see, and
a token tree whose first ``num_cached`` nodes are already in the KV cache (earlier beam-search steps)
and whose remaining nodes are new in this forward. Prefill chunks are chains, decoding is a lone root,
verification is a whole tree: one layout serves them all.

    positions   = prefix_len + depth(node)          (RoPE: by depth)
    KV slots    = prefix_len + node index           (storage: by flat index)
    mask row i  = [1 ... 1 (prefix) | anc[i, :M]]   (a node sees its ancestors and itself)

The layout holds what every backend reads (ids, positions, write slots, per-segment lengths, the page
table). The mask is not built here: each attention backend builds the form it reads, on its device,
from the per-segment vectors (``attention/masks.py``). The device arrays are not sent one by one: the
layout puts its host arrays in a ``HostStage`` (staging.py), where the backend and the runner add theirs,
and the first read sends them all in one non-blocking copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.model.kv_cache import SequenceKV, page_slots
from adaserve.engine.model.staging import HostStage
from adaserve.engine.model.tree import TokenTree


@dataclass(frozen=True)
class Segment:
    seq: SequenceKV
    prefix_len: int
    tree: TokenTree
    num_cached: int = 0

    @property
    def num_new(self) -> int:
        return self.tree.size - self.num_cached

    @property
    def kv_len(self) -> int:
        return self.prefix_len + self.tree.size


@dataclass(frozen=True)
class DeviceNodes:
    """A forward's new tokens already on the device (beam search's picks, never copied to the host).

    The segments' trees then give the layout its shape only: sizes and depths, from which positions, slots
    and the page table follow (they do not depend on which tokens were picked); their tokens and parents
    are placeholders. ``ids`` [T] int64: the new tokens in layout order. ``ancestors`` [B, M, M] bool:
    every segment's ancestor matrix (every tree of one size M, none a chain), or None when all are chains.
    """

    ids: torch.Tensor
    ancestors: torch.Tensor | None = None


@dataclass(frozen=True)
class BatchLayout:
    """Everything a forward needs, computed once per step and shared by every layer.

    The host arrays are the layout; ``input_ids``, ``positions`` and ``write_slots`` are their device
    copies, sent with everything else staged for the forward (``stage``).
    """

    ids: np.ndarray | None  # [T] int64; None when the ids are on the device only (DeviceNodes)
    position_ids: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: cache slot each new token's K/V is written to
    qo_indptr: list[int]  # [B+1]: request b owns tokens qo_indptr[b]:qo_indptr[b+1]
    kv_lens: list[int]  # [B]
    page_table: np.ndarray  # [B, max pages read] int64: the pages covering each kv_len, padded with 0
    page_size: int
    segments: tuple[Segment, ...]
    stage: HostStage

    @property
    def input_ids(self) -> torch.Tensor:
        return self.stage.get("ids")

    @property
    def positions(self) -> torch.Tensor:
        return self.stage.get("positions")

    @property
    def write_slots(self) -> torch.Tensor:
        return self.stage.get("write_slots")

    @property
    def device(self) -> torch.device:
        return self.stage.device

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def all_chains(self) -> bool:
        """Every segment is a chain: the mask is causal (key index = position) for every request."""
        return all(s.tree.is_chain for s in self.segments)


def page_table(pages_of: list[list[int]], kv_lens: np.ndarray, page_size: int) -> np.ndarray:
    """[B, max pages] int64: the first ceil(kv_len / page_size) of each sequence's pages, padded with 0."""
    n_pages = -(-kv_lens // page_size)
    counts = n_pages.tolist()
    table = np.zeros((len(pages_of), int(np.maximum.reduce(n_pages))), np.int64)
    flat: list[int] = []
    for b, (pages, n) in enumerate(zip(pages_of, counts, strict=True)):
        if n > len(pages):
            raise ValueError(f"sequence holds {len(pages)} pages but {kv_lens[b]} keys need {n}")
        flat += pages[:n]
    # every row's pages in one assignment: the rows' leading n_b columns, in row-major order
    table[np.arange(table.shape[1])[None, :] < n_pages[:, None]] = flat
    return table


def grid_key_slots(table: np.ndarray, kv_lens: np.ndarray, k: int, page_size: int) -> np.ndarray:
    """``[B, k]``: row b's cache slot of key index j for j < kv_lens[b]; a padded key (j >= kv_lens[b]) repeats the
    slot of its last key, kv_lens[b] - 1 (masked out, it is read but never weighed). ``table`` ``[B, P]``: each
    sequence's pages (``page_table``), covering its kv_lens[b] >= 1 keys. Without dividing (``page_slots``)."""
    slots = page_slots(table, page_size)
    width = min(k, slots.shape[1])  # keys past the table's pages are all padding
    last = slots[np.arange(len(slots)), kv_lens - 1]
    out = np.empty((len(slots), k), np.int64)
    out[:, :width] = np.where(np.arange(width) < kv_lens[:, None], slots[:, :width], last[:, None])
    out[:, width:] = last[:, None]
    return out


def build_layout(segments: list[Segment], *, page_size: int, device: torch.device,
                 on_device: DeviceNodes | None = None) -> BatchLayout:
    """The layout of ``segments``' new tokens (module docstring); a lone segment's in a few slices (_lone_layout)."""
    if len(segments) == 1:
        return _lone_layout(segments[0], page_size=page_size, device=device, on_device=on_device)
    return _batch_layout(segments, page_size=page_size, device=device, on_device=on_device)


def _lone_layout(seg: Segment, *, page_size: int, device: torch.device,
                 on_device: DeviceNodes | None = None) -> BatchLayout:
    """``_batch_layout`` for one segment (issue 30: a lone request's verification, decode step or prompt chunk paid
    the batch's per-segment index arithmetic). L prefix, c cached nodes, M tree nodes: the new tokens are nodes
    c .. M - 1 at key indices L + c .. L + M - 1, in order; node i's position is L + depth(i) (L + i on a chain)."""
    tree, cached, prefix = seg.tree, seg.num_cached, seg.prefix_len
    size = len(tree.tokens)
    if size - cached <= 0:
        raise ValueError("every segment must contribute at least one new token")
    kv_len = prefix + size
    pages = -(-kv_len // page_size)
    if pages > len(seg.seq.pages):
        raise ValueError(f"sequence holds {len(seg.seq.pages)} pages but {kv_len} keys need {pages}")
    table = np.asarray(seg.seq.pages[:pages], np.int64).reshape(1, pages)
    slots = seg.seq.slots(prefix + cached, kv_len, page_size)
    positions = np.arange(prefix + cached, kv_len) if tree.is_chain else prefix + tree.depths()[cached:]
    ids = None if on_device is not None else np.asarray(tree.tokens[cached:], np.int64)
    stage = HostStage(torch.device(device))
    if on_device is None:
        stage.put("ids", ids)
    else:
        _bind_device_nodes(stage, on_device, [seg], size - cached)
    stage.put("positions", positions)
    stage.put("write_slots", slots)
    return BatchLayout(ids=ids, position_ids=positions, slots=slots, qo_indptr=[0, size - cached], kv_lens=[kv_len],
                       page_table=table, page_size=page_size, segments=(seg,), stage=stage)


def _batch_layout(segments: list[Segment], *, page_size: int, device: torch.device,
                  on_device: DeviceNodes | None = None) -> BatchLayout:
    """``build_layout`` for any batch."""
    if not segments:
        raise ValueError("a batch needs at least one segment")
    trees = [s.tree for s in segments]
    # one pass over the segments: prefix, cached nodes and tree size of each
    prefix, cached, size = np.array([(s.prefix_len, s.num_cached, len(s.tree.tokens)) for s in segments],
                                    np.int64).reshape(len(segments), 3).T
    n_new = size - cached
    if np.minimum.reduce(n_new) <= 0:  # ufuncs' C forms, not the methods' Python layer (issue 30)
        raise ValueError("every segment must contribute at least one new token")
    kv_lens = prefix + size
    table = page_table([s.seq.pages for s in segments], kv_lens, page_size)

    ids = None if on_device is not None else np.concatenate([s.tree.tokens[s.num_cached:] for s in segments])
    # token t of segment b (row r of its new tokens) is tree node c_b + r, at token index L_b + c_b + r
    seg = np.arange(len(segments)).repeat(n_new)
    qo_indptr = np.concatenate([[0], n_new.cumsum()])
    index = prefix[seg] + cached[seg] + (np.arange(len(seg)) - qo_indptr[seg])
    slots = table.ravel()[seg * table.shape[1] + index // page_size] * page_size + index % page_size  # one flat take

    first = trees[0]
    if all(t.is_chain for t in trees):  # a chain's node index is its depth: position = token index
        positions = index
    elif all(t is first for t in trees) and (cached == cached[0]).all():  # one shape for all (beam levels)
        positions = prefix[seg] + np.tile(first.depths()[int(cached[0]):], len(segments))
    else:
        positions = prefix[seg] + np.concatenate([s.tree.depths()[s.num_cached:] for s in segments])
    stage = HostStage(torch.device(device))
    if on_device is None:
        assert ids is not None
        stage.put("ids", ids)
    else:
        _bind_device_nodes(stage, on_device, segments, int(qo_indptr[-1]))
    stage.put("positions", positions)
    stage.put("write_slots", slots)
    return BatchLayout(
        ids=ids,
        position_ids=positions,
        slots=slots,
        qo_indptr=qo_indptr.tolist(),
        kv_lens=kv_lens.tolist(),
        page_table=table,
        page_size=page_size,
        segments=tuple(segments),
        stage=stage,
    )


def _bind_device_nodes(stage: HostStage, nodes: DeviceNodes, segments: list[Segment], n_tokens: int) -> None:
    """The device's ids (and ancestor rows, which ``masks.MaskIndex`` then reads) join the stage uncopied."""
    if tuple(nodes.ids.shape) != (n_tokens,):
        raise ValueError(f"device ids of shape {tuple(nodes.ids.shape)} for a layout of {n_tokens} tokens")
    stage.bind("ids", nodes.ids)
    if nodes.ancestors is None:
        if not all(s.tree.is_chain for s in segments):
            raise ValueError("trees that are not chains need their ancestor rows on the device")
        return
    m = segments[0].tree.size
    if any(s.tree.size != m or s.tree.is_chain for s in segments):
        raise ValueError("device ancestor rows need every tree of one size, none a chain")
    if tuple(nodes.ancestors.shape) != (len(segments), m, m):
        raise ValueError(f"device ancestor rows of shape {tuple(nodes.ancestors.shape)}, "
                         f"expected {(len(segments), m, m)}")
    stage.bind("mask.anc", nodes.ancestors)
