"""Router networks (R2R, CITER, a linear head for Co-LLM and query routing) and their checkpoints.

Checkpoint format (R2R's official one, so published R2R routers drop in): a `torch.save`d dict
    {"model_type": str, "init_args": dict, "common_args": {"threshold": float, "input_type": [...]},
     "model_specific_args": dict, "state_dict": dict}
An R2R checkpoint leaves out `token_embeddings.weight` (a frozen copy of the small model's input
embedding); `load_router` rebuilds it from the matrix that `load_embedding(small_model_dir)` reads.
CITER checkpoints use the same dict with `model_type="CITERRouter"`.
"""
from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

R2R_MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"  # the official class name
CITER_MODEL_TYPE = "CITERRouter"
_EMBED_KEYS = ("model.embed_tokens.weight", "embed_tokens.weight", "model.embed_tokens")


# -- CUDA graphs of a router network's forward ------------------------------------------------
class GraphedForward:
    """A network's forward replayed from CUDA graphs captured at bucketed batch sizes: R2R and CITER
    run every decoding step, and at their size kernel launches dominate. Inputs are padded with
    zero rows to the bucket and the output is sliced back; in eval mode every layer (Linear,
    LayerNorm, BatchNorm with running stats, an embedding lookup) is row-wise, so the real rows
    are unchanged. Eager past the last bucket. On CPU nothing is captured: the same padded,
    static buffers run eagerly (tests/test_policies.py checks that path; real capture: gpu tests)."""

    BUCKETS = (1, 2, 4, 8, 16, 32, 64)

    def __init__(self, net: nn.Module, examples: list[torch.Tensor], buckets: tuple[int, ...] = BUCKETS):
        """examples: one tensor per forward input, any batch size: their row shapes and dtypes."""
        self.net, self.buckets = net, buckets
        dev = examples[0].device
        self.static: dict[int, tuple[list[torch.Tensor], object]] = {}
        pool = None
        for b in sorted(buckets, reverse=True):  # largest first: the rest reuse its memory pool
            ins = [torch.zeros((b, *x.shape[1:]), dtype=x.dtype, device=dev) for x in examples]
            if dev.type != "cuda":
                self.static[b] = (ins, None)
                continue
            with torch.cuda.device(dev):  # the worker thread's current device may be another
                s = torch.cuda.Stream(dev)
                s.wait_stream(torch.cuda.current_stream(dev))
                with torch.inference_mode(), torch.cuda.stream(s):
                    net(*ins)  # warm-up (cuBLAS handles, lazy inits) off the capture
                torch.cuda.current_stream(dev).wait_stream(s)
                g = torch.cuda.CUDAGraph()
                # thread_local: captured lazily in a model's worker while other workers keep launching
                with torch.inference_mode(), torch.cuda.graph(g, pool=pool, stream=s, capture_error_mode="thread_local"):
                    out = net(*ins)
            pool = g.pool()
            self.static[b] = (ins, (g, out))

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        n = xs[0].shape[0]
        i = bisect.bisect_left(self.buckets, n)
        if i == len(self.buckets):
            return self.net(*xs)
        ins, graph = self.static[self.buckets[i]]
        for buf, x in zip(ins, xs):
            buf[:n].copy_(x)
            buf[n:].zero_()
        if graph is None:
            return self.net(*ins)[:n]
        graph[0].replay()
        return graph[1][:n]


def run_graphed(net: nn.Module, *ins: torch.Tensor) -> torch.Tensor:
    """net(*ins), from CUDA graphs when on CUDA in eval mode (captured on first use, at the buckets)."""
    graphs = getattr(net, "_graphs", None)
    if graphs is None and ins[0].is_cuda and not net.training:
        graphs = net._graphs = GraphedForward(net, list(ins))
    return graphs(*ins) if graphs is not None else net(*ins)


# -- R2R ---------------------------------------------------------------------------------------
class _Block(nn.Module):
    """Pre-LayerNorm residual MLP block (GELU, `expansion`x wide, dropout); names as in R2R."""

    def __init__(self, d_in: int, d_out: int, expansion: int, dropout: float):
        super().__init__()
        self.layer_norm = nn.LayerNorm(d_in)
        self.mlp = nn.Sequential(nn.Linear(d_in, d_in * expansion), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(d_in * expansion, d_out), nn.Dropout(dropout))
        self.dim_change = nn.Linear(d_in, d_out) if d_in != d_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class _Backbone(nn.Module):
    def __init__(self, dims: list[int], expansion: int, dropout: float):
        super().__init__()
        self.input_projection = nn.Linear(dims[0], dims[0])
        ends = list(dims) + [dims[-1]]
        self.blocks = nn.ModuleList(_Block(ends[i], ends[i + 1], expansion, dropout) for i in range(len(dims)))
        self.output_layer = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], 1))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_projection(x)
        for b in self.blocks:
            x = b(x)
        return self.output_layer(x)


class R2RRouter(nn.Module):
    """R2R's divergence classifier. Inputs: the small model's last (final-normed) hidden state
    [B, H], its sampled token [B] (looked up in a frozen copy of its input embedding) and the
    top-`logits_size` values of its logits. The logits are projected to H, the three are
    concatenated, projected to width W (`combined_projection`, then the backbone's
    `input_projection`, as in the official code), run through K = len(hidden_dims) residual blocks,
    and LayerNorm + Linear give one logit: sigmoid(logit) >= threshold means "divergent, route".
    Official router: hidden_dims = [1024] * 6."""

    def __init__(self, embedding: torch.Tensor, hidden_states_size: int, logits_size: int = 100,
                 hidden_dims: list[int] | None = None, expansion_factor: int = 4, dropout_rate: float = 0.1,
                 normalize_input: bool = False):
        super().__init__()
        dims = list(hidden_dims or [64, 64])
        V, E = embedding.shape
        H = int(hidden_states_size)
        self.init_args = {"hidden_states_size": H, "logits_size": int(logits_size), "hidden_dims": dims,
                          "expansion_factor": int(expansion_factor), "dropout_rate": float(dropout_rate),
                          "normalize_input": bool(normalize_input), "freeze_lm_head": True,
                          "use_position_embedding": False, "max_position_embeddings": 1024, "topk": None}
        self.hidden_size, self.logits_size, self.normalize_input = H, int(logits_size), bool(normalize_input)
        if normalize_input:
            self.layer_norm_hidden_states = nn.LayerNorm(H)
            self.layer_norm_token = nn.LayerNorm(E)
        self.token_embeddings = nn.Embedding(V, E)
        with torch.no_grad():
            self.token_embeddings.weight.copy_(embedding)
        self.token_embeddings.weight.requires_grad_(False)
        self.logits_projection = nn.Linear(self.logits_size, H)
        self.combined_projection = nn.Linear(2 * H + E, dims[0])
        self.backbone = _Backbone(dims, int(expansion_factor), float(dropout_rate))

    @staticmethod
    def top_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
        return torch.topk(logits.float(), k, dim=-1).values  # sorted, largest first

    def forward(self, hidden_states: torch.Tensor, token: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """hidden [B, H], token [B], logits: top-k values [B, logits_size] -> router logit [B, 1]."""
        tok = self.token_embeddings(token)
        if self.normalize_input:
            hidden_states, tok = self.layer_norm_hidden_states(hidden_states), self.layer_norm_token(tok)
            logits = torch.softmax(logits, dim=-1)
        x = torch.cat([hidden_states, tok, self.logits_projection(logits)], dim=-1)
        return self.backbone(self.combined_projection(x))

    @torch.inference_mode()
    def prob(self, hidden: torch.Tensor, token: torch.Tensor, full_logits: torch.Tensor) -> torch.Tensor:
        """Routing probability [B] from one decoding step's raw outputs."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"the R2R router was built for hidden size {self.hidden_size}; the small model "
                             f"gives hidden states of size {hidden.shape[-1]}")
        if full_logits.shape[-1] < self.logits_size:
            raise ValueError(f"the R2R router reads the top {self.logits_size} logits; the vocabulary has "
                             f"only {full_logits.shape[-1]}")
        dev = self.combined_projection.weight.device
        ins = (hidden.float().to(dev), token.long().to(dev), self.top_logits(full_logits, self.logits_size).to(dev))
        return torch.sigmoid(run_graphed(self, *ins).squeeze(-1)).cpu()


# -- CITER -------------------------------------------------------------------------------------
class CITERRouter(nn.Module):
    """CITER's router: h -> 2h -> h MLP (BatchNorm, ReLU, dropout 0.1), Linear(h, 1), sigmoid =
    confidence that the small model's token is good enough. Use in eval mode at inference."""

    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        h = int(hidden_size)
        self.init_args = {"hidden_size": h, "dropout": float(dropout)}
        self.hidden_size = h
        self.net = nn.Sequential(nn.Linear(h, 2 * h), nn.BatchNorm1d(2 * h), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(2 * h, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(h, 1))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.net(hidden_states)

    @torch.inference_mode()
    def prob(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"the CITER router was built for hidden size {self.hidden_size}; the small model "
                             f"gives hidden states of size {hidden.shape[-1]}")
        dev = self.net[0].weight.device
        return torch.sigmoid(run_graphed(self, hidden.float().to(dev)).squeeze(-1)).cpu()


# -- a linear head on the hidden state (Co-LLM's deferral row; a query classifier) -------------
class LinearHead(nn.Module):
    """sigmoid(w . h + b). `vocab`: when the row came from a (V+1)-row lm_head, V (checked later)."""

    def __init__(self, weight: torch.Tensor, bias: float = 0.0, vocab: int | None = None, source: str = ""):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().reshape(-1), requires_grad=False)
        self.bias = float(bias)
        self.vocab, self.source = vocab, source

    @torch.inference_mode()
    def prob(self, hidden: torch.Tensor, vocab: int | None = None) -> torch.Tensor:
        if hidden.shape[-1] != self.weight.numel():
            raise ValueError(f"the head {self.source or ''} has {self.weight.numel()} weights; the model gives "
                             f"hidden states of size {hidden.shape[-1]}")
        if vocab is not None and self.vocab is not None and vocab != self.vocab:
            raise ValueError(f"the deferral row comes from a lm_head with {self.vocab + 1} rows (vocabulary "
                             f"{self.vocab} + 1); the model's vocabulary is {vocab}")
        return torch.sigmoid(hidden.float() @ self.weight + self.bias)


def _read_tensors(path: Path) -> dict[str, Any]:
    if path.is_dir():
        out: dict[str, Any] = {}
        for f in sorted(path.glob("*.safetensors")):
            out.update(_read_tensors(f))
        if not out:
            raise ValueError(f"{path} holds no *.safetensors files")
        return out
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    return obj if isinstance(obj, dict) else {"tensor": obj}


def load_linear_head(src: str | Path | dict | torch.Tensor) -> LinearHead:
    """A linear head in one of these forms:
    - a dict (or a `torch.save`d file of one) {"weight": [H] or [1, H], "bias": float (optional)};
    - an (H,) tensor;
    - a (V+1, H) lm_head matrix (a tensor, or `lm_head.weight` in a .pt/.safetensors file or a model
      directory of safetensors): its last row is the head, and V is checked against the model."""
    name = str(src) if isinstance(src, (str, Path)) else type(src).__name__
    obj: Any = _read_tensors(Path(src)) if isinstance(src, (str, Path)) else src
    if isinstance(obj, torch.Tensor):
        obj = {"tensor": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"head {name}: expected a dict or a tensor, got {type(obj).__name__}")
    if "weight" in obj:
        w = torch.as_tensor(obj["weight"])
        if w.dim() == 2 and w.shape[0] != 1:
            raise ValueError(f"head {name}: 'weight' must have shape [H] or [1, H], got {tuple(w.shape)}")
        return LinearHead(w, float(torch.as_tensor(obj.get("bias", 0.0)).reshape(-1)[0]), source=name)
    mat = obj.get("lm_head.weight", obj.get("tensor"))
    if mat is None:
        mats = [v for v in obj.values() if isinstance(v, torch.Tensor) and v.dim() == 2]
        mat = mats[0] if len(mats) == 1 else None
    if not isinstance(mat, torch.Tensor) or mat.dim() not in (1, 2):
        raise ValueError(f"head {name}: found neither 'weight' nor an 'lm_head.weight' matrix "
                         f"(keys: {', '.join(list(obj)[:8])})")
    if mat.dim() == 1:
        return LinearHead(mat, source=name)
    bias = obj.get("lm_head.bias")
    return LinearHead(mat[-1], float(bias[-1]) if bias is not None else 0.0, vocab=mat.shape[0] - 1, source=name)


# -- checkpoints -------------------------------------------------------------------------------
def load_embedding(model_dir: str | Path) -> torch.Tensor:
    """The input-embedding matrix [V, H] of an HF safetensors model directory (read lazily)."""
    from safetensors import safe_open
    d = Path(model_dir)
    files = sorted(d.glob("*.safetensors")) if d.is_dir() else [d]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {str(d)!r} to read the small model's embedding from")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in _EMBED_KEYS:
                if key in st.keys():
                    return st.get_tensor(key).float()
    raise ValueError(f"{d}: no {_EMBED_KEYS[0]!r} in its safetensors files")


def save_router(model: nn.Module, path: str | Path, threshold: float | None,
                **model_specific_args: Any) -> dict:
    """Write `model` in the official format (R2R: without token_embeddings.weight)."""
    if isinstance(model, R2RRouter):
        mtype, inputs = R2R_MODEL_TYPE, ["hidden_states", "token", "logits"]
    elif isinstance(model, CITERRouter):
        mtype, inputs = CITER_MODEL_TYPE, ["hidden_states"]
    else:
        raise TypeError(f"cannot save a {type(model).__name__} as a router")
    sd = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k != "token_embeddings.weight"}
    ckpt = {"model_type": mtype, "init_args": dict(model.init_args),
            "common_args": {"threshold": None if threshold is None else float(threshold), "input_type": inputs},
            "model_specific_args": json.loads(json.dumps(model_specific_args, default=str)), "state_dict": sd}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, str(path))
    return ckpt


def load_router(src: str | Path | dict, embedding: torch.Tensor | None = None,
                device: str | torch.device = "cpu") -> tuple[nn.Module, dict]:
    """-> (network in eval mode, {"model_type", "init_args", "common_args", "model_specific_args"})."""
    name = str(src) if isinstance(src, (str, Path)) else "dict"
    if isinstance(src, (str, Path)):
        if not Path(src).is_file():
            raise FileNotFoundError(f"router checkpoint {name!r} does not exist")
        src = torch.load(str(src), map_location="cpu", weights_only=True)
    if not isinstance(src, dict) or "model_type" not in src or "state_dict" not in src:
        raise ValueError(f"router checkpoint {name} is not in the R2R format: a dict with 'model_type', "
                         "'init_args', 'common_args' and 'state_dict'")
    mtype, init = src["model_type"], dict(src.get("init_args") or {})
    sd = dict(src["state_dict"])
    meta = {"model_type": mtype, "init_args": init, "common_args": dict(src.get("common_args") or {}),
            "model_specific_args": dict(src.get("model_specific_args") or {})}
    if mtype == R2R_MODEL_TYPE:
        if init.get("use_position_embedding"):
            raise ValueError(f"router checkpoint {name}: use_position_embedding=True is not supported")
        H = int(init.get("hidden_states_size", 1536))
        if "token_embeddings.weight" in sd:
            embedding = sd["token_embeddings.weight"]
        if embedding is None:
            raise ValueError(f"router checkpoint {name} has no token_embeddings.weight: give the small model's "
                             "path (small_path=...) so its embedding can be loaded")
        cp = sd.get("combined_projection.weight")
        if cp is None:
            raise ValueError(f"router checkpoint {name} lacks combined_projection.weight")
        want_e = cp.shape[1] - 2 * H
        if embedding.shape[1] != want_e or want_e != H:
            raise ValueError(f"router checkpoint {name} is for hidden size {H}, but the small model's embedding "
                             f"has width {embedding.shape[1]} (a router trained for a different small model?)")
        net: nn.Module = R2RRouter(embedding, H, logits_size=int(init.get("logits_size") or 100),
                                   hidden_dims=list(init.get("hidden_dims") or [256, 512, 256]),
                                   expansion_factor=int(init.get("expansion_factor", 4)),
                                   dropout_rate=float(init.get("dropout_rate", 0.3)),
                                   normalize_input=bool(init.get("normalize_input", False)))
        sd["token_embeddings.weight"] = net.token_embeddings.weight.detach().clone()
    elif mtype == CITER_MODEL_TYPE:
        net = CITERRouter(int(init["hidden_size"]), float(init.get("dropout", 0.1)))
    else:
        raise ValueError(f"router checkpoint {name}: unsupported model_type {mtype!r}; supported: "
                         f"{R2R_MODEL_TYPE}, {CITER_MODEL_TYPE}")
    try:
        net.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"router checkpoint {name}: weights do not match its init_args: {e}") from None
    return net.to(device).eval(), meta
