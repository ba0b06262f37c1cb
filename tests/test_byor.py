"""Bring your own router: CITER, Co-LLM and R2R routers built from their authors' published
architectures (written out here, not imported from this project), saved as the authors save them,
served through the public API. On identical models the output is the single model's greedy output,
and the large model writes exactly the tokens the original network, evaluated on the engine's own
hidden states, says it should."""
from __future__ import annotations

import argparse
import asyncio
import math
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from aiorouter import Router, RouterConfig, RouterError
from conftest import make_tiny_qwen3
from engines import Engine, SamplingParams
from policies import ModelInfo
from policies.checkpoints import save_router
from policies.citer import CITERPolicy
from policies.colm import CoLLMPolicy
from policies.ensemble import EnsemblePolicy
from policies.networks import CITERRouter
from policies.query import QueryPolicy
from policies.r2r import R2RPolicy

N_REQ, MAX_TOK = 8, 16


def prompts(n=N_REQ, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def reference(path):
    """Single-model greedy outputs and, for every output position in order, the step's final-normed
    hidden state, sampled token and logits, as the engine computes them."""
    eng = Engine.from_pretrained(path, num_kv_tokens=4096)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True)) for p in prompts()]
    hidden, tokens, logits = [], [], []
    while any(not s.is_finished for s in seqs):
        out = eng.forward(want_hidden=True)
        hidden.append(out.hidden)
        tokens.append(torch.tensor(out.next_tokens))
        logits.append(out.logits)
        for s, t in zip(out.seqs, out.next_tokens):
            eng.append_token(s, t)
    return [s.output_ids for s in seqs], torch.cat(hidden), torch.cat(tokens), torch.cat(logits)


def between(p: torch.Tensor) -> float:
    """A threshold in the widest gap of the middle half of `p`: both decisions occur, and no value
    lies within float noise of it (batching changes the last bits of a hidden state)."""
    v = p.double().flatten().sort().values
    lo, hi = len(v) // 4, 3 * len(v) // 4
    gaps = v[lo + 1:hi + 1] - v[lo:hi]
    i = int(gaps.argmax())
    assert gaps[i] > 1e-4, "no clear gap to place a threshold in"
    return float((v[lo + i] + v[lo + i + 1]) / 2)


async def routed(small, large, policy, args, names=("small", "large")):
    """-> (output token ids per request, tokens written by each model, the router's metrics)."""
    async with Router({names[0]: str(small), names[1]: str(large)}, RouterConfig(entry=names[0], policy=policy,
                      policy_args=args)) as r:
        res = await asyncio.gather(*(r.generate(p, max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True)
                                     for p in prompts()))
    return [x.token_ids for x in res], {n: sum(x.models.count(n) for x in res) for n in names}, r.metrics


@pytest.fixture(scope="module")
def ref(tiny_qwen3):
    return reference(tiny_qwen3)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = make_tiny_qwen3(tmp_path_factory.mktemp("tied"), tie=True, seed=7)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # HF saves a tied head as the embedding alone
    return path, reference(path)


# -- CITER: src/models/conf_model.py and src/pipeline/mlp_training.py ---------------------------------
class ConfidenceModel(nn.Module):
    """CITER's router. Its `torchvision.ops.MLP(h, [2h, h], norm_layer=nn.BatchNorm1d,
    activation_layer=nn.ReLU, dropout=0.1)` builds Linear(h, 2h), BatchNorm1d, ReLU, Dropout,
    Linear(2h, h), Dropout (torchvision is not installed here; these are its layers, in its order)."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.BatchNorm1d(2 * h), nn.ReLU(), nn.Dropout(0.1),
                                 nn.Linear(2 * h, h), nn.Dropout(0.1))
        self.linear = nn.Linear(h, 1)
        self.sigmoid = nn.Sigmoid()

    def forward(self, hidden_states):  # [batch, seq, h] -> confidence [batch, seq, 1]
        b, s, h = hidden_states.size()
        return self.sigmoid(self.linear(self.mlp(hidden_states.view(-1, h))).view(b, s, -1))


def citer_network(config, hidden):
    torch.manual_seed(0)
    net = ConfidenceModel(config).train()
    with torch.no_grad():  # a few training-mode passes: BatchNorm's running statistics leave their init
        for _ in range(3):
            net(hidden[torch.randperm(len(hidden))[:64]].unsqueeze(1) * 1.5 + 0.2)
    return net.eval()


async def test_citer_as_citer_saves_it(tiny_qwen3, ref, tmp_path):
    outs, hidden, _, _ = ref
    net = citer_network(AutoConfig.from_pretrained(tiny_qwen3), hidden)  # CITER sizes it from the small model
    path = tmp_path / "mlp_iter_2876.pth"
    torch.save(net.state_dict().copy(), path)  # as mlp_training.py saves its best model
    with torch.no_grad():
        conf = net(hidden.unsqueeze(1)).reshape(-1)  # token_route.py: mlp_model(last_hidden_states.unsqueeze(1))
    tau = between(conf)
    want = int((conf < tau).sum())  # token_route.py: the large model writes where confidence < threshold
    tokens, written, _ = await routed(tiny_qwen3, tiny_qwen3, "citer", {"router": str(path), "tau": tau})
    assert tokens == outs and written["large"] == want and 0 < want < len(conf)


def test_citer_checkpoint_we_write_loads_in_citer(tmp_path):
    H = 24
    torch.manual_seed(1)
    ours = CITERRouter(H)
    with torch.no_grad():
        ours.mlp[1].running_mean.normal_()
        ours.mlp[1].running_var.uniform_(0.5, 2.0)
    save_router(ours.eval(), tmp_path / "citer.pt", 0.9)
    theirs = ConfidenceModel(argparse.Namespace(hidden_size=H)).eval()
    theirs.load_state_dict(torch.load(tmp_path / "citer.pt"))  # token_route.py's load, strict
    x = torch.randn(10, H)
    torch.testing.assert_close(theirs(x.unsqueeze(1)).reshape(-1), ours.prob(x))
    with pytest.raises(ValueError, match="not a ConfidenceModel state dict"):
        CITERPolicy({"net.0.weight": torch.zeros(2, 2)})


# -- Co-LLM: collm/training/deferral_training_tools.py and collm/generate.py ---------------------------
def collm_model(base, out, gperp):
    """A Co-LLM small model as its training code leaves it: `<|defer|>` added to the tokenizer,
    then smart_tokenizer_and_embedding_resize_for_def_token: the embeddings resized by one row,
    the new input row the mean of the others, the new output row `gperp` (its initialization
    search; fine-tuning moves it further), saved with save_pretrained."""
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.resize_token_embeddings(model.config.vocab_size + 1)  # len(tokenizer) with <|defer|>
    inp, outp = model.get_input_embeddings().weight.data, model.get_output_embeddings().weight.data
    inp[-1:] = inp[:-1].mean(dim=0, keepdim=True)
    outp[-1:, :] = gperp
    model.save_pretrained(str(out))
    return model.eval()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
async def test_collm_model_served_as_is(tiny_qwen3, ref, tied, tie, tmp_path):
    base, (outs, hidden, _, _) = tied if tie else (tiny_qwen3, ref)
    torch.manual_seed(2)
    model = collm_model(base, tmp_path / "collm", torch.randn(hidden.shape[1]) * 0.3)
    with safe_open(str(tmp_path / "collm" / "model.safetensors"), "pt") as f:
        assert ("lm_head.weight" in f.keys()) != tie
    with torch.no_grad():  # generate.py: deferral_probs = sigmoid(logits[:, -1]) on the (V+1)-row head
        p = torch.sigmoid(model.lm_head(hidden)[:, -1])
    eta = between(p)
    want = int((p > eta).sum())  # generate.py: is_deferral = deferral_probs > threshold
    tokens, written, _ = await routed(tmp_path / "collm", base, "colm", {"eta": eta})
    assert tokens == outs and written["large"] == want and 0 < want < len(p)
    # the head read from the directory (a tied one has no lm_head.weight) is that row
    head = CoLLMPolicy(tmp_path / "collm").head
    torch.testing.assert_close(head.prob(hidden), p)


async def test_collm_deferral_row_is_never_sampled(tiny_qwen3, ref, tmp_path):
    outs, hidden, _, _ = ref
    V = AutoConfig.from_pretrained(tiny_qwen3).vocab_size  # the deferral row's index
    model = collm_model(tiny_qwen3, tmp_path / "collm", hidden.mean(0) * 20)  # its logit tops most tokens' logits
    eng = Engine.from_pretrained(tmp_path / "collm", num_kv_tokens=4096)
    alone = [o.token_ids for o in eng.generate(prompts(), max_tokens=MAX_TOK, temperature=0.0, ignore_eos=True)]
    assert any(V in o for o in alone)  # without the reservation the deferral row is the argmax
    eng.reserve_output_rows(1)
    assert [o.token_ids for o in eng.generate(prompts(), max_tokens=MAX_TOK, temperature=0.0,
                                              ignore_eos=True)] == outs
    with torch.no_grad():
        want = int((torch.sigmoid(model.lm_head(hidden)[:, -1]) > 0.5).sum())
    tokens, written, _ = await routed(tmp_path / "collm", tiny_qwen3, "colm", {"eta": 0.5})
    assert tokens == outs and written["large"] == want > N_REQ * MAX_TOK // 2
    # the rows must add up: a (V+1) small model needs a policy that reads its row
    with pytest.raises(ValueError, match="vocab sizes differ.*served as is with policy='colm'"):
        await Router({"small": str(tmp_path / "collm"), "large": str(tiny_qwen3)},
                     RouterConfig(policy="rstitch")).start()
    with pytest.raises(ValueError, match="one larger than the large model's.*pass head="):
        await Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy="colm")).start()


# -- R2R: r2r/models/router.py (HiddenStatesTokenLMHeadLogitsClassifier, save_model) ---------------------
def sinusoidal(n, d):  # get_sinusoidal_position_embedding
    pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
    return pe


class ClassifierBlock(nn.Module):
    def __init__(self, input_dim, output_dim, expansion_factor=4, dropout_rate=0.3):
        super().__init__()
        self.layer_norm = nn.LayerNorm(input_dim)
        self.mlp = nn.Sequential(nn.Linear(input_dim, input_dim * expansion_factor), nn.GELU(),
                                 nn.Dropout(dropout_rate), nn.Linear(input_dim * expansion_factor, output_dim),
                                 nn.Dropout(dropout_rate))
        self.dim_change = nn.Linear(input_dim, output_dim) if input_dim != output_dim else nn.Identity()

    def forward(self, x):
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class ClassifierBackbone(nn.Module):
    def __init__(self, input_dim, output_dim=1, hidden_dims=(256, 512, 256), expansion_factor=4, dropout_rate=0.3,
                 use_position_embedding=False, max_position_embeddings=1024):
        super().__init__()
        hidden_dims = list(hidden_dims)
        self.use_position_embedding = use_position_embedding
        if use_position_embedding:
            self.register_buffer("position_embedding", sinusoidal(max_position_embeddings, hidden_dims[0]))
        self.blocks = nn.ModuleList()
        self.input_projection = nn.Linear(input_dim, hidden_dims[0])
        dims = hidden_dims + [hidden_dims[-1]]
        for i in range(len(dims) - 1):
            self.blocks.append(ClassifierBlock(dims[i], dims[i + 1], expansion_factor, dropout_rate))
        self.output_layer = nn.Sequential(nn.LayerNorm(hidden_dims[-1]), nn.Linear(hidden_dims[-1], output_dim))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
                nn.init.constant_(m.bias, 0)

    def forward(self, x, position_ids=None):
        x = self.input_projection(x)
        if self.use_position_embedding:
            if position_ids is None:  # R2R's default: positions 0.. along a sequence axis, which a row lacks
                seq = x.shape[1] if x.dim() > 2 else 1
                position_ids = torch.arange(seq, device=x.device).expand((x.shape[0], -1))
            x = x + self.position_embedding[position_ids]
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class HiddenStatesTokenLMHeadLogitsClassifier(nn.Module):
    def __init__(self, **init_args):
        super().__init__()
        self._init_args = dict(init_args)  # capture_init_args: what the caller passed, no defaults
        a = {"hidden_states_size": 1536, "logits_size": 100, "hidden_dims": [256, 512, 256], "expansion_factor": 4,
             "dropout_rate": 0.3, "use_position_embedding": False, "max_position_embeddings": 1024,
             "normalize_input": False, "freeze_lm_head": False, **init_args}
        H = a["hidden_states_size"]
        emb = AutoModelForCausalLM.from_pretrained(a["pretrained_model_name"]).get_input_embeddings()
        self.token_embeddings = nn.Embedding(emb.num_embeddings, emb.embedding_dim)
        with torch.no_grad():
            self.token_embeddings.weight.copy_(emb.weight)
        if a["freeze_lm_head"]:
            self.token_embeddings.weight.requires_grad = False
        self.logits_projection = nn.Linear(a["logits_size"], H)
        self.combined_projection = nn.Linear(H + emb.embedding_dim + H, a["hidden_dims"][0])
        self.backbone = ClassifierBackbone(a["hidden_dims"][0], 1, a["hidden_dims"], a["expansion_factor"],
                                           a["dropout_rate"], a["use_position_embedding"],
                                           a["max_position_embeddings"])

    def forward(self, hidden_states, token=None, logits=None, position_ids=None):
        x = torch.cat([hidden_states, self.token_embeddings(token), self.logits_projection(logits)], dim=-1)
        return self.backbone(self.combined_projection(x), position_ids)


def r2r_checkpoint(small, path, hub_name, threshold_from, position):
    """An R2R router as its authors build and save it (save_model: the dict, token_embeddings.weight
    removed), trained for `hub_name` (built from the local copy: no hub here). -> router probabilities
    on `threshold_from` (hidden, tokens, logits), the original forward one row at a time, as R2R routes."""
    torch.manual_seed(4)
    net = HiddenStatesTokenLMHeadLogitsClassifier(
        hidden_states_size=64, logits_size=100, hidden_dims=[32, 48, 32], expansion_factor=2, dropout_rate=0.1,
        pretrained_model_name=str(small), use_position_embedding=position, max_position_embeddings=64,
        freeze_lm_head=True).eval()
    with torch.no_grad():  # LayerNorms off their init, so a misplaced one would show
        for n, p in net.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    hidden, tokens, logits = threshold_from
    with torch.no_grad():
        prob = torch.cat([torch.sigmoid(net(hidden[i:i + 1], tokens[i:i + 1],
                                            torch.topk(logits[i:i + 1], 100, dim=-1).values)).reshape(-1)
                          for i in range(len(hidden))])
    thr = between(prob)
    sd = net.state_dict()
    del sd["token_embeddings.weight"]
    init = {**net._init_args, "pretrained_model_name": hub_name}
    torch.save({"model_type": "HiddenStatesTokenLMHeadLogitsClassifier", "init_args": init,
                "common_args": {"threshold": thr, "input_type": ["hidden_states", "token", "logits"]},
                "model_specific_args": {}, "state_dict": sd}, path)
    return prob, thr, net


@pytest.fixture(scope="module")
def hub_copy(tiny_qwen3, tmp_path_factory):
    """The small model in a directory named as the hub id R2R records: .../Qwen/Qwen3-0.6B."""
    d = tmp_path_factory.mktemp("hub") / "Qwen" / "Qwen3-0.6B"
    shutil.copytree(tiny_qwen3, d)
    return d


async def test_r2r_router_found_by_its_small_models_name(hub_copy, ref, tmp_path):
    outs, hidden, tokens, logits = ref
    prob, thr, _ = r2r_checkpoint(hub_copy, tmp_path / "router.pt", "Qwen/Qwen3-0.6B", (hidden, tokens, logits), False)
    want = int((prob >= thr).sum())  # NeuralSwitching: critical_prob >= threshold
    tokens_out, written, _ = await routed(hub_copy, hub_copy, "r2r", {"router": str(tmp_path / "router.pt")})
    assert tokens_out == outs and written["large"] == want and 0 < want < len(prob)


async def test_r2r_router_with_position_embedding(tiny_qwen3, hub_copy, ref, tmp_path):
    outs, hidden, tokens, logits = ref
    prob, thr, net = r2r_checkpoint(hub_copy, tmp_path / "router.pt", "Qwen/Qwen3-0.6B", (hidden, tokens, logits), True)
    net.backbone.use_position_embedding = False  # the table matters: without it the router says otherwise
    with torch.no_grad():
        plain = torch.sigmoid(net(hidden, tokens, torch.topk(logits, 100, dim=-1).values)).reshape(-1)
    want = int((prob >= thr).sum())
    assert int((plain >= thr).sum()) != want
    args = {"router": str(tmp_path / "router.pt"), "model_dirs": {"Qwen/Qwen3-0.6B": str(hub_copy)}}
    # the served small model's path does not name it; the map does
    tokens_out, written, _ = await routed(tiny_qwen3, tiny_qwen3, "r2r", args)
    assert tokens_out == outs and written["large"] == want and 0 < want < len(prob)
    with pytest.raises(ValueError, match="'Qwen/Qwen3-0.6B'.*not named so: pass small_path=DIR or model_dirs"):
        await Router({"small": str(tiny_qwen3), "large": str(tiny_qwen3)}, RouterConfig(policy="r2r",
                      policy_args={"router": str(tmp_path / "router.pt")})).start()
    # the network follows the small model's device unless told otherwise
    pol = R2RPolicy(str(tmp_path / "router.pt"), small_path=str(hub_copy))
    pol.setup([ModelInfo("small", str(hub_copy), 512, 64, "meta"), ModelInfo("large", None, 512, 64, "cpu")])
    assert pol.net.combined_projection.weight.device.type == "meta"


def test_r2r_full_unpickle_only_on_opt_in(hub_copy, ref, tmp_path):
    _, hidden, tokens, logits = ref
    r2r_checkpoint(hub_copy, tmp_path / "router.pt", str(hub_copy), (hidden, tokens, logits), False)
    ckpt = torch.load(tmp_path / "router.pt")
    ckpt["model_specific_args"]["args"] = argparse.Namespace(lr=1e-4)  # a trainer's options, pickled as an object
    torch.save(ckpt, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="holds a argparse.Namespace.*trust_checkpoint=True"):
        R2RPolicy(str(tmp_path / "pickled.pt"))
    pol = R2RPolicy(str(tmp_path / "pickled.pt"), trust_checkpoint=True)  # the name is its path: found there
    pol.setup([ModelInfo("small", str(hub_copy), 512, 64, "cpu"), ModelInfo("large", None, 512, 64, "cpu")])
    assert pol.threshold == ckpt["common_args"]["threshold"]


# -- ME and query-level routing: the first decision -------------------------------------------------------
async def test_ensemble_draws_the_first_tokens_model(tiny_qwen3, ref):
    outs = ref[0]
    tokens, written, metrics = await routed(tiny_qwen3, tiny_qwen3, "ensemble", {"weights": [0.0, 1.0]}, ("a", "b"))
    assert tokens == outs and written == {"a": 0, "b": N_REQ * MAX_TOK}
    assert metrics.models["a"].steps == 0  # the entry model never steps: the first token's model was drawn too
    pol = EnsemblePolicy([0.5, 0.3, 0.2], seed=1)
    pol.bind(["a", "b", "c"])
    draws = [pol.admit(f"r{i}", [1], None) for i in range(3000)]
    assert draws == [pol.admit(f"r{i}", [1], None) for i in range(3000)]  # per request, reproducible
    assert [round(draws.count(k) / 3000, 1) for k in range(3)] == [0.5, 0.3, 0.2]


class WinRate:
    """A RouteLLM-style router: the strong model's predicted win rate for a prompt's text."""

    def __init__(self, rates):
        self.rates, self.seen = rates, []

    def calculate_strong_win_rate(self, prompt):
        self.seen.append(prompt)
        return self.rates[prompt]


async def test_query_scorer_decides_before_any_step(tiny_chat_model):
    texts = ["What is two plus two?", "Prove Fermat's last theorem.", "Name a colour.", "Derive Navier-Stokes."]
    rates = WinRate({t: [0.1, 0.9, 0.2, 0.7][i] for i, t in enumerate(texts)})
    eng = Engine.from_pretrained(tiny_chat_model, num_kv_tokens=4096)
    want = [o.token_ids for o in eng.generate(texts, max_tokens=8, temperature=0.0, ignore_eos=True)]
    path = str(tiny_chat_model)
    async with Router({"weak": path, "strong": path}, RouterConfig(policy="query",
                      policy_args={"scorer": rates, "thresholds": 0.5})) as r:
        res = await asyncio.gather(*(r.generate(t, max_tokens=8, temperature=0.0, ignore_eos=True) for t in texts))
        assert [x.token_ids for x in res] == want
        assert [set(x.models) for x in res] == [{"weak"}, {"strong"}, {"weak"}, {"strong"}]
        assert sum(r.metrics.handoffs.values()) == 0 and sorted(rates.seen) == sorted(texts)
        chat = [{"role": "user", "content": texts[0]}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": texts[1]}]
        steps = r.metrics.models["weak"].steps
        assert set((await r.generate(chat, max_tokens=4)).models) == {"strong"}  # the last message is scored
        assert rates.seen[-1] == texts[1] and r.metrics.models["weak"].steps == steps  # weak never stepped
    # a scorer named as "module:attribute" is imported at setup; scorers and classifiers are never per
    # request, which is decided from the arguments before the policy is built (and reads a file)
    named = QueryPolicy(0.5, scorer="builtins:len")
    assert named.scorer is None and not QueryPolicy.allows_per_request({"thresholds": 0.5, "scorer": "builtins:len"})
    assert not QueryPolicy.allows_per_request({"classifier": "/some/head.pt"})
    named.bind(["weak", "strong"])
    named.setup([])
    assert named.scorer is len and named.admit("r", [5], "abc") == 1
    assert QueryPolicy.allows_per_request({"thresholds": 0.3, "score": "entropy"})
    with pytest.raises(ValueError, match="'module:attribute'"):
        QueryPolicy(0.5, scorer="len")
    # a query the scorer refuses (ValueError) is the caller's error; a scorer that breaks fails its request only
    with pytest.raises(ValueError, match="scorer reads the query's text"):
        QueryPolicy(0.5, scorer=rates).admit("r", [5, 6], None)

    def scorer(text):
        if text.startswith("?"):
            raise ValueError("an empty question")
        if text.startswith("!"):
            raise RuntimeError("scorer crashed")
        return 1.0

    async with Router({"weak": path, "strong": path}, RouterConfig(policy="query", policy_args={"scorer": scorer})) as r:
        with pytest.raises(ValueError, match="an empty question"):
            r.submit("? what")
        assert r.num_active == 0
        with pytest.raises(RouterError, match="raised in admit: RuntimeError"):
            await r.generate("! now", max_tokens=4)
        assert set((await r.generate("fine", max_tokens=4)).models) == {"strong"} and r.num_active == 0
