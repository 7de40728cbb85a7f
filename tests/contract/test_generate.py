"""The body of a worker's POST /v1/generate: what the gateway sends and any client may."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from adaserve.contract.generate import GenerateRequest


def test_stop_is_a_list_of_non_empty_strings() -> None:
    assert GenerateRequest(prompt="x", stop="\n").stops == ("\n",)
    assert GenerateRequest(prompt="x").stops == ()
    with pytest.raises(ValidationError, match="stop strings must be non-empty"):
        GenerateRequest(prompt="x", stop=["a", ""])
    with pytest.raises(ValidationError, match="at most 16 stop strings"):
        GenerateRequest(prompt="x", stop=[str(i) for i in range(17)])
    with pytest.raises(ValidationError, match="stop"):
        GenerateRequest.model_validate({"prompt": "x", "stop": 5})


def test_exactly_one_prompt() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest(prompt="x", prompt_token_ids=[1])
    with pytest.raises(ValidationError, match="exactly one"):
        GenerateRequest()


def test_strict_token_ids() -> None:
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        GenerateRequest.model_validate({"prompt_token_ids": [True]})  # strict ints: no bools, no strings
    with pytest.raises(ValidationError, match="prompt_token_ids"):
        GenerateRequest(prompt_token_ids=[-1])


@pytest.mark.parametrize("field", ["tpot_slo_ms", "ttft_slo_ms"])
def test_slo_targets_are_positive_numbers(field: str) -> None:
    assert getattr(GenerateRequest.model_validate({"prompt": "x", field: 40}), field) == 40.0
    for bad in (0, -1, float("inf")):
        with pytest.raises(ValidationError, match=field):
            GenerateRequest.model_validate({"prompt": "x", field: bad})
