"""The README's custom-policy example (docs-snippets/custom_policy.py): its policy, and its main() on
tiny models (tests/test_readme.py runs the file as written on the default pair)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import Engine, SamplingParams
from policies import STAY, ReqView, StepResult

SNIPPET = Path(__file__).resolve().parent.parent / "docs-snippets" / "custom_policy.py"
PROMPT = [7, 42, 99, 3, 250, 18]


@pytest.fixture(scope="module")
def snippet():
    text = SNIPPET.read_text()
    assert len(text.splitlines()) < 30  # it is pasted into the README
    ns = {"__name__": "readme_snippet"}
    exec(compile(text, str(SNIPPET), "exec"), ns)
    return ns


def greedy_with_top1(path):
    """The single-model greedy output for PROMPT (32 tokens or up to EOS) and its top-1 probabilities."""
    eng = Engine.from_pretrained(path, num_kv_tokens=2048)
    seq = eng.add_request(PROMPT, SamplingParams(max_tokens=32, temperature=0.0))
    top1 = []
    while not seq.is_finished:
        out = eng.forward()
        top1.append(float(out.logits.softmax(-1).max()))
        eng.append_token(seq, out.next_tokens[0])
    return seq.output_ids, top1


def test_snippet_policy_routes_on_top1(snippet):
    pol = snippet["LowConfidence"]()
    pol.bind(["small", "large"])
    thr = pol.threshold
    top1 = [(1 + thr) / 2, thr / 2, thr - 0.01]  # above it (stays), well below, just below (both hand off)
    logits = torch.log(torch.tensor([[p, (1 - p) / 2, (1 - p) / 2] for p in top1]))
    views = [ReqView(f"r{i}", 0, [1, 2, 3, 4], 2, 8, (4, 3), (0, 0), {}) for i in range(3)]
    assert pol.route(StepResult(0, logits, torch.tensor([0, 2, 0]), None, views)) == [STAY, 1, 1]
    assert pol.route(StepResult(1, logits, torch.tensor([0, 2, 0]), None, views)) == [1, 1, 1]
    up = pol.send(views[0]._replace(peer=1))
    back = pol.send(views[0]._replace(model=1, seen=(3, 4), peer=0))
    assert (up.tokens, up.loc) == ([4], 4) and (back.tokens, back.loc) == ([4, 8], 4)


async def test_snippet_main_runs_on_tiny_models(snippet, tiny_qwen3, capsys):
    ref, top1 = greedy_with_top1(tiny_qwen3)
    pair = {"small": str(tiny_qwen3), "large": str(tiny_qwen3)}
    # as written: a random tiny model is never 90% sure, so the large model writes every token
    assert max(top1) < snippet["LowConfidence"].threshold
    res = await snippet["main"](pair, prompt=PROMPT)
    assert res.token_ids == ref and res.usage["per_model"] == {"small": 0, "large": len(ref)}
    assert str({"small": 0, "large": len(ref)}) in capsys.readouterr().out
    # with the threshold at the median top-1 probability both models write, and the identical
    # pair still reproduces the single model's greedy output
    pol = snippet["LowConfidence"]()
    pol.threshold = float(torch.tensor(top1).median())
    res = await snippet["main"](pair, prompt=PROMPT, policy=pol)
    assert res.token_ids == ref
    assert res.usage["per_model"]["small"] > 5 and res.usage["per_model"]["large"] > 5, res.usage

