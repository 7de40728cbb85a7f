"""The request body of ``POST /v1/generate``: shape checks only; what the engine can serve is checked later."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from adaserve.worker.settings import CLASS_NAME

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    tpot_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    slo_class: str | None = None
    request_id: RequestId | None = None
    stream: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("slo_class")
    @classmethod
    def _slo_class(cls, v: str | None) -> str | None:
        if v is not None and not CLASS_NAME.match(v):
            raise ValueError(f"must match {CLASS_NAME.pattern}")
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids'")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())
