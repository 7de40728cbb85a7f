"""The ragged batch: many requests' new tokens in one forward (docs/architecture.md §2).

Each request contributes a *segment*: ``prefix_len`` committed tokens every new token may see, and
a token tree whose first ``num_cached`` nodes are already in the KV cache (earlier beam-search steps)
and whose remaining nodes are new in this forward. Prefill chunks are chains, decoding is a lone root,
verification is a whole tree: one layout serves them all.

    positions   = prefix_len + depth(node)          (RoPE: by depth)
    KV slots    = prefix_len + node index           (storage: by flat index)
    mask row i  = [1 ... 1 (prefix) | anc[i, :M]]   (a node sees its ancestors and itself)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from adaserve.engine.kv_cache import SequenceKV
from adaserve.engine.tree import TokenTree


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
class BatchLayout:
    """Everything a forward needs, computed once per step and shared by every layer."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    write_slots: torch.Tensor  # [T] int64: cache slot each new token's K/V is written to
    qo_indptr: list[int]  # [B+1]: request b owns tokens qo_indptr[b]:qo_indptr[b+1]
    kv_lens: list[int]  # [B]
    key_slots: torch.Tensor  # [B, Kmax] int64, padded with 0
    key_positions: torch.Tensor  # [B, Kmax] int64, padded with a huge value
    mask: torch.Tensor  # [B, Qmax, Kmax] bool; padded query rows see key 0 only
    token_batch: torch.Tensor  # [T]: request of each token
    token_row: torch.Tensor  # [T]: row of each token inside its request
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_layout(segments: list[Segment], *, page_size: int, device: torch.device) -> BatchLayout:
    if not segments:
        raise ValueError("a batch needs at least one segment")
    n_new = [s.num_new for s in segments]
    if min(n_new) <= 0:
        raise ValueError("every segment must contribute at least one new token")
    kv_lens = [s.kv_len for s in segments]
    b, q_max, k_max = len(segments), max(n_new), max(kv_lens)

    ids, pos, slots, t_batch, t_row = [], [], [], [], []  # type: ignore[var-annotated]
    key_slots = np.zeros((b, k_max), np.int64)
    key_pos = np.full((b, k_max), 2**40, np.int64)
    mask = np.zeros((b, q_max, k_max), dtype=bool)
    mask[:, :, 0] = True  # padded query rows must see one key; they are dropped afterwards
    for r, s in enumerate(segments):
        p, m, c = s.prefix_len, s.tree.size, s.num_cached
        depth = s.tree.depths()
        anc = s.tree.ancestor_matrix()
        ids.append(s.tree.tokens[c:])
        pos.append(p + depth[c:])
        slots.append(s.seq.slots(p + c, p + m, page_size))
        t_batch.extend([r] * (m - c))
        t_row.extend(range(m - c))
        key_slots[r, : p + m] = s.seq.slots(0, p + m, page_size)
        key_pos[r, :p] = np.arange(p)
        key_pos[r, p : p + m] = p + depth
        mask[r, : m - c, :p] = True
        mask[r, : m - c, p : p + m] = anc[c:]

    def t(x: np.ndarray | list[int]) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x), dtype=torch.int64, device=device)

    return BatchLayout(
        input_ids=t(np.concatenate(ids)),
        positions=t(np.concatenate(pos)),
        write_slots=t(np.concatenate(slots)),
        qo_indptr=[0, *np.cumsum(n_new).tolist()],
        kv_lens=kv_lens,
        key_slots=t(key_slots),
        key_positions=t(key_pos),
        mask=torch.as_tensor(mask, device=device),
        token_batch=t(t_batch),
        token_row=t(t_row),
        segments=tuple(segments),
    )
