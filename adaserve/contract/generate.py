"""The body of a worker's ``POST /v1/generate``: what the gateway sends, and what anyone may send a worker.

Shape checks only; what the engine can serve (context length, vocabulary, KV) the worker checks against
its engine. The gateway's OpenAI bodies use the same field types (token ids, class names, stop strings),
so what the gateway accepts at its edge a worker accepts too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, WithJsonSchema, model_validator

from adaserve.contract.slo import SloClassName
from adaserve.contract.text import check_encodable

# The gateway's request ids reach workers, and both answer /v1/requests/{id}: one syntax for both.
REQUEST_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
RequestId = Annotated[str, Field(pattern=REQUEST_ID_PATTERN)]


def integral(v: object) -> object:
    """A JSON number with no fractional part (``2.0``) is an integer, as JSON Schema (and so the OpenAPI
    document) says; anything else is left for the strict type to refuse by name (a bool, a string, ``2.5``)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def whole(**bounds: int) -> Any:
    """A strict integer within ``bounds`` (ge, lt, ...) that also takes ``2.0``. The bounds come before the
    conversion, so the JSON schema declares them (minimum, ...)."""
    return Annotated[StrictInt, Field(**bounds), BeforeValidator(integral)]


Integer = whole()
Count = whole(ge=1)  # max_tokens and the like
Seed = whole(ge=0, lt=2**63)
TokenId = whole(ge=0)  # strict: a bool or a string is not a token id
MAX_STOPS = 16


def stop_list(v: object) -> object:
    """``stop`` as OpenAI takes it (none, one string, or a list) -> a list of at most 16 non-empty strings.

    Anything that is not a string or a list is passed on for the field's type to refuse by name.
    """
    stops = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(stops, list):
        return v
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop strings")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


StopStrings = Annotated[list[str], BeforeValidator(stop_list), WithJsonSchema({"anyOf": [
    {"type": "null"}, {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS}]})]
Role = Literal["system", "user", "assistant", "developer", "tool"]
# logit_bias as OpenAI sends it: token ids as JSON object keys (decimal, no leading zero), biases in [-100, 100]
TOKEN_KEY_PATTERN = r"^(0|[1-9][0-9]{0,8})$"
MAX_LOGIT_BIAS = 1024
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_KEY_PATTERN)], Bias], Field(max_length=MAX_LOGIT_BIAS),
                      WithJsonSchema({"type": "object", "propertyNames": {"pattern": TOKEN_KEY_PATTERN},
                                      "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                      "maxProperties": MAX_LOGIT_BIAS})]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]  # OpenAI's range, as vLLM's
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)]
MAX_TOOL_CALLS = 128


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it; the worker parses it for chat templates that want an object


class ToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as OpenAI's messages carry it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One turn of a conversation; the worker renders the turns with the model's chat template, tool calls and
    tool results included (adaserve/engine/loading/chat.py), or refuses them with 400 when it cannot."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)  # an assistant turn's
    tool_call_id: str | None = None  # a tool turn's: the call it answers


MAX_CHOICES = 1024  # as the engine's grammar.MAX_CHOICES
MAX_TOP_LOGPROBS = 20  # as the engine's logprobs.MAX_TOP_LOGPROBS, OpenAI's and vLLM's limit


# the rule of StructuredOutputs._one as JSON Schema, for the OpenAPI documents
STRUCTURED_OUTPUTS_SCHEMA = {"oneOf": [
    {"type": "object", "properties": {"json": {"type": "object"}}, "required": ["json"],
     "additionalProperties": False},
    {"type": "object", "properties": {"regex": {"type": "string", "minLength": 1}}, "required": ["regex"],
     "additionalProperties": False},
    {"type": "object", "properties": {"choice": {"type": "array", "items": {"type": "string", "minLength": 1},
                                                 "minItems": 1, "maxItems": 1024}},
     "required": ["choice"], "additionalProperties": False},
    {"type": "object", "properties": {"grammar": {"type": "string", "minLength": 1}}, "required": ["grammar"],
     "additionalProperties": False},
    {"type": "object", "properties": {"json_object": {"const": True}}, "required": ["json_object"],
     "additionalProperties": False},
    {"type": "null"},
]}


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: the output constrained by exactly one of a JSON schema (``json``), a regular
    expression the whole output matches (``regex``), a list of strings it is one of (``choice``), a Lark grammar
    (``grammar``, llguidance's dialect) or any JSON object (``json_object``). The worker compiles it and refuses
    an invalid one with 400 (adaserve/engine/speculation/grammar.py)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        # exactly one field sent, and not empty: an explicit null beside another is refused as the document says
        given = [getattr(self, name) for name in self.model_fields_set]
        if len(given) != 1 or given[0] is None or given[0] is False:
            raise ValueError("structured_outputs: give exactly one of 'json', 'regex', 'choice', 'grammar' or "
                             "'json_object': true")
        return self

    def spec(self) -> tuple[str, str]:
        """(kind, source) as the engine's ``GrammarSpec`` takes them."""
        if self.json_schema is not None:
            return "json", json.dumps(self.json_schema)
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json", '{"type": "object"}'


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    max_tokens: Count | None = None
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: TokenId = 0  # a count, of the same kind
    seed: Seed | None = None
    stop: StopStrings = Field(default_factory=list)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    # logits processors (adaserve/engine/speculation/logits_processors.py): vLLM's meaning, lossless under
    # speculation. min_tokens counts this worker's output (a continuation's is what is left, as max_tokens);
    # a min_tokens over max_tokens is refused with 400.
    min_tokens: TokenId = 0  # a count, of the same kind
    logit_bias: LogitBias = Field(default_factory=dict)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    # structured output: every emitted token allowed by the grammar after the output before it, lossless under
    # speculation (the target's rows are masked at every tree node); min_tokens cannot be combined with it
    structured_outputs: Annotated[StructuredOutputs | None, WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)] = None
    # log-probabilities of each emitted token and of the top k of its row (0: the token's only), from the target's
    # raw distribution after the structured-output mask, as vLLM reports them (engine/speculation/logprobs.py)
    logprobs: whole(ge=0, le=MAX_TOP_LOGPROBS) | None = None
    tpot_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # the gateway sends its class's TTFT target, so the worker's SLO verdict and metrics use it too
    ttft_slo_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    slo_class: SloClassName | None = None
    request_id: RequestId | None = None
    stream: bool = False
    # A continuation (the gateway's failover, docs/gateway.md): the tokens an earlier worker already sent for
    # this request. They extend the prompt, are not output (not counted, not streamed again, not in
    # prompt_tokens), and a seeded request's random stream starts past them, so the continuation draws what
    # an unbroken run would have drawn. ``max_tokens`` is what is left. ``resume_text`` is the text already
    # shown from them (the earlier worker may have held a tail back): the stream goes on from there.
    resume_token_ids: list[TokenId] | None = Field(None, min_length=1)
    resume_text: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _text(cls, data: Any) -> Any:
        return check_encodable(data)

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages)) != 1:
            raise ValueError("give exactly one of 'prompt', 'prompt_token_ids' or 'messages'")
        if self.resume_text is not None and self.resume_token_ids is None:
            raise ValueError("resume_text needs resume_token_ids")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop)
