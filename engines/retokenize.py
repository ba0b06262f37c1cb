"""A model's own tokens of a response that models of other vocabularies write too (issue 42).

The text is the request's truth; each model keeps its own tokenization of it. When text another
model wrote arrives, this model's tokens are brought up to date without tokenizing the whole
response again: its tokens from the last word start are tokenized again together with the new
text. A token whose text begins a run of whitespace begins a word (inside a run, how it splits
depends on what follows: SmolLM2 gives the run's last space to the next word), and no merge of
either BPE the project meets reaches back across a word start: SmolLM2's byte-level BPE splits
words by a regex before merging, and Gemma 3's SentencePiece-style BPE learned its pieces within
words (one of its 262,144 tokens holds a '▁' that is not a run of them). A fixed window of tokens
is not enough: within one long word (a URL, words run together) a merge can reach further back,
and hypothesis found such a text for a window of 4. Where the text changed under its last tokens
(a word that went on), the model's tokens differ from some position on: `keep` says where, for
its KV to be cut there (`Engine.truncate`), and `tail` is what it takes from there.
"""
from __future__ import annotations

from typing import NamedTuple

from engines.detokenizer import fast_decode


class Update(NamedTuple):
    keep: int  # the model's tokens ids[:keep] stay as they are (its KV over them too)
    tail: list[int]  # its tokens from there: ids[:keep] + tail tokenizes text + new_text


class Retokenizer:
    def __init__(self, tokenizer, reach: int = 64):
        """`tokenizer`: a transformers tokenizer (its Rust backend is used when that gives the same
        text, detokenizer.fast_decode). `reach`: how many tokens back a word start is looked for;
        past it (text without spaces: code, CJK) the whole response is tokenized again."""
        if reach < 1:
            raise ValueError(f"reach must be >= 1, got {reach}")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode = (lambda t: backend.encode(t, add_special_tokens=False).ids) if backend is not None else \
            (lambda t: tokenizer.encode(t, add_special_tokens=False))
        decode = fast_decode(tokenizer)
        self._decode = lambda ids: decode(ids, skip_special_tokens=False)
        self.reach = reach

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def extend(self, ids: list[int], text: str, new_text: str) -> Update:
        """`ids`: this model's tokens of `text` (a response, without its prompt); `new_text` follows
        it -> how its tokens change. Costs a decode per token back to the last word start and one
        encode of that word with the new text, whatever the response's length (8-13 us against
        400-460 us to tokenize a 2,000-character response again, SmolLM2's and Gemma 3's
        tokenizers, AMD EPYC, 2026-12-08)."""
        start, cut = self._split_point(ids, text)
        new = self.encode(text[cut:] + new_text)
        keep = start
        while keep < len(ids) and keep - start < len(new) and ids[keep] == new[keep - start]:
            keep += 1
        return Update(keep, new[keep - start:])

    def _split_point(self, ids: list[int], text: str) -> tuple[int, int]:
        """The last word start among `ids` within `reach` -> (its token index, its index in `text`):
        a token whose text begins a run of whitespace, after which the tokens decode to the end of
        `text`, and across which decoding is the two sides' texts joined (not so mid-character, or
        where a decoder strips a leading space); (0, 0), the whole response, when there is none."""
        for a in range(len(ids) - 1, max(0, len(ids) - 1 - self.reach), -1):
            tail = self._decode(ids[a:])
            cut = len(text) - len(tail)
            # a run of whitespace starts here (inside one, how it splits depends on what follows)
            if not tail or not tail[0].isspace() or not text.endswith(tail) \
                    or (cut > 0 and text[cut - 1].isspace()):
                continue
            before = max(0, a - 2)
            if self._decode(ids[before:]) == self._decode(ids[before:a]) + tail:
                return a, cut
        return 0, 0
