"""The incremental detokenizer on SmolLM2's real tokenizer: the Rust decode it picks gives the
wrapper's text, and the streamed pieces add up to the whole text, a multi-byte character whole."""
from __future__ import annotations

import random

import pytest

from engines.detokenizer import IncrementalDetokenizer, fast_decode


class SlowOnly:
    """The tokenizer with only its wrapper's decode visible (fast_decode's other path)."""

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2))


class OwnDecode:
    """A wrapper with a decode of its own that forwards everything else (backend_tokenizer too)."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, **kw):
        return self.tok.decode(ids, **kw).upper()

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_fast_decode_is_the_rust_call_and_agrees_with_the_wrapper(tok):
    fast = fast_decode(tok)
    assert fast == tok.backend_tokenizer.decode and fast_decode(SlowOnly(tok)) == tok.decode
    own = OwnDecode(tok)
    assert fast_decode(own) == own.decode  # its own decode is kept, never bypassed
    rng = random.Random(0)
    for _ in range(2000):
        w = [rng.randrange(len(tok)) for _ in range(rng.randrange(0, 8))]
        assert fast(w, skip_special_tokens=True) == tok.decode(w, skip_special_tokens=True)


def test_streamed_pieces_are_the_same_on_either_path_and_add_up(tok):
    ids = tok.encode("Über 🦊 and 日本語 — def f(x): return x**2\n\t " * 8)
    rng = random.Random(1)
    for _ in range(100):
        a = rng.randrange(len(ids) - 40)
        prompt, out = ids[a:a + rng.randrange(1, 8)], ids[a + 8:a + 8 + rng.randrange(1, 30)]
        if rng.random() < 0.3:  # anything a model may sample, special tokens too
            out = [rng.randrange(len(tok)) for _ in out]
        streams = [IncrementalDetokenizer(t, prompt) for t in (tok, SlowOnly(tok))]
        pieces = [[d.add(x) for x in out] + [d.flush()] for d in streams]
        assert pieces[0] == pieces[1]
        assert all("\ufffd" not in p for p in pieces[0][:-1] if p) or "\ufffd" in tok.decode(out)
        assert "".join(pieces[0]) == streams[0].text
        context = prompt[-4:]
        whole = tok.decode(context + out, skip_special_tokens=True)
        assert whole.endswith(streams[0].text) and len(whole) - len(streams[0].text) == \
            len(tok.decode(context, skip_special_tokens=True))


@pytest.mark.parametrize("ending", ["length", "finish"])
def test_deferred_text_is_the_text_the_commit_would_have_made(tok, ending):
    """A router's output stream commits without detokenizing and makes each token's text when its
    consumer takes it (OutputStream.text_of): the pieces are the same, the last one included."""
    from engines.output import OutputStream
    from engines.sampling import SamplingParams

    rng = random.Random(2)
    ids = tok.encode("Ünïcode 🦊 and 日本語 text — def f(x): return x**2\n" * 6)
    for _ in range(40):
        prompt = ids[:rng.randrange(1, 10)]
        out = [rng.randrange(len(tok)) if rng.random() < 0.3 else rng.choice(ids) for _ in range(rng.randrange(1, 25))]
        params = SamplingParams(max_tokens=len(out) if ending == "length" else 1000, ignore_eos=True)
        now, later = (OutputStream(list(prompt), len(prompt), params, (), 4096, tok, defer_text=d) for d in (False, True))
        assert not now.defer_text and later.defer_text
        want, got = [], []
        for t in out:
            a, b = now.append(t), later.append(t)
            assert b.text is None and a.finish_reason == b.finish_reason
            want.append(a.text)
        if ending == "finish":  # ended from outside (a policy's finished PeerReq): one more, tokenless piece
            want.append(now.finish("stop"))
            assert later.finish("stop") is None
        for i, t in enumerate(out):
            got.append(later.text_of(t, final=ending == "length" and i == len(out) - 1))
        if ending == "finish":
            got.append(later.text_of(None, final=True))
        assert got == want and later.text == now.text


def test_deferred_text_is_asked_in_order(tok):
    from engines.output import OutputStream
    from engines.sampling import SamplingParams

    s = OutputStream([1, 2], 2, SamplingParams(max_tokens=10), (), 4096, tok, defer_text=True)
    s.append(100), s.append(200)
    with pytest.raises(RuntimeError, match="out of order"):
        s.text_of(200, final=False)
    assert isinstance(s.text_of(100, final=False), str)
    stops = OutputStream([1, 2], 2, SamplingParams(max_tokens=10, stop=["x"]), (), 4096, tok, defer_text=True)
    assert not stops.defer_text and isinstance(stops.append(100).text, str)  # a stop string needs the text at once
