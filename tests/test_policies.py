"""Routing policies: route/send on hand-made inputs, identical-model equivalence through the
runtime, and bad input."""
from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from aiorouter import Router, RouterConfig
from engines import Engine, SamplingParams
from policies import BUILTIN, STAY, ReqView, StepResult, make_policy
from policies.citer import CITERPolicy
from policies.colm import CoLLMPolicy
from policies.ensemble import EnsemblePolicy
from policies.checkpoints import load_embedding, save_router
from policies.networks import CITERRouter, R2RRouter
from policies.query import QueryPolicy
from policies.r2r import R2RPolicy
from policies.rstitch import normalized_entropy

N_REQ = 16
MAX_TOK = 24


# -- helpers -------------------------------------------------------------------------------------
def view(rid="r", tokens=(1, 2, 3, 4, 5), n_prompt=3, sampled=9, seen=(5, 3), trace=(0, 0), state=None, model=0,
         peer=None):
    return ReqView(rid, model, list(tokens), n_prompt, sampled, tuple(seen), tuple(trace),
                   {} if state is None else state, peer)


def rin(model, logits, hidden=None, reqs=None, tokens=None):
    B = logits.shape[0]
    reqs = reqs or [view(rid=f"r{i}", model=model) for i in range(B)]
    tokens = tokens if tokens is not None else logits.argmax(-1)
    return StepResult(model, logits.float(), tokens, hidden, reqs)


def bound(policy, n=2):
    policy.bind([f"m{i}" for i in range(n)])
    return policy


def prompts(n=N_REQ, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


async def run_all(router, ps):
    return await asyncio.gather(*(router.generate(p, max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True)
                                  for p in ps))


def tokens_by_model(res):
    return {m: sum(r.models.count(m) for r in res) for m in {m for r in res for m in r.models}}


@pytest.fixture(scope="module")
def ref(tiny_qwen3):
    """Prompts, single-model greedy outputs, and the per-step (logits, token, hidden) the engine
    produces on them (to place thresholds so that random-init routers route some tokens)."""
    ps = prompts()
    eng = Engine.from_pretrained(tiny_qwen3, num_kv_tokens=8192)
    ids = [o.token_ids for o in eng.generate(ps, max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True)]
    seqs = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in ps]
    L, T, Hs, first = [], [], [], {}
    while any(not s.is_finished for s in seqs):
        out = eng.forward(want_hidden=True)
        L.append(out.logits)
        T.append(torch.tensor(out.next_tokens))
        Hs.append(out.hidden)
        for s, lg in zip(out.seqs, out.logits):
            if s.num_output_tokens == 0:
                first[s.seq_id] = lg
        assert not any(isinstance(c, Exception) for c in eng.commit(list(zip(out.seqs, out.next_tokens))))
    first_logits = torch.stack([first[s.seq_id] for s in seqs])
    return ps, ids, (torch.cat(L), torch.cat(T), torch.cat(Hs)), first_logits


async def check_equivalence(path, ref, policy, args, names=("small", "large")):
    ps, ids, _, _ = ref
    async with Router({n: str(path) for n in names}, RouterConfig(entry=names[0], policy=policy, policy_args=args)) as r:
        res = await run_all(r, ps)
        assert [x.token_ids for x in res] == ids
        return res, r.metrics.handoffs


# -- unit: route and send on hand-made inputs -------------------------------------------------------
def test_random_coins_follow_the_request_or_the_prompt():
    from policies import RandomPolicy

    def coins(pol, rid, tokens, n_prompt):
        # 64 steps of one request; its generator is seeded on the first from what `key` names
        reqs = [view(rid=rid, tokens=tokens, n_prompt=n_prompt, state={})]
        return [pol.defer(StepResult(0, torch.zeros(1, 4), torch.zeros(1), None, reqs))[0] for _ in range(64)]

    by_prompt = bound(RandomPolicy(0.5, seed=3, key="prompt"))
    a = coins(by_prompt, "r1", [5, 6, 7, 8], 3)
    assert a == coins(by_prompt, "r2", [5, 6, 7, 9, 9], 3)  # same prompt, other request and output: same coins
    assert a != coins(by_prompt, "r1", [5, 6, 8, 8], 3)  # another prompt
    assert a != coins(bound(RandomPolicy(0.5, seed=4, key="prompt")), "r1", [5, 6, 7, 8], 3)  # another seed
    by_request = bound(RandomPolicy(0.5, seed=3))
    assert coins(by_request, "r1", [5, 6, 7, 8], 3) != coins(by_request, "r2", [5, 6, 7, 8], 3)
    assert coins(by_request, "r1", [5, 6, 7, 8], 3) == coins(by_request, "r1", [1, 2], 1)
    with pytest.raises(ValueError, match="key must be 'request' or 'prompt', got 'rid'"):
        RandomPolicy(0.5, key="rid")


def test_r2r_route_and_send():
    torch.manual_seed(0)
    V, H = 150, 16
    net = R2RRouter(torch.randn(V, H), H, logits_size=100, hidden_dims=[8, 8]).eval()
    logits, hidden = torch.randn(6, V) * 3, torch.randn(6, H)
    tokens = logits.argmax(-1)
    p = net.prob(hidden, tokens, logits)
    thr = float(p.sort().values[2:4].mean())  # three rows above, three below
    pol = bound(R2RPolicy(net, threshold=thr))
    dest = pol.route(rin(0, logits, hidden, tokens=tokens))
    assert dest == [1 if x >= thr else STAY for x in p.tolist()] and dest.count(1) == 3
    assert pol.route(rin(1, logits, hidden, tokens=tokens)) == [1] * 6  # large: one token, then back
    # the router reads the sampled token: a different token changes its input
    assert not torch.equal(net.prob(hidden, (tokens + 1) % V, logits), p)
    up = pol.send(view(tokens=[1, 2, 3, 4, 5], seen=(5, 3), sampled=9, model=0, peer=1))
    assert (up.tokens, up.loc) == ([4, 5], 5)  # the small model's token 9 is discarded; loc: its position
    back = pol.send(view(tokens=[1, 2, 3, 4, 5], seen=(3, 5), sampled=7, model=1, peer=0))
    assert (back.tokens, back.loc) == ([4, 5, 7], 5)  # the large model's token is committed
    P, C = pol.routing_template()
    assert np.allclose(P, [[0.9, 0.1], [1, 0]]) and np.allclose(C, [[1, 0], [1, 0]])


def test_r2r_network_matches_official_layout():
    """A state dict written with the official module names loads, and computes what the official
    forward computes (written out here with plain functional ops)."""
    torch.manual_seed(1)
    V, H, W, k = 64, 8, 12, 20
    emb = torch.randn(V, H)
    net = R2RRouter(emb, H, logits_size=k, hidden_dims=[W, W]).eval()
    sd = {n: torch.randn_like(t) * 0.3 for n, t in net.state_dict().items() if n != "token_embeddings.weight"}
    expect_keys = {"logits_projection.weight", "combined_projection.weight", "backbone.input_projection.weight",
                   "backbone.blocks.1.layer_norm.weight", "backbone.blocks.0.mlp.0.weight",
                   "backbone.blocks.0.mlp.3.bias", "backbone.output_layer.0.weight", "backbone.output_layer.1.bias"}
    assert expect_keys <= set(sd)
    ckpt = {"model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
            "init_args": {"hidden_states_size": H, "logits_size": k, "hidden_dims": [W, W], "expansion_factor": 4,
                          "dropout_rate": 0.3, "pretrained_model_name": "x", "use_position_embedding": False,
                          "normalize_input": False, "freeze_lm_head": True},
            "common_args": {"threshold": 0.3, "input_type": ["hidden_states", "token", "logits"]},
            "model_specific_args": {}, "state_dict": sd}
    from policies.checkpoints import load_router
    loaded, meta = load_router(ckpt, embedding=emb)
    h, tok, logits = torch.randn(5, H), torch.randint(0, V, (5,)), torch.randn(5, V)
    F = torch.nn.functional
    top = torch.topk(logits, k).values
    x = torch.cat([h, emb[tok], F.linear(top, sd["logits_projection.weight"], sd["logits_projection.bias"])], -1)
    x = F.linear(x, sd["combined_projection.weight"], sd["combined_projection.bias"])
    x = F.linear(x, sd["backbone.input_projection.weight"], sd["backbone.input_projection.bias"])
    for i in range(2):
        b = f"backbone.blocks.{i}."
        y = F.layer_norm(x, (W,), sd[b + "layer_norm.weight"], sd[b + "layer_norm.bias"])
        y = F.linear(F.gelu(F.linear(y, sd[b + "mlp.0.weight"], sd[b + "mlp.0.bias"])), sd[b + "mlp.3.weight"],
                     sd[b + "mlp.3.bias"])
        x = x + y
    x = F.layer_norm(x, (W,), sd["backbone.output_layer.0.weight"], sd["backbone.output_layer.0.bias"])
    want = torch.sigmoid(F.linear(x, sd["backbone.output_layer.1.weight"], sd["backbone.output_layer.1.bias"]))
    assert torch.allclose(loaded.prob(h, tok, logits), want.squeeze(-1), atol=1e-5)
    assert meta["common_args"]["threshold"] == 0.3


def test_citer_route_and_send():
    torch.manual_seed(2)
    H = 16
    net = CITERRouter(H).eval()
    hidden = torch.randn(8, H) * 2
    conf = net.prob(hidden)
    tau = float(conf.sort().values[3:5].mean())
    pol = bound(CITERPolicy(net, tau=tau))
    dest = pol.route(rin(0, torch.randn(8, 32), hidden))
    assert dest == [1 if c < tau else STAY for c in conf.tolist()] and dest.count(1) == 4
    assert pol.route(rin(1, torch.randn(8, 32), hidden)) == [1] * 8
    assert pol.send(view(seen=(5, 2), sampled=9, model=0, peer=1)).tokens == [3, 4, 5]
    assert pol.send(view(seen=(4, 5), sampled=9, model=1, peer=0)).tokens == [5, 9]
    assert CITERPolicy(net).tau == 0.98  # the paper's setting when nothing else is given
    net.train()  # eval mode at inference: a policy puts its network in eval mode
    assert not CITERPolicy(net).net.training


def test_colm_route_send_and_head_forms(tmp_path):
    H, V = 8, 40
    w = torch.zeros(H)
    w[0] = 1.0
    hidden = torch.zeros(4, H)
    hidden[:, 0] = torch.tensor([3.0, -3.0, -1.0, 0.0])  # P(defer) = 0.95, 0.047, 0.27, 0.5
    logits = torch.randn(4, V)
    want = [1, STAY, 1, 1]
    lm_head = torch.randn(V + 1, H)
    lm_head[-1] = w
    torch.save({"weight": w, "bias": 0.0}, tmp_path / "head.pt")
    save_file({"lm_head.weight": lm_head}, str(tmp_path / "lm_head.safetensors"))
    torch.save({"lm_head.weight": lm_head}, tmp_path / "lm_head.pt")
    for head in (tmp_path / "head.pt", tmp_path / "lm_head.safetensors", tmp_path / "lm_head.pt", w, {"weight": w}):
        pol = bound(CoLLMPolicy(head, eta=0.15))
        assert pol.route(rin(0, logits, hidden)) == want, head
        assert pol.route(rin(1, logits, hidden)) == [1] * 4
    # eta is compared strictly: P(defer) = 0.5 is not > 0.5
    assert bound(CoLLMPolicy(w, eta=0.5)).route(rin(0, logits, hidden)) == [1, STAY, STAY, STAY]
    assert pol.send(view(seen=(5, 5), sampled=9, model=0, peer=1)).tokens == []
    assert pol.send(view(seen=(4, 5), sampled=9, model=1, peer=0)).tokens == [5, 9]
    # the (V+1)-row form checks the vocabulary it implies
    with pytest.raises(ValueError, match=f"vocabulary {V} \\+ 1.*vocabulary is 30"):
        bound(CoLLMPolicy(tmp_path / "lm_head.pt")).route(rin(0, torch.randn(4, 30), hidden))
    with pytest.raises(ValueError, match="hidden states of size 6"):
        bound(CoLLMPolicy(w)).route(rin(0, logits, torch.zeros(4, 6)))


def test_ensemble_route_send_and_draws():
    pol = bound(EnsemblePolicy([0.0, 0.0, 1.0]), 3)
    logits = torch.randn(3, 10)
    assert pol.route(rin(0, logits)) == [2, 2, 2]  # model 0's 2nd peer is model 2
    assert pol.route(rin(2, logits)) == [STAY] * 3
    pol = bound(EnsemblePolicy([1.0, 0.0, 0.0]), 3)
    assert pol.route(rin(1, logits)) == [1, 1, 1]  # model 1's first peer is model 0
    # the drawing model's token is committed; the peer extends over everything it missed
    pr = pol.send(view(tokens=[1, 2, 3, 4, 5, 6], seen=(3, 6, 0), sampled=9, model=1, peer=0))
    assert (pr.tokens, pr.loc) == ([4, 5, 6, 9], 6)
    pr = pol.send(view(tokens=[1, 2, 3, 4, 5, 6], seen=(3, 6, 0), sampled=9, model=1, peer=2))
    assert (pr.tokens, pr.loc) == ([1, 2, 3, 4, 5, 6, 9], 6)
    # draws follow the weights, and are reproducible per (seed, request)
    w = [0.5, 0.3, 0.2]
    a, b = bound(EnsemblePolicy(w, seed=3), 3), bound(EnsemblePolicy(w, seed=3), 3)
    ra, rb = view(rid="same"), view(rid="same")  # one request each: its state keeps the generator
    da = [a.route(rin(0, logits[:1], reqs=[ra]))[0] for _ in range(4000)]  # from model 0, k = model k
    db = [b.route(rin(0, logits[:1], reqs=[rb]))[0] for _ in range(4000)]
    assert da == db
    freq = np.bincount(da, minlength=3) / len(da)
    assert np.allclose(freq, w, atol=0.03), freq
    P, C = a.routing_template()
    assert np.allclose(P, [w] * 3) and np.allclose(C, 1)


def test_query_route_and_send():
    V = 64
    flat = torch.zeros(V)  # entropy 1
    peaked = torch.full((V,), -20.0)
    peaked[5] = 20.0  # entropy ~ 0
    mid = torch.full((V,), -20.0)
    mid[:8] = 0.0  # entropy log(8)/log(64) = 0.5
    logits = torch.stack([flat, peaked, mid])
    reqs = [view(rid=f"q{i}", tokens=[1, 2, 3], n_prompt=3, seen=(3, 0, 0)) for i in range(3)]
    pol = bound(QueryPolicy([0.3, 0.7]), 3)
    assert pol.admit("q", [1, 2, 3], "text") is None  # no text scorer: the entry model scores at its first step
    assert pol.route(rin(0, logits, reqs=reqs)) == [2, STAY, 1]  # flat -> model 2, peaked stays, mid -> model 1
    at = float(normalized_entropy(mid[None])[0])  # a score equal to a threshold reaches it (RouteLLM's >=)
    assert bound(QueryPolicy([0.3, at]), 3).route(rin(0, logits[[2]], reqs=[reqs[2]])) == [2]
    # once it has moved (another model has seen it) or written a token, it stays, whatever the logits say
    assert pol.route(rin(2, logits[[1]], reqs=[reqs[0]._replace(model=2, seen=(3, 0, 3))])) == [STAY]
    assert pol.route(rin(1, logits[[0]], reqs=[reqs[2]._replace(model=1, seen=(4, 4, 0), token_ids=[1, 2, 3, 8])])) \
        == [STAY]
    assert pol.route(rin(0, logits[[0]], reqs=[reqs[1]._replace(seen=(4, 0, 0), token_ids=[1, 2, 3, 8])])) == [STAY]
    pr = pol.send(reqs[0]._replace(peer=2))  # the entry model's prefill is not wasted: its token goes along
    assert (pr.tokens, pr.loc) == ([1, 2, 3, 9], 3)
    drop = bound(QueryPolicy([0.3, 0.7], keep_first_token=False), 3)
    pr = drop.send(reqs[0]._replace(peer=2))  # or it is discarded: the chosen model writes every token
    assert (pr.tokens, pr.loc) == ([1, 2, 3], 3)
    assert drop.routing_template()[1][0, 1] == 0 and pol.routing_template()[1][0, 1] == 1
    # margin score and a classifier on the hidden state
    two = bound(QueryPolicy(0.5, score="margin"))
    fresh = [view(rid=f"m{i}", tokens=[1, 2], n_prompt=2, seen=(2, 0)) for i in range(3)]
    assert two.route(rin(0, logits, reqs=fresh)) == [1, STAY, 1]
    w = torch.zeros(4)
    w[1] = 1.0
    clf = bound(QueryPolicy(0.5, classifier={"weight": w, "bias": 0.0}))
    assert clf.needs_hidden
    hidden = torch.tensor([[0.0, 2.0, 0, 0], [0.0, -2.0, 0, 0]])
    fresh = [view(rid=f"c{i}", tokens=[1, 2], n_prompt=2, seen=(2, 0)) for i in range(2)]
    assert clf.route(rin(0, logits[:2], hidden, reqs=fresh)) == [1, STAY]
    P, C = pol.routing_template()
    assert np.allclose(P.sum(1), 1) and P[1, 1] > 0.99 and P[0, 2] > 0


def test_every_policy_declares_a_valid_template(tmp_path):
    H = 8
    net = R2RRouter(torch.randn(20, H), H, logits_size=10, hidden_dims=[4])
    pols = {"r2r": R2RPolicy(net, threshold=0.5), "citer": CITERPolicy(CITERRouter(H)),
            "colm": CoLLMPolicy(torch.zeros(H)), "ensemble": EnsemblePolicy([0.5, 0.5]), "query": QueryPolicy(0.5)}
    for name, pol in pols.items():
        assert name in BUILTIN and type(pol) is BUILTIN[name]
        P, C = bound(pol).routing_template()
        assert P.shape == C.shape == (2, 2) and np.allclose(P.sum(1), 1) and (P >= 0).all(), name
    assert np.allclose(pols["citer"].routing_template()[0], [[0.9, 0.1], [1, 0]])


# -- runtime: identical models reproduce the single-model output ------------------------------------
def _median(x: torch.Tensor) -> float:
    return float(x.float().median())


async def test_r2r_identical_models_equal_single(tiny_qwen3, ref, tmp_path):
    logits, tokens, hidden = ref[2]
    torch.manual_seed(0)
    net = R2RRouter(load_embedding(tiny_qwen3), hidden.shape[1], hidden_dims=[32, 32]).eval()
    thr = _median(net.prob(hidden, tokens, logits))
    save_router(net, tmp_path / "r2r.pt", thr)
    res, h = await check_equivalence(tiny_qwen3, ref, "r2r", {"router": str(tmp_path / "r2r.pt"),
                                                               "small_path": str(tiny_qwen3)})
    counts = tokens_by_model(res)
    assert counts.get("small", 0) > 20 and counts.get("large", 0) > 20, counts
    ends_on_large = sum(r.models[-1] == "large" for r in res)  # the final token needs no hand-back
    assert h[("small", "large")] == counts["large"] == h[("large", "small")] + ends_on_large  # one token a visit


async def test_citer_identical_models_equal_single(tiny_qwen3, ref, tmp_path):
    _, _, hidden = ref[2]
    torch.manual_seed(1)
    net = CITERRouter(hidden.shape[1]).eval()
    tau = _median(net.prob(hidden))
    save_router(net, tmp_path / "citer.pt", tau)
    res, h = await check_equivalence(tiny_qwen3, ref, "citer", {"router": str(tmp_path / "citer.pt"), "tau": tau})
    counts = tokens_by_model(res)
    assert counts.get("small", 0) > 20 and counts.get("large", 0) > 20, counts
    assert h[("small", "large")] == counts["large"]


async def test_colm_identical_models_equal_single(tiny_qwen3, ref, tmp_path):
    _, _, hidden = ref[2]
    torch.manual_seed(2)
    w = torch.randn(hidden.shape[1])
    eta = _median(torch.sigmoid(hidden @ w))
    torch.save({"weight": w, "bias": 0.0}, tmp_path / "defer.pt")
    res, h = await check_equivalence(tiny_qwen3, ref, "colm", {"head": str(tmp_path / "defer.pt"), "eta": eta})
    counts = tokens_by_model(res)
    assert counts.get("small", 0) > 20 and counts.get("large", 0) > 20, counts


async def test_ensemble_three_models_equal_single(tiny_qwen3, ref, monkeypatch):
    # the policy seeds each request's draws by its id: fixed ids make the shares reproducible
    # (with random ids a run lands outside the bound below about once in a few hundred)
    import itertools
    import uuid
    counter = itertools.count()
    monkeypatch.setattr("aiorouter.requests.uuid.uuid4", lambda: uuid.UUID(int=next(counter)))
    res, h = await check_equivalence(tiny_qwen3, ref, "ensemble", {"weights": [0.5, 0.3, 0.2], "seed": 4},
                                     names=("a", "b", "c"))
    counts = tokens_by_model(res)
    total = N_REQ * MAX_TOK
    assert set(counts) == {"a", "b", "c"}
    # every token is committed by the model that drew it: shares follow the weights
    assert abs(counts["a"] / total - 0.5) < 0.08 and abs(counts["c"] / total - 0.2) < 0.08, counts
    assert all(h[(x, y)] > 0 for x in "abc" for y in "abc" if x != y)


async def test_query_identical_models_equal_single(tiny_qwen3, ref):
    ps, ids, _, first_logits = ref
    scores = normalized_entropy(first_logits)
    thr = float(scores.sort().values[N_REQ // 2 - 1:N_REQ // 2 + 1].mean())  # between the middle two
    res, h = await check_equivalence(tiny_qwen3, ref, "query", {"thresholds": thr})
    for r, s in zip(res, scores.tolist()):  # the entry model's first token, then the chosen model
        assert r.models[0] == "small" and set(r.models[1:]) == ({"large"} if s > thr else {"small"})
    assert 0 < sum(r.models[1] == "large" for r in res) < N_REQ
    assert h[("large", "small")] == 0 and h[("small", "large")] == sum(s > thr for s in scores.tolist())


# -- bad input ----------------------------------------------------------------------------------------
def pair(path, **kw):
    return Router({"small": str(path), "large": str(path)}, RouterConfig(entry="small", **kw))


async def test_bad_input_names_the_problem(tiny_qwen3, tmp_path):
    torch.manual_seed(0)
    other = R2RRouter(torch.randn(512, 32), 32, hidden_dims=[8])  # a router for a 32-wide small model
    save_router(other, tmp_path / "r32.pt", 0.5)
    with pytest.raises(ValueError, match="hidden size 32"):
        pair(tiny_qwen3, policy="r2r", policy_args={"router": str(tmp_path / "r32.pt"), "small_path": str(tiny_qwen3)})
    with pytest.raises(ValueError, match="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B.*small_path"):
        await pair(tiny_qwen3, policy="r2r", policy_args={"router": str(tmp_path / "r32.pt")}).start()
    torch.save({"weights": torch.zeros(3)}, tmp_path / "junk.pt")
    with pytest.raises(ValueError, match="not in the R2R format"):
        pair(tiny_qwen3, policy="r2r", policy_args={"router": str(tmp_path / "junk.pt"), "small_path": str(tiny_qwen3)})
    with pytest.raises(ValueError, match="must sum to 1.*sum 0.9"):
        pair(tiny_qwen3, policy="ensemble", policy_args={"weights": [0.5, 0.4]})
    with pytest.raises(ValueError, match="3 weights.*router has 2 models"):
        pair(tiny_qwen3, policy="ensemble", policy_args={"weights": [0.5, 0.3, 0.2]})
    with pytest.raises(ValueError, match="picks among 3 models, but the router has 2"):
        pair(tiny_qwen3, policy="query", policy_args={"thresholds": [0.3, 0.6]})
    with pytest.raises(ValueError, match="routes between 2 models, the router has 3"):
        Router({"a": str(tiny_qwen3), "b": str(tiny_qwen3), "c": str(tiny_qwen3)}, RouterConfig(policy="colm",
               policy_args={"head": {"weight": torch.zeros(64)}}))
    with pytest.raises(ValueError, match="has no argument 'treshold'"):
        pair(tiny_qwen3, policy="citer", policy_args={"router": "x.pt", "treshold": 0.5})
    with pytest.raises(ValueError, match="unknown score 'perplexity'"):
        make_policy("query", {"score": "perplexity"})
    # a CITER router for another hidden size is caught at start, from the small model's config
    save_router(CITERRouter(32), tmp_path / "c32.pt", 0.5)
    with pytest.raises(ValueError, match="hidden size 32; the small model 'small' has hidden_size 64"):
        await pair(tiny_qwen3, policy="citer", policy_args={"router": str(tmp_path / "c32.pt")}).start()
    # given per request, it is refused at submit, and the router serves on
    async with pair(tiny_qwen3, policy="ensemble", policy_args={"weights": [0.5, 0.5]}) as r:
        with pytest.raises(ValueError, match="hidden size 32"):
            await r.generate([5, 6, 7], max_tokens=4, policy=CITERPolicy(CITERRouter(32)))
        assert len((await r.generate([5, 6, 7], max_tokens=4, ignore_eos=True)).token_ids) == 4
        assert r.num_active == 0
