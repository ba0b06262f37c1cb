"""OpenAI request bodies, validated by pydantic. Unknown fields are refused (extra="forbid"),
and OpenAI fields this server does not implement are accepted only at their neutral value:
nothing is accepted and then silently ignored. Types are strict, as the published JSON schema
says: `"temperature": true` or `"max_tokens": "10"` is a 400, not a number pydantic made of it."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engines.sampling import SEED_MAX, SEED_MIN


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None (omitted or null): the server's sampling default (server/sampling.py)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # vLLM's range, a signed 64-bit integer; checked below so the error names both ends of the range
    seed: int | None = Field(default=None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    stop: str | list[str] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "maxItems": 4,
                                                       "items": {"type": "string", "minLength": 1}}, {"type": "null"}]})
    n: int = Field(default=1, json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    routing: dict[str, Any] | None = None  # extension: {"policy": "rstitch", "tau": 0.05}
    # OpenAI fields without an implementation here: only their neutral values pass (the published
    # schema says so, and the validators below name the field to a client that sends another).
    presence_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})
    frequency_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={"maxProperties": 0})
    logprobs: Any = Field(default=None, json_schema_extra={"enum": [None, False, 0]})

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and (len(v) > 4 or any(not s for s in v)):
            raise ValueError("stop takes at most 4 non-empty strings")
        if v == "":
            raise ValueError("stop must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported by this server")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_Common):
    # text, token ids, or a batch of one of either (OpenAI's forms; a batch of more is refused)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "integer"}},
        {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": 1,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}}]})
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})
    suffix: str | None = Field(default=None, json_schema_extra={"enum": [None, ""]})
    best_of: int | None = Field(default=None, json_schema_extra={"enum": [None, 1]})

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by this server")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(p["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# -- responses: what the server answers, published in its OpenAPI document (server/openapi.py) ----
# Extra fields are allowed: they document the shape a client can rely on, and a checker holding
# answers to them (Schemathesis in tests/test_fuzz.py) fails on a missing or mistyped field.

class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    per_model: dict[str, int]  # extension: the tokens each model of the router wrote


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None


class Completion(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Open):
    status: Literal["ok"]


class PrefixCacheReset(_Open):
    pages_freed: dict[str, int]  # by model


class CompletionChunkChoice(_Open):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(_Open):
    """One server-sent event of a streamed completion; the last one (stream_options.include_usage)
    has no choices and the usage."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Delta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: Delta
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
