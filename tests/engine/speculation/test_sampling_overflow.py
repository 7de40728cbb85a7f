"""A vanishing temperature is greedy, not NaN (sampling.processed_probs)."""

from __future__ import annotations

import torch

from adaserve.engine.speculation.sampling import SamplingParams, processed_probs


def test_a_vanishing_temperature_puts_all_mass_on_the_argmax() -> None:
    logits = torch.tensor([[0.5, 3.0, -2.0, 2.9], [10.0, -10.0, 0.0, 9.0]])
    for t in (5e-324, 1e-300, 1e-30):
        probs = processed_probs(logits, SamplingParams(temperature=t))
        assert not probs.isnan().any()
        assert probs.argmax(-1).tolist() == [1, 0] and probs.max(-1).values.tolist() == [1.0, 1.0]


def test_the_shift_leaves_ordinary_temperatures_unchanged() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    for t in (0.3, 1.0, 2.0):
        want = torch.softmax(logits.double() / t, dim=-1)
        assert torch.allclose(processed_probs(logits, SamplingParams(temperature=t)), want, rtol=0, atol=1e-12)
