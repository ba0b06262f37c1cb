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
from policies import ModelInfo, ReqView, StepResult
from policies.checkpoints import load_embedding, save_router
from policies.citer import CITERPolicy
from policies.colm import CoLLMPolicy
from policies.networks import CITERRouter, R2RRouter
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


def small_steps(small, n_prompts=8, n_steps=6, reserve=0):
    """StepResults as the runtime builds them: one per decoding step of the small model (the
    `reserve` output rows past the vocabulary, Co-LLM's deferral row, apart)."""
    eng = Engine.from_pretrained(small, num_kv_tokens=4096)
    eng.reserve_output_rows(reserve)
    rng = random.Random(5)
    seqs = [eng.add_request([rng.randrange(2, 512) for _ in range(rng.randrange(3, 20))],
                            SamplingParams(max_tokens=n_steps, temperature=0.0, ignore_eos=True))
            for _ in range(n_prompts)]
    steps = []
    while any(not s.is_finished for s in seqs):
        out = eng.forward(want_hidden=True)
        views = [ReqView(str(s.seq_id), 0, list(s.token_ids), s.num_prompt_tokens, t, (len(s.token_ids), 0), (), {})
                 for s, t in zip(out.seqs, out.next_tokens)]
        V = eng.vocab_size
        steps.append(StepResult(0, out.logits[:, :V], torch.tensor(out.next_tokens), out.hidden, views,
                                out.logits[:, V:] if reserve else None))
        for s, t in zip(out.seqs, out.next_tokens):
            eng.append_token(s, t)
    return steps


def decisions(policy, steps, small=None, large=None):
    """The policy's routing of `steps`, set up as a router would for the (small, large) directories."""
    policy.bind(["small", "large"])
    if small is not None:
        info = [ModelInfo(n, str(p), json.loads((p / "config.json").read_text())["vocab_size"], 64, "cpu")
                for n, p in (("small", small), ("large", large))]
        policy.setup(info)
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
    assert ckpt["init_args"]["pretrained_model_name"] == str(small.resolve())  # the small model, as R2R records it
    steps = small_steps(small)
    fresh = decisions(R2RPolicy(stats["network"], threshold=stats["threshold"]), steps)
    reloaded = decisions(R2RPolicy(str(out), small_path=str(small)), steps)
    by_name = decisions(R2RPolicy(str(out)), steps, small, large)  # no small_path: its recorded name finds it
    assert fresh == reloaded == by_name


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
    assert "citer router" in printed and "routes" in printed and "recall" in printed and "tau=" in printed
    sd = torch.load(out, weights_only=True)  # CITER's bare state dict; our figures beside it
    assert {"mlp.0.weight", "mlp.1.running_var", "mlp.4.bias", "linear.weight"} <= set(sd)
    meta = json.loads((tmp_path / "citer.pt.json").read_text())
    assert meta["verify_continuation"] == 4 and meta["hidden_size"] == 64
    pol = CITERPolicy(str(out))
    assert isinstance(pol.net, CITERRouter) and not pol.net.training
    assert pol.tau == 0.98  # the paper's setting; the trained threshold is passed on purpose
    assert CITERPolicy(str(out), tau=meta["threshold"]).tau == meta["threshold"]
    # verifying continuations only ever clears labels: fewer divergent positions than plain mismatch
    plain = train_router("citer", small, large, short, tmp_path / "c2.pt", max_tokens=16, epochs=1, progress=False)
    verified = meta["divergent_rate"]
    assert verified <= plain["divergent_rate"] and plain["divergent_rate"] > 0
    assert main(["--policy", "citer", "--small", str(small), "--large", str(large), "--prompts",
                 str(tmp_path / "missing.jsonl"), "--out", str(out), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_train_colm_and_write_a_collm_model(models, tmp_path, capsys):
    small, large, prompts = models
    short = tmp_path / "short.jsonl"
    short.write_text("".join(prompts.read_text().splitlines(keepends=True)[:24]))
    head, model_dir = tmp_path / "defer.pt", tmp_path / "collm"
    rc = main(["--policy", "colm", "--small", str(small), "--large", str(large), "--prompts", str(short),
               "--out", str(head), "--write-model", str(model_dir), "--max-tokens", "16", "--epochs", "20",
               "--batch-size", "64", "--lr", "3e-3", "--quiet"])
    assert rc == 0 and "eta=" in capsys.readouterr().out
    saved = torch.load(head, weights_only=True)
    w, eta = saved["weight"], saved["eta"]
    assert saved["bias"] == 0.0 and 0.0 < eta < 1.0
    # the model directory is the small model plus Co-LLM's row: vocabulary V + 1, the head's vector as row V
    V = json.loads((small / "config.json").read_text())["vocab_size"]
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == V + 1
    new, old = load_file(str(model_dir / "model.safetensors")), load_file(str(small / "model.safetensors"))
    assert torch.equal(new["lm_head.weight"][:V], old["lm_head.weight"]) and torch.equal(new["lm_head.weight"][V], w)
    torch.testing.assert_close(new["model.embed_tokens.weight"][V], old["model.embed_tokens.weight"].mean(0))
    # HF loads it as Co-LLM's generate.py serves it: sigmoid of the last logit is P(defer)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([[5, 77, 301]]), output_hidden_states=True)
    torch.testing.assert_close(out.logits[0, -1, -1], out.hidden_states[-1][0, -1] @ w)
    # the head file on the plain small model and the written model's own row decide alike
    with_head = decisions(CoLLMPolicy(head, eta=eta), small_steps(small))
    own_row = decisions(CoLLMPolicy(eta=eta), small_steps(model_dir, reserve=1), model_dir, large)
    assert with_head == own_row and 0 < sum(own_row) < len(own_row)


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
    with pytest.raises(ValueError, match="'r2r', 'citer' or 'colm'"):
        train_router("medusa", "s", "l", [[1, 2]], tmp_path / "x.pt")
    with pytest.raises(ValueError, match="goes with policy 'colm'"):
        train_router("r2r", "s", "l", [[1, 2]], tmp_path / "x.pt", write_model=tmp_path / "m")
