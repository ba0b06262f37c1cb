"""The one output path: a request's committed tokens, its stop checks, its streamed text and its
finish reason. `Engine.generate` and the router's request table both commit through it, so EOS,
stop strings (with holdback), max tokens and the context limit behave the same in both."""
from __future__ import annotations

from typing import NamedTuple

from engines.detokenizer import IncrementalDetokenizer
from engines.sampling import SamplingParams


class Commit(NamedTuple):
    # newly final text (may be empty: a character or a stop string still forming); None when the
    # stream defers its text to whoever reads it (`text_of`)
    text: str | None
    finish_reason: str | None  # "stop" | "length" once the request is over, else None


class OutputStream:
    """Tokens are appended here once and never taken back. `token_ids` is the caller's list (prompt
    first), appended in place. Text is held back while a stop string could still be forming, and
    cut where one completes, so streamed text never has to be retracted."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, sampling: SamplingParams,
                 eos_ids: tuple[int, ...], max_model_len: int, tokenizer=None, defer_text: bool = False):
        """`defer_text`: commit tokens without detokenizing them, the text made when its reader asks
        (`text_of`, once per token, in order: a router's client, after the step that committed them
        has launched the next); honoured only when no stop string needs the text at commit."""
        self.token_ids, self.num_prompt_tokens, self.sampling = token_ids, num_prompt_tokens, sampling
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, token_ids[:num_prompt_tokens]) if tokenizer else None
        self.defer_text = defer_text and self.detok is not None and not sampling.stop
        self.texted = 0  # output tokens detokenized (all that were committed, unless defer_text)
        self.finish_reason: str | None = None
        self.emitted_chars = 0  # text streamed so far
        self.stop_cut: int | None = None  # where a stop string cuts the text

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text as streamed so far (the whole of it once finished)."""
        return self.detok.text[:self.emitted_chars] if self.detok is not None else ""

    def append(self, token: int) -> Commit:
        """Commit one token: stop checks, then the text that is now final."""
        if self.finished:
            raise RuntimeError(f"token {token} committed after the request finished ({self.finish_reason})")
        self.token_ids.append(token)
        if self.defer_text:
            reason = self._stop_reason(token)
            self.finish_reason = reason
            return Commit(None, reason)
        if self.detok is not None:
            self.detok.add(token)
            self.texted += 1
        reason = self._stop_reason(token)
        if reason is not None:
            self.finish_reason = reason
        return Commit(self._take_text(final=reason is not None), reason)

    def finish(self, reason: str) -> str | None:
        """End from outside (abort, error, a policy's finished PeerReq); returns the text left to
        stream (None when it is deferred: `text_of`)."""
        if self.finished:
            return ""
        self.finish_reason = reason
        return None if self.defer_text else self._take_text(final=True)

    def text_of(self, token: int | None, final: bool) -> str:
        """A deferred stream's next piece of text, exactly as `append` or `finish` would have made
        it: for its next output token (`token`, checked), or for none (`finish`'s last piece);
        `final` for the stream's last event."""
        if token is not None:
            ids = self.token_ids
            at = self.num_prompt_tokens + self.texted
            if at >= len(ids) or ids[at] != token:
                raise RuntimeError(f"text asked for token {token} out of order (output token {self.texted} "
                                   f"is {ids[at] if at < len(ids) else None})")
            self.detok.add(token)
            self.texted += 1
        return self._take_text(final)

    def _stop_reason(self, token: int) -> str | None:
        p, n = self.sampling, self.num_output_tokens
        if n >= p.min_tokens:
            if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
                return "stop"
            if p.stop and self.detok is not None:
                hits = [i for i in (self.detok.text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    self.stop_cut = min(hits)
                    return "stop"
        if n >= p.max_tokens or len(self.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _take_text(self, final: bool) -> str:
        if self.detok is None:
            return ""
        if final:
            self.detok.flush()
        text = self.detok.text
        end = len(text)
        if self.stop_cut is not None:
            end = self.stop_cut
        elif self.sampling.stop and not final:  # a stop string may still be forming at the end
            end = max(self.emitted_chars, len(text) - max(len(s) for s in self.sampling.stop) + 1)
        delta = text[self.emitted_chars:end]
        self.emitted_chars = max(self.emitted_chars, end)
        return delta
