"""Router networks: save/reload, the official checkpoint format, and train-router end to end on
two tiny models."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_tiny_qwen3
from engines import Engine, SamplingParams
from policies import ReqView, StepResult
from policies.citer import CITERPolicy
from policies.networks import CITERRouter, R2RRouter, load_embedding, save_router
from policies.r2r import R2RPolicy
from policies.train import _rejoined, main, pick_threshold, read_prompts, train_router


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 2-layer "large" model and a 1-layer "small" one that shares its embedding, first layer,
    final norm and LM head: the large model's second layer (outputs scaled by 0.5) perturbs the
    small model's predictions, so they agree on some tokens and differ on others, and the
    small model's top-1 margin tells the two apart (the LM head is scaled up x50 for realistic,
    peaked logits)."""
    d = tmp_path_factory.mktemp("pair")
    large = make_tiny_qwen3(d / "large", hidden=64, layers=2, seed=3)
    small = make_tiny_qwen3(d / "small", hidden=64, layers=1, seed=4)
    w = load_file(str(large / "model.safetensors"))
    w["lm_head.weight"] = w["lm_head.weight"] * 50
    for k in w:
        if "layers.1." in k and k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * 0.5
    save_file(w, str(large / "model.safetensors"), metadata={"format": "pt"})
    save_file({k: v for k, v in w.items() if "layers.1." not in k}, str(small / "model.safetensors"),
              metadata={"format": "pt"})
    rng = random.Random(1)
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [rng.randrange(2, 512) for _ in range(rng.randrange(3, 20))]})
                               + "\n" for _ in range(48)))
    return small, large, prompts


def small_steps(small, n_prompts=8, n_steps=6):
    """StepResults as the runtime builds them: one per decoding step of the small model."""
    eng = Engine.from_pretrained(small, num_kv_tokens=4096)
    rng = random.Random(5)
    seqs = [eng.add_request([rng.randrange(2, 512) for _ in range(rng.randrange(3, 20))],
                            SamplingParams(max_tokens=n_steps, temperature=0.0, ignore_eos=True))
            for _ in range(n_prompts)]
    steps = []
    while any(not s.is_finished for s in seqs):
        out = eng.forward(want_hidden=True)
        views = [ReqView(str(s.seq_id), 0, list(s.token_ids), s.num_prompt_tokens, t, (len(s.token_ids), 0), (), {})
                 for s, t in zip(out.seqs, out.next_tokens)]
        steps.append(StepResult(0, out.logits, torch.tensor(out.next_tokens), out.hidden, views))
        for s, t in zip(out.seqs, out.next_tokens):
            eng.append_token(s, t)
    return steps


def decisions(policy, steps):
    policy.bind(["small", "large"])
    return [d for st in steps for d in policy.route(st)]


@pytest.fixture(scope="module")
def trained(models, tmp_path_factory):
    small, large, prompts = models
    out = tmp_path_factory.mktemp("r2r") / "router.pt"
    stats = train_router("r2r", small, large, prompts, out, max_tokens=24, epochs=40, batch_size=64, lr=3e-4, width=32,
                         blocks=1, progress=False)
    return stats, out


def test_untrained_router_saved_and_reloaded_routes_the_same(models, tmp_path):
    small, _, _ = models
    steps = small_steps(small)
    torch.manual_seed(0)
    net = R2RRouter(load_embedding(small), 64, hidden_dims=[32, 32]).eval()
    probs = torch.cat([net.prob(s.hidden, s.tokens, s.logits) for s in steps])
    thr = float(probs.median())
    save_router(net, tmp_path / "r.pt", thr)
    ckpt = torch.load(tmp_path / "r.pt", weights_only=True)
    assert "token_embeddings.weight" not in ckpt["state_dict"]  # rebuilt from the small model
    assert ckpt["common_args"] == {"threshold": thr, "input_type": ["hidden_states", "token", "logits"]}
    a = decisions(R2RPolicy(net, threshold=thr), steps)
    b = decisions(R2RPolicy(str(tmp_path / "r.pt"), small_path=str(small)), steps)
    assert a == b and 0 < sum(a) < len(a)
    reloaded = R2RPolicy(str(tmp_path / "r.pt"), small_path=str(small)).net
    assert torch.equal(torch.cat([reloaded.prob(s.hidden, s.tokens, s.logits) for s in steps]), probs)


def test_official_format_dict_written_by_torch_save_loads(models, tmp_path):
    small, _, _ = models
    torch.manual_seed(3)
    ref = R2RRouter(load_embedding(small), 64, logits_size=100, hidden_dims=[16, 16, 16]).eval()
    sd = {k: v.clone() for k, v in ref.state_dict().items() if k != "token_embeddings.weight"}
    torch.save({"model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
                "init_args": {"hidden_states_size": 64, "logits_size": 100, "hidden_dims": [16, 16, 16],
                              "expansion_factor": 4, "dropout_rate": 0.3, "use_position_embedding": False,
                              "max_position_embeddings": 1024, "pretrained_model_name": "Qwen/Qwen3-0.6B",
                              "topk": None, "normalize_input": False, "freeze_lm_head": True},
                "common_args": {"threshold": 0.42, "input_type": ["hidden_states", "token", "logits"]},
                "model_specific_args": {"note": "written by hand"}, "state_dict": sd}, tmp_path / "official.pt")
    pol = R2RPolicy(str(tmp_path / "official.pt"), small_path=str(small))
    assert pol.threshold == 0.42  # the checkpoint's threshold is used when none is given
    steps = small_steps(small, n_prompts=4, n_steps=3)
    assert decisions(pol, steps) == decisions(R2RPolicy(ref, threshold=0.42), steps)
    assert R2RPolicy(str(tmp_path / "official.pt"), small_path=str(small), threshold=0.9).threshold == 0.9


def test_train_r2r_end_to_end(models, trained, tmp_path):
    small, large, _ = models
    stats, out = trained
    assert stats["recall"] >= 0.95  # the threshold meets the recall target on held-out prompts
    assert 0.1 < stats["divergent_rate"] < 0.9, stats
    assert stats["routed_fraction"] < 1.0 and stats["auc"] > 0.6, stats  # it learned something
    print(f"train-router end to end: {stats['seconds']:.1f}s")  # speed belongs to benchmarks, not a timed assert
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["model_type"] == "HiddenStatesTokenLMHeadLogitsClassifier"
    assert ckpt["common_args"]["threshold"] == pytest.approx(stats["threshold"])
    assert ckpt["init_args"]["hidden_dims"] == [32] and ckpt["model_specific_args"]["recall_target"] == 0.95
    steps = small_steps(small)
    fresh = decisions(R2RPolicy(stats["network"], threshold=stats["threshold"]), steps)
    reloaded = decisions(R2RPolicy(str(out), small_path=str(small)), steps)
    assert fresh == reloaded


def test_train_citer_and_verify_continuation_via_cli(models, tmp_path, capsys):
    small, large, prompts = models
    short = tmp_path / "short.jsonl"
    short.write_text("".join(prompts.read_text().splitlines(keepends=True)[:16]))
    out = tmp_path / "citer.pt"
    rc = main(["--policy", "citer", "--small", str(small), "--large", str(large), "--prompts", str(short),
               "--out", str(out), "--max-tokens", "16", "--epochs", "5", "--batch-size", "64",
               "--verify-continuation", "4", "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "citer router" in printed and "routes" in printed and "recall" in printed
    ckpt = torch.load(out, weights_only=True)
    assert ckpt["model_type"] == "CITERRouter" and ckpt["model_specific_args"]["verify_continuation"] == 4
    pol = CITERPolicy(str(out))
    assert isinstance(pol.net, CITERRouter) and not pol.net.training
    assert pol.tau == pytest.approx(ckpt["common_args"]["threshold"])
    # verifying continuations only ever clears labels: fewer divergent positions than plain mismatch
    plain = train_router("citer", small, large, short, tmp_path / "c2.pt", max_tokens=16, epochs=1, progress=False)
    verified = ckpt["model_specific_args"]["divergent_rate"]
    assert verified <= plain["divergent_rate"] and plain["divergent_rate"] > 0
    assert main(["--policy", "citer", "--small", str(small), "--large", str(large), "--prompts",
                 str(tmp_path / "missing.jsonl"), "--out", str(out), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_threshold_rule_and_helpers(tmp_path):
    import numpy as np
    score = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05])
    y = np.array([1, 1, 0, 1, 0, 0, 0, 1, 0, 0])
    t, frac, rec = pick_threshold(score, y, 0.75)  # 3 of 4 divergent caught at t = 0.6
    assert (t, frac, rec) == (0.6, 0.4, 0.75)
    t, frac, rec = pick_threshold(score, y, 1.0)
    assert (t, frac, rec) == (0.2, 0.8, 1.0)
    assert _rejoined([5, 1, 2, 3, 4], [6, 9, 2, 3, 4], window=3)
    assert _rejoined([5, 1, 2, 3, 4], [6, 2, 3, 4, 7], window=3)  # shifted by one token
    assert not _rejoined([5, 1, 2, 3, 4], [6, 7, 8, 9, 10], window=2)
    (tmp_path / "p.jsonl").write_text('{"prompt": [1, 2]}\n"text"\n{"messages": [{"role": "user", "content": "x"}]}\n')
    assert read_prompts(tmp_path / "p.jsonl") == [[1, 2], "text", [{"role": "user", "content": "x"}]]
    (tmp_path / "bad.jsonl").write_text('{"prompt": [1, 2]}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="'r2r' or 'citer'"):
        train_router("colm", "s", "l", [[1, 2]], tmp_path / "x.pt")
