"""One ragged forward over many requests' trees gives, at every node, the logits of decoding that
node's path sequentially (Hugging Face's model over prefix + path is the reference)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.engine.model.batch import Segment
from adaserve.engine.model.kv_cache import SequenceKV
from adaserve.engine.model.tree import TokenTree
from tests.engine.helpers import runner


def random_tree(rng: np.random.Generator, size: int, vocab: int) -> TokenTree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, size)]
    return TokenTree.from_lists(rng.integers(2, vocab, size).tolist(), parents)


def path_tokens(tree: TokenTree, node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return out[::-1]


@pytest.fixture(scope="module")
def hf_model(target_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


def reference(hf_model, context: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([context])).logits[0, -1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_tree_logits_equal_sequential(target_dir: Path, hf_model, seed: int) -> None:
    rng = np.random.default_rng(seed)
    r = runner(target_dir, page_size=4)
    prefixes = [rng.integers(2, 97, n).tolist() for n in (1, 6, 17, 33)]
    seqs = [SequenceKV() for _ in prefixes]
    # prefill every prefix in one ragged forward
    r.forward([Segment(s, 0, TokenTree.chain(p)) for s, p in zip(seqs, prefixes, strict=True)],
              all_logits=[False] * len(seqs))
    for s, p in zip(seqs, prefixes, strict=True):
        r.cache.truncate(s, len(p))

    trees = [random_tree(rng, int(rng.integers(1, 12)), 97) for _ in prefixes]
    logits = r.forward([Segment(s, len(p), t) for s, p, t in zip(seqs, prefixes, trees, strict=True)],
                       all_logits=[True] * len(trees))
    for p, t, lg in zip(prefixes, trees, logits, strict=True):
        assert lg.shape == (t.size, 97)
        for node in range(t.size):
            ref = reference(hf_model, p + path_tokens(t, node))
            assert (lg[node] - ref).abs().max().item() <= 1e-4


def test_growing_tree_with_cached_nodes(target_dir: Path, hf_model) -> None:
    """Beam search writes a tree level by level: new nodes attend to cached earlier nodes by the mask."""
    rng = np.random.default_rng(7)
    r = runner(target_dir, page_size=4)
    prefix = rng.integers(2, 97, 9).tolist()
    seq = SequenceKV()
    r.forward([Segment(seq, 0, TokenTree.chain(prefix))], all_logits=[False])
    r.cache.truncate(seq, len(prefix))
    full = random_tree(rng, 10, 97)
    first = full.subtree(range(5))
    r.forward([Segment(seq, len(prefix), first)], all_logits=[True])
    lg = r.forward([Segment(seq, len(prefix), full, num_cached=5)], all_logits=[True])[0]
    assert lg.shape == (5, 97)
    for j, node in enumerate(range(5, 10)):
        ref = reference(hf_model, prefix + path_tokens(full, node))
        assert (lg[j] - ref).abs().max().item() <= 1e-4


def test_prefill_chunk_beside_trees_uses_its_own_grid(target_dir: Path, hf_model) -> None:
    """A long prefill chunk and small trees in one forward: the torch backend gives them separate padded
    grids (the trees are not padded to the chunk's rows), and every logit still equals the reference."""
    from adaserve.engine.model.attention.torch_sdpa import group_segments

    rng = np.random.default_rng(5)
    r = runner(target_dir, page_size=4)
    prefixes = [rng.integers(2, 97, n).tolist() for n in (3, 11)]
    seqs = [SequenceKV() for _ in prefixes]
    r.forward([Segment(s, 0, TokenTree.chain(p)) for s, p in zip(seqs, prefixes, strict=True)],
              all_logits=[False] * len(seqs))
    for s, p in zip(seqs, prefixes, strict=True):
        r.cache.truncate(s, len(p))
    chunk = rng.integers(2, 97, 45).tolist()
    trees = [random_tree(rng, 6, 97), random_tree(rng, 3, 97)]
    segs = [Segment(s, len(p), t) for s, p, t in zip(seqs, prefixes, trees, strict=True)]
    segs.insert(1, Segment(SequenceKV(), 0, TokenTree.chain(chunk)))
    assert group_segments([s.num_new for s in segs]) == [[1], [0, 2]]
    logits = r.forward(segs, all_logits=[True] * 3)
    for j in range(45):
        assert (logits[1][j] - reference(hf_model, chunk[: j + 1])).abs().max().item() <= 1e-4
    for p, t, lg in zip(prefixes, trees, (logits[0], logits[2]), strict=True):
        for node in range(t.size):
            assert (lg[node] - reference(hf_model, p + path_tokens(t, node))).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n_new", [[1] * 32, [4, 4, 4], [40, 40], [1], [], [3, 1, 3], [40, 9, 40, 10], [64, 1, 1]])
def test_group_segments_of_alike_segments_is_one_group_as_the_sort_gives(n_new: list[int]) -> None:
    """Segments that all bring as many new tokens (decode steps, equal chains) take one group in batch order without
    the sort: what the sort and the split rule give them."""
    from adaserve.engine.model.attention import torch_sdpa

    def sorted_groups(sizes: list[int]) -> list[list[int]]:  # the general rule, the shortcut left out
        order = sorted(range(len(sizes)), key=lambda b: -sizes[b])
        groups: list[list[int]] = []
        for b in order:
            first = sizes[groups[-1][0]] if groups else 0
            if groups and not (first > torch_sdpa.SPLIT_ROWS and sizes[b] * torch_sdpa.SPLIT_RATIO <= first):
                groups[-1].append(b)
            else:
                groups.append([b])
        return [sorted(g) for g in groups]

    assert torch_sdpa.group_segments(n_new) == sorted_groups(n_new)
    if n_new and len(set(n_new)) == 1:
        assert torch_sdpa.group_segments(n_new) == [list(range(len(n_new)))]
