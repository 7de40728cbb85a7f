"""Speculative decoding's algorithms: drafting, token selection, the policies, verification, sampling.

Holds the draft's batched beam search (speculate.py), tree shape by batch size (adaptive.py, Eq. 8-9,
with ``AdaptiveConfig``), node values learnt from verification (acceptance.py), AdaServe's selection
(selection.py, Algorithm 2) and its yardstick (optimal_trees.py, Algorithm 1), the per-iteration budget
(iteration_budget.py), every policy (policies.py, smartspec.py), the lossless walk (verify.py,
sampling.py) and Spin's draft selector (draft_bandit.py). Most of it is pure: trees and numbers in,
choices out; speculate.py and verify.py touch tensors.

May import: the model room (``engine.model``: trees, the batch, the runner) and the engine's leaves;
never the scheduler core, never ``engine.cost`` (a cost arrives as a callable, e.g. ``BatchView``).
"""
