"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields, plus ``slo_class``
and vLLM's ``top_k`` / ``ignore_eos``. Parameters adaserve cannot honour are refused by name, never ignored.

Fields that reach a worker have the types of its own request (adaserve/contract/generate.py): what passes
here passes there, and ``generate_request`` builds that request without validating it again.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator

from adaserve.contract.generate import ChatMessage, Count, GenerateRequest, Integer, Role, Seed, StopStrings, TokenId
from adaserve.contract.slo import SloClassName
from adaserve.contract.text import check_encodable
from adaserve.gateway.slo import SloClass


# The OpenAPI document declares what the validators below accept (a client or a fuzzer reading it sees the API's
# own rules), while the validators keep their messages that say why: "n: only n=1 is supported; ...".
def _only(*values: Any) -> Any:
    return WithJsonSchema({"enum": list(values)})


PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
]}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: Count | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default samples
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TokenId = 0  # a count, of the same kind
    n: Annotated[Integer, _only(1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings = Field(default_factory=list)
    seed: Seed | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Annotated[float, _only(0)] = 0.0
    frequency_penalty: Annotated[float, _only(0)] = 0.0
    logprobs: Annotated[Any, _only(None, False, 0)] = None
    slo_class: SloClassName | None = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return check_encodable(data)  # before anything else: a lone surrogate must never reach a worker

    @model_validator(mode="after")
    def _supported(self) -> _Common:
        if self.n != 1:
            raise ValueError("n: only n=1 is supported; send several requests")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty / frequency_penalty are not supported (they would change the "
                             "target model's distribution that speculative decoding preserves)")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs: not supported")
        return self

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The worker's sampling fields (POST /v1/generate)."""
        return {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
                "ignore_eos": self.ignore_eos}

    def prompt_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def generate_request(self, default_max_tokens: int, slo: SloClass, request_id: str) -> GenerateRequest:
        """What the gateway sends a worker for this body (streamed: the gateway reads every worker's stream).

        ``model_construct``: this body was validated at the gateway's edge, with the worker's own field types,
        and the worker validates what it receives at its edge; a request only the worker refuses (more turns
        than it takes) comes back as its 422, which the gateway passes on as a 400.
        """
        return GenerateRequest.model_construct(**self.prompt_fields(), **self.sampling(default_max_tokens),
                                               slo_class=slo.name, tpot_slo_ms=slo.tpot_ms, ttft_slo_ms=slo.ttft_ms,
                                               request_id=request_id, stream=True)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: Annotated[str | list[str] | list[TokenId], WithJsonSchema(PROMPT_SCHEMA)]
    echo: Annotated[bool, _only(False)] = False
    best_of: Annotated[Integer | None, _only(None, 1)] = None
    suffix: Annotated[str | None, _only(None, "")] = None

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str) and len(p) != 1:
            raise ValueError("prompt: one prompt per request (got a list of several); send one request each")
        if len(p) == 0 or (isinstance(p, list) and isinstance(p[0], str) and not p[0]):
            raise ValueError("prompt: must not be empty")
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            raise ValueError("echo, suffix and best_of are not supported")
        return self

    def prompt_fields(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, str):
            return {"prompt": p}
        if isinstance(p[0], str):
            return {"prompt": p[0]}
        return {"prompt_token_ids": p}


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id ...: accepted, not used
    role: Role
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Count | None = None

    def prompt_fields(self) -> dict[str, Any]:
        return {"messages": [ChatMessage.model_construct(role=m.role, content=m.text()) for m in self.messages]}

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out
