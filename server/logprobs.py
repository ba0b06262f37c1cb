"""Log probabilities in OpenAI's two answer formats: chat's (`choices[].logprobs.content`, one
entry per token with its `top_logprobs`) and the legacy completions' (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`, parallel lists). The values are the router's (`StreamEvent.logprob`:
each token's, under the model that wrote it); the model is named per token, an extension
(`aiorouter_model` in a chat entry, the parallel list `aiorouter_models` in the legacy format).

A token's text is the entry model's decoding of that token alone, as vLLM's; a model without a
tokenizer names it `token_id:<id>`, vLLM's form for `return_tokens_as_token_ids`."""
from __future__ import annotations

from typing import Any, NamedTuple

from engines.logprobs import TokenLogprob


class LoggedToken(NamedTuple):
    """One output token of an answer that asked for log probabilities."""

    token_id: int
    model: str | None  # None: an echoed prompt's first token (no model predicts it)
    logprob: TokenLogprob | None  # None only with model None
    text_offset: int  # where its text starts in the answer's text (characters)


class TokenText:
    """Token id -> its text, each id decoded once per answer (the alternatives repeat)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.seen = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.seen.get(token_id)
        if text is None:
            text = self.seen[token_id] = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                                          else f"token_id:{token_id}")
        return text


def _entry(text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    s = text(token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokens: list[LoggedToken], text: TokenText) -> dict[str, Any]:
    """Chat's `logprobs` object for these tokens: an entry each, with its alternatives."""
    content = []
    for t in tokens:
        e = _entry(text, t.token_id, t.logprob.logprob)
        e["top_logprobs"] = [_entry(text, i, lp) for i, lp in t.logprob.top]
        e["aiorouter_model"] = t.model
        content.append(e)
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: list[LoggedToken], text: TokenText) -> dict[str, Any]:
    """The legacy completions' `logprobs` object. Each `top_logprobs` dict holds the k most
    probable tokens and the sampled one (so up to k + 1, as OpenAI documents), keyed by text. An
    echoed prompt's first token has None for both, as OpenAI's and vLLM's."""
    top: list[dict[str, float] | None] = []
    for t in tokens:
        if t.logprob is None:
            top.append(None)
            continue
        d = {text(i): lp for i, lp in t.logprob.top}
        d.setdefault(text(t.token_id), t.logprob.logprob)
        top.append(d)
    return {"tokens": [text(t.token_id) for t in tokens],
            "token_logprobs": [t.logprob.logprob if t.logprob is not None else None for t in tokens],
            "top_logprobs": top, "text_offset": [t.text_offset for t in tokens],
            "aiorouter_models": [t.model for t in tokens]}
