"""A model's own tokens of a text that arrives in pieces (engines/retokenize.py): after every piece
they decode to the text so far and equal its tokenizer's tokens of the whole text, and `keep` is
the first position where they changed."""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings, strategies as st

from engines.retokenize import Retokenizer

PIECES = ["the", "capital", "of", "France", "is", "Paris", "aaaaaaaaaaaa", "can't", "x", "123", "4567", ".", ",",
          "-", "(", ")", '"', "http://a.b/c", " ", "  ", "\n", "\n\n", "\t", "é", "e\u0301", "日本語", "😀", "ß"]


def sentencepiece_style_tokenizer():
    """A small BPE built here as Gemma 3's is: pieces learned within words (SentencePiece's
    whitespace split), then encoding with spaces normalized to '▁', no pre-tokenizer and byte
    fallback, as Gemma 3's tokenizer.json does; so CI checks a tokenizer that splits no words
    before its merges. (Of Gemma 3's 262,144 tokens one holds a '▁' inside that is not a run of them.)"""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    corpus = [" ".join(PIECES[i:] + PIECES[:i]) for i in range(len(PIECES))] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"] + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.pre_tokenizer = None
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module", params=["smollm2", "sentencepiece-style"])
def retokenizer(request, smollm2):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2)) if request.param == "smollm2" else sentencepiece_style_tokenizer()
    return Retokenizer(tok)


texts = st.lists(st.sampled_from(PIECES), min_size=1, max_size=40).map("".join)


def check_pieces(rt: Retokenizer, text: str, cuts: list[int]) -> None:
    bounds = [0] + sorted({c % len(text) for c in cuts} - {0}) + [len(text)]
    ids: list[int] = []
    seen = ""
    for a, b in zip(bounds, bounds[1:]):
        u = rt.extend(ids, seen, text[a:b])
        seen = text[:b]
        new = ids[:u.keep] + u.tail
        assert rt.decode(new) == seen  # the model's tokens say exactly the text
        assert new == rt.encode(seen), (seen, a, b)  # and are its tokenizer's tokens of the whole of it
        same = 0
        while same < min(len(ids), len(new)) and ids[same] == new[same]:
            same += 1
        assert u.keep == same  # the KV is cut where the tokens first changed, no earlier
        ids = new


@settings(max_examples=150, deadline=None)
@given(texts, st.lists(st.integers(0, 10_000), max_size=12))
def test_tokens_follow_the_text_piece_by_piece(retokenizer, text, cuts):
    check_pieces(retokenizer, text, cuts)


def test_a_word_that_goes_on_rolls_back_only_its_own_tokens(smollm2):
    from transformers import AutoTokenizer
    rt = Retokenizer(AutoTokenizer.from_pretrained(str(smollm2)))
    text = "The capital of France is Par"  # SmolLM2: ... " is", " Par"; and " Paris" is one token
    ids = rt.encode(text)
    u = rt.extend(ids, text, "is.")
    assert ids[:u.keep] + u.tail == rt.encode(text + "is.")
    assert u.keep == len(ids) - 1 and u.tail == rt.encode(" Paris.")


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(texts, st.lists(st.integers(0, 10_000), max_size=12))
def test_gemma3_tokens_follow_the_text_piece_by_piece(text, cuts):
    check_pieces(gemma3_retokenizer(), text, cuts)


@functools.cache
def gemma3_retokenizer() -> Retokenizer:  # built once: hypothesis calls the test many times
    from transformers import AutoTokenizer

    from engines.known_models import known_model_path
    return Retokenizer(AutoTokenizer.from_pretrained(str(known_model_path("gemma3-270m"))))
