"""Incremental, UTF-8-safe detokenization: emit only text that can no longer change."""
from __future__ import annotations


class IncrementalDetokenizer:
    """Decodes a growing token list window by window (as TGI/vLLM do), holding back a piece
    that ends in U+FFFD: a multi-byte character split across tokens is emitted once whole."""

    def __init__(self, tokenizer, prompt_ids: list[int] | None = None, context: int = 4):
        self.tok = tokenizer
        self.ids: list[int] = list((prompt_ids or [])[-context:])  # context so leading spaces decode right
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token and return the newly final text (maybe empty)."""
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, even an incomplete character."""
        full = self.tok.decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
