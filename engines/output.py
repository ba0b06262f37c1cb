"""The one output path: a request's committed tokens, its stop checks, its streamed text and its
finish reason. `Engine.generate` and the router's request table both commit through it, so EOS,
stop strings (with holdback), max tokens and the context limit behave the same in both."""
from __future__ import annotations

from typing import NamedTuple

from engines.detokenizer import IncrementalDetokenizer
from engines.grammar import GrammarState
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
                 eos_ids: tuple[int, ...], max_model_len: int, tokenizer=None, defer_text: bool = False,
                 grammar: GrammarState | None = None):
        """`defer_text`: commit tokens without detokenizing them, the text made when its reader asks
        (`text_of`, once per token, in order: a router's client, after the step that committed them
        has launched the next); honoured only when no stop string needs the text at commit.
        `grammar`: the request's structured-output state (`sampling.structured`), here because every
        committed token passes through this stream, whichever model wrote it (engines/grammar.py)."""
        if (sampling.structured is None) != (grammar is None):
            raise ValueError("an output stream needs a grammar state exactly when its sampling asks for structured output")
        self.grammar = grammar
        self.token_ids, self.num_prompt_tokens, self.sampling = token_ids, num_prompt_tokens, sampling
        self.eos_ids, self.max_model_len = eos_ids, max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, token_ids[:num_prompt_tokens],
                                            skip_special_tokens=sampling.skip_special_tokens) if tokenizer else None
        self.defer_text = defer_text and self.detok is not None and not sampling.stop
        self.texted = 0  # output tokens detokenized (all that were committed, unless defer_text)
        self.finish_reason: str | None = None
        self.emitted_chars = 0  # text streamed so far
        self.stop_cut: int | None = None  # where a stop string cuts the text
        self.longest_stop = max(map(len, sampling.stop), default=0)
        # text before this index cannot start a stop string not found yet: each check reads only the
        # new text's end (as vLLM's), so any number of stop strings costs per token, not per length
        self.searched = 0
        # the response ended on a stop token (EOS or one of stop_token_ids) whose text is left out,
        # as vLLM leaves it out unless include_stop_str_in_output
        self.hides_last = False

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
        # the grammar refuses a token off it before the token is kept (its request fails)
        complete = self.grammar is not None and self.grammar.accept(token)
        self.token_ids.append(token)
        reason = self._token_stop(token)
        self.hides_last = reason is not None and not self.sampling.include_stop_str_in_output
        if complete and reason is None:  # the grammar's last token is text: not hidden as a stop token's
            reason = "stop"
        if self.defer_text:
            self.finish_reason = reason or self._length_stop()
            return Commit(None, self.finish_reason)
        if self.detok is not None:
            if not self.hides_last:
                self.detok.add(token)
            self.texted += 1
        reason = reason or self._string_stop() or self._length_stop()
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
            if not (final and self.hides_last and at == len(ids) - 1):  # the stop token's text is left out
                self.detok.add(token)
            self.texted += 1
        return self._take_text(final)

    def _token_stop(self, token: int) -> str | None:
        p = self.sampling
        if self.num_output_tokens >= p.min_tokens and (
                (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids):
            return "stop"
        return None

    def _string_stop(self) -> str | None:
        """A stop string in the text: the text is cut at its start (at its end with
        include_stop_str_in_output), at the earliest one when several end in the same token."""
        p = self.sampling
        if not p.stop or self.detok is None:
            return None
        text, start = self.detok.text, self.searched
        self.searched = max(start, len(text) - self.longest_stop + 1)
        if self.num_output_tokens < p.min_tokens:
            return None
        hits = [(i, s) for s in p.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return None
        i, s = min(hits, key=lambda h: h[0])
        self.stop_cut = i + len(s) if p.include_stop_str_in_output else i
        return "stop"

    def _length_stop(self) -> str | None:
        if self.num_output_tokens >= self.sampling.max_tokens or len(self.token_ids) >= self.max_model_len:
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
            end = max(self.emitted_chars, len(text) - self.longest_stop + 1)
        delta = text[self.emitted_chars:end]
        self.emitted_chars = max(self.emitted_chars, end)
        return delta
