"""OpenAI request bodies, validated by pydantic. Types are strict, as the published JSON schema
says: `"temperature": true` or `"max_tokens": "10"` is a 400, not a number pydantic made of it.

Three kinds of field:
- implemented ones, honoured;
- OpenAI and vLLM fields this server cannot honour (tools, structural tags, beam search, ...):
  accepted only at their neutral value, so nothing the client asked for is silently dropped;
- fields nobody here knows: kept in `model_extra`, and the server ignores them with a warning
  and a response header, as vLLM does, or refuses them when started with --strict
  (`unknown_fields` finds them at any depth)."""
from __future__ import annotations

import json
from typing import Annotated, Any, Iterator, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from engines.logprobs import MAX_LOGPROBS
from engines.sampling import SEED_MAX, SEED_MIN

# the most choices one request asks for (its prompts times n, or best_of): each is a request of its own
MAX_CHOICES = 128
# the header on the answer to a request whose unknown fields the server ignored, naming them
IGNORED_HEADER = "X-Aiorouter-Ignored-Fields"
# Unknown fields are kept, not refused: whether they are ignored or refused is the server's
# choice (ServerConfig.strict), made after validation.
_REQUEST = ConfigDict(extra="allow", strict=True)


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 equals 1.0, but true is not 1 (Python's == says it is)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def _neutral_only(table: dict[str, tuple[Any, tuple]]) -> dict[str, Any]:
    """Fields, for `create_model`, that the server cannot honour: each passes only its neutral
    values (the first is the default), the published schema lists them as its enum, and any
    other value is a 400 that names the field. Built from a table rather than written out: one
    line per field keeps the type and the neutral values side by side."""
    fields = {}
    for name, (annotation, neutral) in table.items():
        said = " or ".join(json.dumps(v) for v in neutral if v is not None)
        hint = f"leave it out or send {said}" if said else "leave it out"

        def check(v, name=name, neutral=neutral, hint=hint):
            if not any(_same(v, n) for n in neutral):
                raise ValueError(f"{name} is not supported by this server ({hint})")
            return v
        fields[name] = (Annotated[annotation, AfterValidator(check)],
                        Field(default=neutral[0], json_schema_extra={"enum": list(neutral)}))
    return fields


_OBJ = dict[str, Any] | None

# vLLM's sampling and output extensions, and its structured-output fields, on both endpoints
COMMON_UNSUPPORTED: dict[str, tuple[Any, tuple]] = {
    "length_penalty": (float | None, (None, 1.0)),
    "use_beam_search": (bool | None, (None, False)),
    "bad_words": (list[str] | None, (None, [])),
    "allowed_token_ids": (list[int] | None, (None,)),
    "spaces_between_special_tokens": (bool | None, (None, True)),
    "truncate_prompt_tokens": (int | None, (None,)),
    "prompt_logprobs": (int | None, (None,)),  # vLLM answers prompt log-probabilities even for 0
    "return_tokens_as_token_ids": (bool | None, (None, False)),
    "logits_processors": (list[Any] | None, (None, [])),
    "structural_tag": (str | None, (None,)),
    "priority": (int | None, (None, 0)),  # requests are served first come, first served
    "cache_salt": (str | None, (None,)),  # the prefix cache is shared by every request
}

COMPLETION_UNSUPPORTED: dict[str, tuple[Any, tuple]] = {
    "add_special_tokens": (bool | None, (None, True)),  # the prompt is tokenized with them, as vLLM's
}

CHAT_UNSUPPORTED: dict[str, tuple[Any, tuple]] = {
    # no tool calling: without tools, "auto" and "none" choose the same (nothing)
    "tools": (list[dict[str, Any]] | None, (None, [])),
    "tool_choice": (str | dict[str, Any] | None, (None, "none", "auto")),
    "functions": (list[dict[str, Any]] | None, (None, [])),
    "function_call": (str | dict[str, Any] | None, (None, "none", "auto")),
    "parallel_tool_calls": (bool | None, (None, True, False)),  # says nothing when there are no tools
    "add_special_tokens": (bool | None, (None, False)),  # the chat template writes them, as vLLM's
    "add_generation_prompt": (bool | None, (None, True)),
    "continue_final_message": (bool | None, (None, False)),
    "chat_template": (str | None, (None,)),
    "chat_template_kwargs": (_OBJ, (None, {})),
    "mm_processor_kwargs": (_OBJ, (None, {})),
    "documents": (list[Any] | None, (None, [])),
    "echo": (bool | None, (None, False)),
    "reasoning_effort": (str | None, (None,)),
    "modalities": (list[str] | None, (None, ["text"])),
    "audio": (_OBJ, (None,)),
    "prediction": (_OBJ, (None,)),
    "web_search_options": (_OBJ, (None,)),
    "store": (bool | None, (None, False)),  # nothing is stored
    "service_tier": (str | None, (None, "auto", "default")),
}

# fields that label a request and ask nothing of the answer (OpenAI's `user` is another)
LABELS: dict[str, Any] = {
    "metadata": (dict[str, str] | None, Field(default=None, max_length=16)),  # OpenAI's limit
}


class StreamOptions(BaseModel):
    model_config = _REQUEST
    include_usage: bool = False
    # vLLM's: every chunk carries the usage so far (here whether or not include_usage is set, which
    # adds the closing usage-only chunk as OpenAI's)
    continuous_usage_stats: bool = False


class _CommonFields(BaseModel):
    model_config = _REQUEST

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None (omitted or null): the server's sampling default (server/sampling.py)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # vLLM's range, a signed 64-bit integer; checked below so the error names both ends of the range
    seed: int | None = Field(default=None, json_schema_extra={"minimum": SEED_MIN, "maximum": SEED_MAX})
    # any number of stop strings, as vLLM takes them (OpenAI's limit of 4 is not a vLLM one)
    stop: str | list[str] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}},
                  {"type": "null"}]})
    # choices per prompt, each sampled on its own (its seed, when set, is seed + its index, as vLLM's)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None
    request_id: str | None = None  # vLLM's: the answer's id is cmpl-/chatcmpl-<request_id>
    routing: dict[str, Any] | None = None  # extension: {"policy": "rstitch", "tau": 0.05}
    # sampling controls (engines.sampling.SamplingParams), with OpenAI's and vLLM's ranges
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # None: the server's default (the generation config's, as vLLM reads it; else 1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    # token id (a string, as JSON keys are) -> a bias in [-100, 100] added to its logit
    logit_bias: dict[str, float] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {"minimum": -100, "maximum": 100}})
    stop_token_ids: list[int] | None = Field(default=None, json_schema_extra={"items": {"minimum": 0}})
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output (server/structured.py reads them, engines/grammar.py applies them): OpenAI's
    # response_format, vLLM's structured_outputs and its older guided_* fields; at most one of them
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("seed")
    @classmethod
    def _seed_range(cls, v: int | None) -> int | None:
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (64 bits)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and any(not s for s in v):
            raise ValueError("stop takes non-empty strings")
        if v == "":
            raise ValueError("stop must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer, as a string)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} is {bias}; biases are in [-100, 100]")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids are non-negative integers")
        return v

    @model_validator(mode="after")
    def _unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class _CompletionFields(_CommonFields):
    # text, token ids, or a batch of either (OpenAI's forms): a batch's choices are numbered prompt
    # by prompt (prompt i's j-th choice is choice i * n + j, as vLLM's)
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "integer"}},
        {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer"}}}]})
    # 0 only with echo: the prompt echoed (and scored, with logprobs) and nothing generated, as vLLM's
    max_tokens: int | None = Field(default=None, ge=0)
    # the answer's text starts with the prompt's; with logprobs, the prompt's tokens are scored too
    # (Router.score: teacher-forced, each position by the model the policy routes it to)
    echo: bool = False
    # the legacy form: per token its log probability and the `logprobs` most probable tokens
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = Field(default=None, json_schema_extra={"enum": [None, ""]})
    # sampled per prompt, of which the n with the highest cumulative log probability are returned
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"a batch holds at most {MAX_CHOICES} prompts")
            if any(not p for p in v):
                raise ValueError("a prompt of the batch is empty")
            if len(v) == 1:  # a batch of one is that prompt
                v = v[0]
        if not v:
            raise ValueError("prompt is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch's."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    @model_validator(mode="after")
    def _unsupported_completion(self):
        if self.echo and self.stream:
            raise ValueError("echo cannot stream on this server: ask for it without stream")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is allowed only with echo (the prompt echoed and scored, "
                             "nothing generated), as vLLM's")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be at least n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of larger than n cannot stream (the best choices are known at the end)")
        if len(self.prompts()) * (self.best_of or self.n) > MAX_CHOICES:
            raise ValueError(f"the batch's prompts times best_of (or n) is more than {MAX_CHOICES} choices")
        return self


CompletionRequest = create_model("CompletionRequest", __base__=_CompletionFields, __module__=__name__,
                                 **_neutral_only({**COMMON_UNSUPPORTED, **COMPLETION_UNSUPPORTED}), **LABELS)


class _ChatMessageFields(BaseModel):
    model_config = _REQUEST
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


# OpenAI's message fields for tool calls and reasoning: the chat template would render them, and
# this server passes it role and content alone, so only their empty values pass
MESSAGE_UNSUPPORTED: dict[str, tuple[Any, tuple]] = {
    "tool_calls": (list[dict[str, Any]] | None, (None, [])),
    "tool_call_id": (str | None, (None,)),
    "function_call": (_OBJ, (None,)),
    "refusal": (str | None, (None,)),
    "reasoning_content": (str | None, (None,)),
}
ChatMessage = create_model("ChatMessage", __base__=_ChatMessageFields, __module__=__name__,
                           **_neutral_only(MESSAGE_UNSUPPORTED))


class _ChatFields(_CommonFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None  # per token its log probability, and `top_logprobs` alternatives
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


ChatCompletionRequest = create_model("ChatCompletionRequest", __base__=_ChatFields, __module__=__name__,
                                     **_neutral_only({**COMMON_UNSUPPORTED, **CHAT_UNSUPPORTED}), **LABELS)


# -- tokenization, as vLLM's /tokenize and /detokenize -------------------------------------------------
class TokenizeCompletionRequest(BaseModel):
    """Text, tokenized as /v1/completions tokenizes a prompt (with add_special_tokens)."""
    # one of the two forms of a /tokenize body: which one is the key it holds, never both
    model_config = ConfigDict(**_REQUEST, json_schema_extra={"not": {"required": ["messages"]}})
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class _TokenizeChatFields(BaseModel):
    """Messages, rendered by the entry model's chat template and tokenized as /v1/chat/completions
    does (with add_generation_prompt and without add_special_tokens)."""
    model_config = ConfigDict(**_REQUEST, json_schema_extra={"not": {"required": ["prompt"]}})
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


TokenizeChatRequest = create_model("TokenizeChatRequest", __base__=_TokenizeChatFields, __module__=__name__,
                                   **_neutral_only({k: CHAT_UNSUPPORTED[k] for k in (
                                       "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
                                       "mm_processor_kwargs")}))


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST
    model: str | None = None
    tokens: list[int]


def unknown_fields(body: BaseModel, path: tuple = ()) -> Iterator[tuple]:
    """The path of each field of a validated request that no model here declares (pydantic kept
    it in `model_extra`), nested models and lists of them included: ("stream_options", "x"),
    ("messages", 2, "x")."""
    for name in body.model_extra or {}:
        yield (*path, name)
    for name in type(body).model_fields:
        value = getattr(body, name)
        for i, item in enumerate(value) if isinstance(value, list) else [(None, value)]:
            if isinstance(item, BaseModel):
                yield from unknown_fields(item, (*path, name) if i is None else (*path, name, i))


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


class CompletionLogprobs(_Open):
    """The legacy format (server/logprobs.py): parallel lists, one entry per token."""
    tokens: list[str]
    # None for an echoed prompt's first token, which no model predicts (OpenAI's, vLLM's)
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the `logprobs` most probable tokens and the sampled one
    text_offset: list[int]
    aiorouter_models: list[str | None]  # extension: the model that wrote (or scored) each token


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None  # with "logprobs": k


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


class TopLogprob(_Open):
    token: str
    logprob: float
    bytes: list[int]  # the token's text in UTF-8


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]  # `top_logprobs` of them, most probable first
    aiorouter_model: str  # extension: the model that wrote the token


class ChatLogprobs(_Open):
    content: list[TokenLogprobEntry]
    refusal: None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length"] | None
    logprobs: ChatLogprobs | None = None  # with "logprobs": true


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
    created: int  # when the server started
    owned_by: str
    root: str  # the entry model's checkpoint (its name, for a simulated model), as vLLM's
    parent: str | None
    max_model_len: int | None  # the context every model fits; null while the models load


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Open):
    status: Literal["ok"]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with "return_token_strs": true


class DetokenizeResponse(_Open):
    prompt: str


class Version(_Open):
    version: str


class PrefixCacheReset(_Open):
    pages_freed: dict[str, int]  # by model


class CompletionChunkChoice(_Open):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: CompletionLogprobs | None = None  # the chunk's token's, when asked


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
    logprobs: ChatLogprobs | None = None  # the chunk's token's, when asked


class ChatCompletionChunk(_Open):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
