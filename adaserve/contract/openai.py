"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, at the gateway and at a worker alike:
OpenAI's fields, plus ``slo_class``
and vLLM's ``top_k``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids`` and ``repetition_penalty``. Parameters
adaserve knows but cannot honour (``suffix``, ``echo`` with ``logprobs``, ...) are refused by name, never ignored.
``n`` > 1 and completions' ``best_of`` are several engine requests, one per sequence (adaserve/contract/choices.py).

A field adaserve does not know is accepted and ignored, as vLLM does (the official SDKs and agent frameworks
send ``store``, ``metadata``, ``parallel_tool_calls``): ``ignored_fields`` names them, and the answer says so in
its ``X-Ignored-Fields`` header and the server's log. A gateway run with ``--strict-openai-fields`` refuses
them with 400 instead (gateway/relay.py).

A worker's own OpenAI routes (worker/routes/openai.py) take the same bodies plus the explicit targets of
``/v1/generate`` (``tpot_slo_ms``, ``ttft_slo_ms``: ``WorkerCompletionRequest``, ``WorkerChatRequest``), which
the gateway does not take: it sets the targets from its classes.

Fields that reach a worker have the types of its own request (adaserve/contract/generate.py): what passes
here passes there, and ``generate_request`` builds that request without validating it again.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator

from adaserve.contract.choices import choice_seed, sequence_id
from adaserve.contract.generate import (
    MAX_TOOL_CALLS,
    MAX_TOP_LOGPROBS,
    STRUCTURED_OUTPUTS_SCHEMA,
    ChatMessage,
    Count,
    GenerateRequest,
    LogitBias,
    Penalty,
    RepetitionPenalty,
    Role,
    Seed,
    StopStrings,
    StructuredOutputs,
    TokenId,
    ToolCall,
    ToolCallFunction,
    whole,
)
from adaserve.contract.slo import SloClassName
from adaserve.contract.text import check_encodable


class SloTargets(Protocol):
    """What ``generate_request`` reads of an SLO class: the gateway's ``SloClass``, or a worker's own."""

    @property
    def name(self) -> str: ...

    @property
    def tpot_ms(self) -> float | None: ...

    @property
    def ttft_ms(self) -> float | None: ...


# The OpenAPI document declares what the validators below accept (a client or a fuzzer reading it sees the API's
# own rules), while the validators keep their messages that say why: "n: only n=1 is supported; ...".
def _only(*values: Any) -> Any:
    return WithJsonSchema({"enum": list(values)})


MAX_CHOICES = 8  # n and best_of: each sequence is a request of its own to the scheduler
Choices = whole(ge=1, le=MAX_CHOICES)

PROMPT_SCHEMA = {"anyOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
]}


# unknown fields are kept (``model_extra``) so that the answer can name them; none reaches a worker
OPEN = ConfigDict(extra="allow")


def ignored_fields(model: BaseModel, at: str = "") -> list[str]:
    """The unknown fields of ``model`` and of every model inside it, by path (``store``,
    ``messages[1].foo``), in the order they were sent. A name that is not plain printable ASCII without
    spaces, commas or quotes (``""``, ``"a b"``, ``"é"``) is written as a JSON string, ASCII-escaped: the
    paths go in a header, whose value may not end in a space nor hold a control character."""
    out = [f"{at}{_shown(name)}" for name in (model.model_extra or {})]
    out += [f"{at}{name}" for name in getattr(model, "overridden_fields", ())]
    for name in type(model).model_fields:
        out += _ignored_in(getattr(model, name), f"{at}{name}")
    return out


IGNORED_HEADER = "X-Ignored-Fields"  # the answer names the unknown fields it ignored
MAX_IGNORED_HEADER = 1024  # characters: a body of a thousand unknown fields must not make a header of them all


def ignored_header(fields: list[str]) -> str:
    """The unknown fields of a request (``ignored_fields``: printable ASCII, odd names quoted), comma-separated
    for the ``X-Ignored-Fields`` header, cut at MAX_IGNORED_HEADER characters with ``...``."""
    text = ", ".join(fields)
    return text if len(text) <= MAX_IGNORED_HEADER else text[: MAX_IGNORED_HEADER - 3] + "..."


def _shown(name: str) -> str:
    plain = name and all(c.isascii() and c.isprintable() and c not in ' ,"' for c in name)
    return name if plain else json.dumps(name)


def _ignored_in(value: Any, at: str) -> list[str]:
    if isinstance(value, BaseModel):
        return ignored_fields(value, f"{at}.")
    if isinstance(value, list):
        return [f for i, v in enumerate(value) for f in _ignored_in(v, f"{at}[{i}]")]
    return []


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body (openai_format.error_body), as the gateway's and the worker's OpenAPI documents
    declare it."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = OPEN
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: ``schema`` constrains the output (none: any JSON object).
    ``name``, ``description`` and ``strict`` are taken and not used: the output always follows the schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, serialize_by_alias=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


RESPONSE_FORMAT_SCHEMA = {"oneOf": [
    {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]},
    {"type": "object", "properties": {"type": {"const": "json_object"}}, "required": ["type"]},
    {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
        "type": "object", "properties": {"name": {"type": ["string", "null"]},
                                         "description": {"type": ["string", "null"]},
                                         "schema": {"type": ["object", "null"]},
                                         "strict": {"type": ["boolean", "null"]}}}},
     "required": ["type", "json_schema"]},
    {"type": "null"},
]}


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (unconstrained), ``json_object`` (any JSON object) or ``json_schema``
    (JSON that follows ``json_schema.schema``), lossless under speculation (structured_outputs in generate.py)."""

    model_config = OPEN

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format: type json_schema needs a 'json_schema' object")
        return self

    def structured(self) -> StructuredOutputs | None:
        if self.type == "json_object" or (self.type == "json_schema" and self.json_schema is not None
                                          and self.json_schema.json_schema is None):
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema" and self.json_schema is not None:
            return StructuredOutputs(json=self.json_schema.json_schema)
        return None




class _Common(BaseModel):
    model_config = OPEN

    model: str = Field(min_length=1)
    max_tokens: Count | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # OpenAI's default samples
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TokenId = 0  # a count, of the same kind
    n: Choices = 1  # choices, each its own engine request (contract/choices.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings = Field(default_factory=list)
    seed: Seed | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0  # vLLM's
    logit_bias: LogitBias | None = None
    min_tokens: TokenId = 0  # vLLM's: stop tokens held back until this many are out (at most max_tokens)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)  # vLLM's
    slo_class: SloClassName | None = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs (not both)
    response_format: Annotated[ResponseFormat | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    structured_outputs: Annotated[StructuredOutputs | None, WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)] = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return check_encodable(data)  # before anything else: a lone surrogate must never reach a worker

    @property
    def overridden_fields(self) -> list[str]:
        """Known fields another one overrides, named as ignored: a JSON ``response_format`` beside
        ``structured_outputs``, which wins (vLLM's explicit field over OpenAI's)."""
        both = self.structured_outputs is not None and self.response_format is not None
        out = ["response_format"] if both and self.response_format.structured() is not None else []
        if isinstance(self, ChatRequest) and self.top_logprobs is not None and not self.logprobs:
            out.append("top_logprobs")  # OpenAI refuses it without logprobs: true; here it asks for nothing
        return out

    def structured(self) -> StructuredOutputs | None:
        """What constrains the output, if anything."""
        if self.structured_outputs is not None:
            return self.structured_outputs
        return None if self.response_format is None else self.response_format.structured()

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """The worker's sampling fields (POST /v1/generate)."""
        return {"max_tokens": self.max_tokens or default_max_tokens, "temperature": self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
                "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                "logit_bias": self.logit_bias or {}, "presence_penalty": self.presence_penalty,
                "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                "structured_outputs": self.structured(), "logprobs": self.top_logprobs_wanted()}

    def top_logprobs_wanted(self) -> int | None:
        """How many of each token's most likely alternatives to report (None: no logprobs)."""
        raise NotImplementedError

    def prompt_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def sequences(self) -> int:
        """How many sequences to generate: ``n`` (completions: ``best_of`` when given)."""
        return self.n

    def echo_text(self) -> str:
        """What every choice's text starts with (completions' ``echo``: the prompt)."""
        return ""

    def generate_requests(self, default_max_tokens: int, slo: SloTargets, request_id: str) -> list[GenerateRequest]:
        """One engine request per sequence (``sequences``): request id ``<request_id>-<i>`` when there are several,
        seed ``choice_seed(seed, i)``; ``best_of`` asks each for its tokens' logprobs, to rank them by."""
        first = self.generate_request(default_max_tokens, slo, request_id)
        count = self.sequences
        if count == 1:
            return [first]
        extra = {"logprobs": 0} if count > self.n and first.logprobs is None else {}
        return [first.model_copy(update={"request_id": sequence_id(request_id, i, count),
                                         "seed": choice_seed(first.seed, i), **extra}) for i in range(count)]

    def generate_request(self, default_max_tokens: int, slo: SloTargets, request_id: str) -> GenerateRequest:
        """What the gateway sends a worker for this body (streamed: the gateway reads every worker's stream);
        on a worker, what its OpenAI route submits to its engine.

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


def _false_is_none(v: object) -> object:
    return None if v is False else v


class CompletionRequest(_Common):
    prompt: Annotated[str | list[str] | list[TokenId], WithJsonSchema(PROMPT_SCHEMA)]
    # the emitted token's log-probability and the top ``logprobs`` of its row (engine/speculation/logprobs.py);
    # ``false`` (which some clients send for "none") is none
    logprobs: Annotated[whole(ge=0, le=MAX_TOP_LOGPROBS) | None, BeforeValidator(_false_is_none), WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}, {"const": False},
                   {"type": "null"}]})] = None
    echo: bool = False  # every choice's text starts with the prompt (a text prompt, without logprobs)
    best_of: Choices | None = None  # generate this many, return the n with the highest cumulative logprob
    suffix: Annotated[str | None, _only(None, "")] = None

    # the OpenAPI document declares the rules across fields that ``_one_prompt`` checks, so that a client or a
    # fuzzer reading it knows them (best_of >= n, one clause per n)
    model_config = ConfigDict(extra="allow", json_schema_extra={"allOf": [
        *({"not": {"required": ["n", "best_of"], "properties": {
            "n": {"type": "number", "minimum": k}, "best_of": {"type": "number", "maximum": k - 1}}}}
          for k in range(2, MAX_CHOICES + 1)),
        {"not": {"required": ["stream", "best_of"], "properties": {
            "stream": {"const": True}, "best_of": {"type": "number", "minimum": 2}}}},
        {"not": {"required": ["echo", "logprobs"], "properties": {
            "echo": {"const": True}, "logprobs": {"type": "number"}}}},
        {"not": {"required": ["echo", "prompt"], "properties": {
            "echo": {"const": True}, "prompt": {"type": "array", "items": {"type": "integer"}}}}},
    ]})

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str) and len(p) != 1:
            raise ValueError("prompt: one prompt per request (got a list of several); send one request each")
        if len(p) == 0 or (isinstance(p, list) and isinstance(p[0], str) and not p[0]):
            raise ValueError("prompt: must not be empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of: must be at least n ({self.best_of} < {self.n}): best_of sequences are "
                             "generated and the n most likely returned")
        if self.stream and self.best_of is not None and self.best_of > 1:
            raise ValueError("best_of: cannot be streamed (the best are known only at the end); send stream: "
                             "false, or n instead of best_of")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: not with logprobs (the prompt's own log-probabilities are not computed)")
        if self.echo and not isinstance(p, str) and not isinstance(p[0], str):
            raise ValueError("echo: needs a text prompt (the gateway does not turn token ids into text)")
        return self

    @property
    def sequences(self) -> int:
        return self.best_of or self.n

    def echo_text(self) -> str:
        if not self.echo:
            return ""
        p = self.prompt
        return p if isinstance(p, str) else str(p[0])

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_fields(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, str):
            return {"prompt": p}
        if isinstance(p[0], str):
            return {"prompt": p[0]}
        return {"prompt_token_ids": p}


class ContentPart(BaseModel):
    model_config = OPEN
    type: Literal["text"]
    text: str


class FunctionCall(ToolCallFunction):
    model_config = OPEN


class MessageToolCall(ToolCall):
    model_config = OPEN
    function: FunctionCall


class Message(BaseModel):
    """One turn. ``name``, an assistant's ``tool_calls`` and a tool turn's ``tool_call_id`` go to the worker,
    which renders them with the model's chat template or refuses the request (400) when it cannot."""

    model_config = OPEN
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def turn(self) -> dict[str, Any]:
        """The worker's ChatMessage fields: the known ones only (an unknown field is ignored, not passed on)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [ToolCall.model_construct(
                id=c.id, type=c.type, function=ToolCallFunction.model_construct(name=c.function.name,
                                                                                arguments=c.function.arguments))
                for c in self.tool_calls]
        return out


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None  # each emitted token's log-probability (engine/speculation/logprobs.py)
    top_logprobs: whole(ge=0, le=MAX_TOP_LOGPROBS) | None = None  # and the top k of its row (with logprobs only)

    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_fields(self) -> dict[str, Any]:
        return {"messages": [ChatMessage.model_construct(**m.turn()) for m in self.messages]}

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        return out


TargetMs = Annotated[float | None, Field(gt=0.0, allow_inf_nan=False)]


class _WorkerTargets(BaseModel):
    """A worker's OpenAI routes also take ``/v1/generate``'s explicit targets (the gateway sets them itself)."""

    model_config = OPEN

    tpot_slo_ms: TargetMs = None
    ttft_slo_ms: TargetMs = None


class WorkerCompletionRequest(CompletionRequest, _WorkerTargets):
    pass


class WorkerChatRequest(ChatRequest, _WorkerTargets):
    pass
