"""The README's custom-policy example (docs-snippets/custom_policy.py), executed as written."""
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
    logits = torch.log(torch.tensor([[0.9, 0.05, 0.05], [0.3, 0.3, 0.4], [0.5, 0.25, 0.25]]))
    views = [ReqView(f"r{i}", 0, [1, 2, 3, 4], 2, 8, (4, 3), (0, 0), {}) for i in range(3)]
    assert pol.route(StepResult(0, logits, torch.tensor([0, 2, 0]), None, views)) == [STAY, 1, STAY]
    assert pol.route(StepResult(1, logits, torch.tensor([0, 2, 0]), None, views)) == [1, 1, 1]
    up = pol.send(views[0]._replace(peer=1))
    back = pol.send(views[0]._replace(model=1, seen=(3, 4), peer=0))
    assert (up.tokens, up.loc) == ([4], 4) and (back.tokens, back.loc) == ([4, 8], 4)


async def test_snippet_main_runs_on_tiny_models(snippet, tiny_qwen3, capsys):
    ref, top1 = greedy_with_top1(tiny_qwen3)
    # as written: a random tiny model is never 50% sure, so the large model writes every token
    res = await snippet["main"](str(tiny_qwen3), str(tiny_qwen3), prompt=PROMPT)
    assert res.token_ids == ref and res.usage["per_model"] == {"small": 0, "large": len(ref)}
    assert str({"small": 0, "large": len(ref)}) in capsys.readouterr().out
    # with the threshold at the median top-1 probability both models write, and the identical
    # pair still reproduces the single model's greedy output
    pol = snippet["LowConfidence"]()
    pol.threshold = float(torch.tensor(top1).median())
    res = await snippet["main"](str(tiny_qwen3), str(tiny_qwen3), prompt=PROMPT, policy=pol)
    assert res.token_ids == ref
    assert res.usage["per_model"]["small"] > 5 and res.usage["per_model"]["large"] > 5, res.usage


def test_readme_shows_the_tested_snippet_verbatim():
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    snippet = (root / "docs-snippets" / "custom_policy.py").read_text()
    assert snippet in (root / "README.md").read_text()
    assert len(snippet.strip().splitlines()) < 30
