"""The request body of ``POST /v1/generate``: shape checks only; what the engine can serve is checked later."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from adaserve.worker.settings import SloClassName

REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class ChatMessage(BaseModel):
    """One turn of a conversation; rendered with the model's chat template by the worker."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    tpot_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    slo_class: SloClassName | None = None
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

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise ValueError("give exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ())
