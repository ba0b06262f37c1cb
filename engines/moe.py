"""Sparse Mixture-of-Experts MLP of Qwen3-MoE and Qwen2-MoE, on flattened tokens x [T, hidden].

Routing as in transformers 5: softmax of the router logits in float32, top-k, optionally
renormalised (norm_topk_prob), cast back to the activations' dtype. Each expert is a SiLU-gated
MLP; Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
Expert weights are stacked, in transformers' fused runtime layout and names
(`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]);
`hf_param_slice` maps checkpoint names (per-expert or fused) onto them.
"""
from __future__ import annotations

import re
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class MoeSizes(Protocol):
    """What the block and the name mapping read (engines.config.ModelConfig has them)."""
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int


class DenseGate(nn.Module):
    """y = x W^T, deliberately not an `nn.Linear`: quantize_model must leave routing weights dense
    (an int4 router flips top-k choices, and its kernels refuse N = 60 or 1 outputs)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # [T, in] -> [T, out]


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))  # [E, H, I]
        # after quantize(): one module per expert and projection, and the stacked tensors gone
        self.quantized: nn.ModuleList | None = None
        self.num_experts = num_experts
        if not self.down_proj.is_meta:  # meta: built to be loaded, nothing to fill
            nn.init.normal_(self.gate_up_proj, std=0.02)
            nn.init.normal_(self.down_proj, std=0.02)

    def quantize(self, make: Callable[[torch.Tensor], nn.Module]) -> int:
        """Replace the stacked weights by make(w) per expert and projection (engines.quant's
        QuantLinear: w [out, in] -> a module x [T, in] -> [T, out]); returns how many were made.
        The quantized kernels take one weight each, so steps run the per-expert loop."""
        self.quantized = nn.ModuleList(nn.ModuleList([make(gu), make(d)])
                                       for gu, d in zip(self.gate_up_proj.data, self.down_proj.data))
        del self.gate_up_proj, self.down_proj
        return 2 * len(self.quantized)

    def grouped_ok(self, x: torch.Tensor) -> bool:
        """F.grouped_mm needs stacked weights and 16-byte aligned row strides on both operands."""
        if self.quantized is not None:
            return False
        elt = x.element_size()
        h, i = self.down_proj.shape[1:]
        return hasattr(F, "grouped_mm") and (h * elt) % 16 == 0 and (i * elt) % 16 == 0

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gated MLP: x [t, H] -> [t, H]."""
        if self.quantized is not None:
            gate_up, down = self.quantized[e]
            gate, up = gate_up(x).chunk(2, dim=-1)
            return down(F.silu(gate).mul_(up))
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)  # [t, I] each
        return F.linear(F.silu(gate).mul_(up), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, grouped: bool) -> torch.Tensor:
        """x [T, H], routing weights [T, k] (x's dtype) and expert ids [T, k] -> [T, H]."""
        k = ids.shape[1]
        sorted_ids, order = ids.reshape(-1).sort(stable=True)  # the T*k (token, expert) pairs, by expert
        rows = order // k  # [Tk] token of each pair
        xs = x[rows]  # [Tk, H]
        # end of each expert's run of pairs; unlike bincount, no device -> host sync on CUDA
        ends = torch.searchsorted(sorted_ids, torch.arange(self.num_experts, device=x.device), right=True)
        if grouped:  # one kernel per projection, sync-free (CUDA-graph capturable)
            offs = ends.to(torch.int32)
            gate, up = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)  # [Tk, I] each
            ys = F.grouped_mm(F.silu(gate).mul_(up).contiguous(), self.down_proj.transpose(1, 2), offs=offs)  # [Tk, H]
        else:  # one GEMM pair per expert hit; the bounds come to the host once
            ys = torch.empty_like(xs)
            start = 0
            for e, end in enumerate(ends.tolist()):
                if end > start:
                    ys[start:end] = self._expert(e, xs[start:end])
                start = end
        ys.mul_(weights.reshape(-1)[order, None])
        return torch.zeros_like(x).index_add_(0, rows, ys)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse layer: x [T, hidden] -> [T, hidden]. Parameter names under it match
    transformers' runtime ones: gate.weight, experts.{gate_up_proj,down_proj},
    shared_expert.{gate_up_proj,down_proj}.weight (gate/up merged), shared_expert_gate.weight."""

    def __init__(self, cfg: MoeSizes, shared_expert: nn.Module | None = None):
        """`shared_expert`: Qwen2-MoE's always-on expert, engines.model's MLP of its own size (the
        model builds it, so it is packed and quantized like every MLP), gated per token."""
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = DenseGate(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_expert = shared_expert
        self.shared_expert_gate = DenseGate(cfg.hidden_size, 1) if shared_expert is not None else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k] in x's dtype, expert ids [T, k] (int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        top, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def forward(self, x: torch.Tensor, grouped: bool | None = None) -> torch.Tensor:
        """grouped: F.grouped_mm over tokens sorted by expert (True) or a loop over experts
        (False); None: grouped off the CPU where the shapes allow it."""
        if grouped is None:
            grouped = x.device.type != "cpu" and self.experts.grouped_ok(x)
        out = self.experts(x, *self.route(x), grouped)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


_PER_EXPERT = re.compile(r"(?P<pre>(?:.*\.)?mlp\.)experts\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj)\.weight")
_SHARED = re.compile(r"(?P<pre>(?:.*\.)?mlp\.)shared_expert\.(?P<w>gate_proj|up_proj|down_proj)\.weight")
_AS_IS = re.compile(r"(?:.*\.)?mlp\.(?:experts\.(?:gate_up_proj|down_proj)|gate\.weight|shared_expert_gate\.weight)")


def hf_param_slice(hf_name: str, cfg: MoeSizes) -> tuple[str, tuple[int | slice, ...]] | None:
    """Where checkpoint tensor `hf_name` goes in a SparseMoeBlock: (our parameter name, index), or
    None for a name that is not a sparse block's (attention, norms, a dense layer's mlp.gate_proj).

    Whatever precedes `mlp.` is kept, so pass the name with or without the "model." prefix and look
    the result up in the same naming. The loader does, for each tensor t of a sparse layer:
        name, index = hit; dst = params[name].data[index]  # a view, shaped like t
        dst.copy_(t)  # after checking t.shape == dst.shape
    index () is the whole parameter. Names understood (transformers 5.25):
    - per expert, as save_pretrained writes them: mlp.experts.{e}.{gate,up,down}_proj.weight
      ([I, H], [I, H], [H, I]) -> experts.gate_up_proj[e, :I] / [e, I:], experts.down_proj[e]
    - fused, as in transformers' state_dict: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj
    - mlp.gate.weight [E, H]; qwen2_moe's mlp.shared_expert.{gate,up,down}_proj.weight (gate/up into
      shared_expert.gate_up_proj.weight, as the dense MLP) and mlp.shared_expert_gate.weight [1, H].
    The indices of one parameter never overlap: summing dst.numel() per parameter tells a loader
    whether it was covered in full.
    """
    if m := _PER_EXPERT.fullmatch(hf_name):
        e, w, i = int(m["e"]), m["w"], cfg.moe_intermediate_size
        if w == "down_proj":
            return f"{m['pre']}experts.down_proj", (e,)
        return f"{m['pre']}experts.gate_up_proj", (e, slice(0, i) if w == "gate_proj" else slice(i, 2 * i))
    if m := _SHARED.fullmatch(hf_name):
        w, s = m["w"], cfg.shared_expert_intermediate_size
        if w == "down_proj":
            return f"{m['pre']}shared_expert.down_proj.weight", ()
        return f"{m['pre']}shared_expert.gate_up_proj.weight", (slice(0, s) if w == "gate_proj" else slice(s, 2 * s),)
    if _AS_IS.fullmatch(hf_name):
        return hf_name, ()
    return None
