"""Greedy tokens and logits of the engine against HF transformers on the same weights."""
from __future__ import annotations

import torch
import transformers

from engines import Engine

NEW = 48


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    # eos_token_id=None: keep going past EOS like ignore_eos (min_new_tokens would mask EOS instead)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _check(path, prompts, num_kv_tokens=4096):
    eng = Engine.from_pretrained(path, num_kv_tokens=num_kv_tokens)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = eng.generate(prompts, max_tokens=NEW, temperature=0.0, ignore_eos=True)  # one batch, all prompts together
    for p, o in zip(prompts, outs):
        assert o.token_ids == _hf_greedy(hf, p)
    # logits of the first generated position, and of a decode step, to ~1e-4 relative error
    for p, o in zip(prompts, outs):
        ctx = p + o.token_ids[:5]
        with torch.no_grad():
            ref = hf(torch.tensor([ctx])).logits[0, [len(p) - 1, len(ctx) - 1]]
        seq = eng.add_request(p, _greedy(6))
        got = []
        while not seq.is_finished:
            out = eng.forward()
            for s, t, lg in zip(out.seqs, out.next_tokens, out.logits):
                got.append(lg)
                eng.append_token(s, o.token_ids[len(got) - 1] if len(got) <= 5 else t)
        got = torch.stack([got[0], got[5]])
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert rel.max().item() < 1e-4, rel
    assert eng.kv_usage().pages_free == eng.kv_usage().pages_total


def _greedy(n):
    from engines import SamplingParams
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_tiny_qwen3_matches_hf(tiny_qwen3):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 37, 120, 2)]
    _check(tiny_qwen3, prompts)


def test_tiny_qwen3_tied_embeddings(tmp_path):
    from conftest import make_tiny_qwen3
    path = make_tiny_qwen3(tmp_path / "tied", tie=True, seed=3)
    _check(path, [[5, 6, 7], list(range(10, 50))])


def test_smollm2_matches_hf(smollm2):
    tok = transformers.AutoTokenizer.from_pretrained(smollm2)
    texts = ["The capital of France is", "Write a haiku about the sea.",
             "List three prime numbers and explain why each one is prime, briefly."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    assert len({len(p) for p in prompts}) == 3
    _check(smollm2, prompts)


def test_smollm2_answers_paris(smollm2):
    eng = Engine.from_pretrained(smollm2, num_kv_tokens=2048)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = eng.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    out = eng.generate(ids, max_tokens=24, temperature=0.0)[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # it ends with <|im_end|> on its own
