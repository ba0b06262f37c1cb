"""Router networks: R2R's divergence classifier, CITER's confidence model, and a linear head on the
hidden state (Co-LLM's deferral row, a query classifier). Each carries its authors' module names,
so their saved weights load as they are (the file formats live in `policies.checkpoints`)."""
from __future__ import annotations

import bisect
import math

import torch
from torch import nn


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
def sinusoidal_table(rows: int, dim: int) -> torch.Tensor:
    """[rows, dim] sinusoidal position table (Vaswani et al.): sin on even columns, cos on odd."""
    pos = torch.arange(rows, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(rows, dim)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


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
    """R2R's backbone. With `use_position_embedding` a sinusoidal table is a buffer (so it is in the
    state dict) and row 0 is added after the input projection: R2R's code never passes position
    ids, in training or in routing, and on one row per token that is position 0. (Its own forward
    broadcasts a batch of B such rows to [B, B, W]; per row it is this.)"""

    def __init__(self, dims: list[int], expansion: int, dropout: float, use_position_embedding: bool = False,
                 max_position_embeddings: int = 1024):
        super().__init__()
        if use_position_embedding:
            self.register_buffer("position_embedding", sinusoidal_table(max_position_embeddings, dims[0]))
        self.use_position_embedding = use_position_embedding
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
        if self.use_position_embedding:
            x = x + self.position_embedding[0]
        for b in self.blocks:
            x = b(x)
        return self.output_layer(x)


class R2RRouter(nn.Module):
    """R2R's divergence classifier (`HiddenStatesTokenLMHeadLogitsClassifier`). Inputs: the small
    model's last (final-normed) hidden state [B, H], its sampled token [B] (looked up in a frozen
    copy of its input embedding) and the top-`logits_size` values of its logits. The logits are
    projected to H, the three are concatenated, projected to width W (`combined_projection`, then
    the backbone's `input_projection`, as in the official code), run through K = len(hidden_dims)
    residual blocks, and LayerNorm + Linear give one logit: sigmoid(logit) >= threshold means
    "divergent, route". Official router: hidden_dims = [1024] * 6."""

    def __init__(self, embedding: torch.Tensor, hidden_states_size: int, logits_size: int = 100,
                 hidden_dims: list[int] | None = None, expansion_factor: int = 4, dropout_rate: float = 0.1,
                 normalize_input: bool = False, use_position_embedding: bool = False,
                 max_position_embeddings: int = 1024, pretrained_model_name: str | None = None):
        super().__init__()
        dims = list(hidden_dims or [64, 64])
        V, E = embedding.shape
        H = int(hidden_states_size)
        self.init_args = {"hidden_states_size": H, "logits_size": int(logits_size), "hidden_dims": dims,
                          "expansion_factor": int(expansion_factor), "dropout_rate": float(dropout_rate),
                          "normalize_input": bool(normalize_input), "freeze_lm_head": True,
                          "use_position_embedding": bool(use_position_embedding),
                          "max_position_embeddings": int(max_position_embeddings), "topk": None}
        if pretrained_model_name is not None:  # the small model it reads, as R2R records it
            self.init_args["pretrained_model_name"] = str(pretrained_model_name)
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
        self.backbone = _Backbone(dims, int(expansion_factor), float(dropout_rate), bool(use_position_embedding),
                                  int(max_position_embeddings))

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
    """CITER's `ConfidenceModel` (aiming-lab/CITER, src/models/conf_model.py), module for module, so
    its `mlp_iter_*.pth` state dicts load as saved and ours load there. Its
    `torchvision.ops.MLP(h, [2h, h], norm_layer=BatchNorm1d, activation_layer=ReLU, dropout=0.1)` is
    `mlp` = Linear(h, 2h), BatchNorm1d(2h), ReLU, Dropout, Linear(2h, h), Dropout (no norm or
    activation after its last Linear); then `linear` = Linear(h, 1), and sigmoid gives the
    confidence that the small model's token is good enough. Use in eval mode at inference."""

    def __init__(self, hidden_size: int, dropout: float = 0.1):
        super().__init__()
        h = self.hidden_size = int(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.BatchNorm1d(2 * h), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(2 * h, h), nn.Dropout(dropout))
        self.linear = nn.Linear(h, 1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> confidence logit [B, 1]."""
        return self.linear(self.mlp(hidden_states))

    @torch.inference_mode()
    def prob(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"the CITER router was built for hidden size {self.hidden_size}; the small model "
                             f"gives hidden states of size {hidden.shape[-1]}")
        dev = self.linear.weight.device
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
