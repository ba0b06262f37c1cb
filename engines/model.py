"""One decoder-only transformer for every family engines/config.py knows (Llama, Mistral, Qwen2/3,
their MoE forms, Gemma 2/3, Phi-3, OLMo2, Granite): the differences are config-driven pieces
(norm placement, q/k norms, activation, scales and soft-caps, per-layer windows and rope tables).

Works on flattened tokens: every activation is [T, ...] for the T tokens of a step, packed
without padding across sequences; only attention needs to know which token is whose, and
it learns that from the per-step `AttnContext` passed down (no global state).
"""
from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engines.attention import AttentionBackend, LayerAttn
from engines.config import ModelConfig, default_rope
from engines.kv_cache import KVPool
from engines.moe import SparseMoeBlock
from engines.onednn_rows import ONEDNN_LINEAR, packed_linear


class AttnContext(NamedTuple):
    backend: AttentionBackend
    meta: object  # from backend.plan for this step
    kv: KVPool
    # one [T, 1, D] table per rope of the model (Gemma 3: local and global), indexed by a layer's
    # ModelConfig.rope_index: cos for each token's position, in the model dtype, and sin with
    # rotate_half's sign folded in (see `signed_sin`)
    cos: tuple[torch.Tensor, ...]
    sin: tuple[torch.Tensor, ...]


def _onednn_ok(w: torch.Tensor) -> bool:
    if w.device.type != "cpu" or ONEDNN_LINEAR is None or not torch.backends.mkldnn.is_available():
        return False
    if w.dtype == torch.float32:
        return True
    return w.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Linear(nn.Linear):
    """`nn.Linear` that, once `pack`ed, runs on a oneDNN copy of its weight in oneDNN's blocked layout.

    `F.linear` hands MKL (fp32) or oneDNN (bf16) the row-major weight on every call; the
    pre-packed weight runs 1.2-3x faster on the skinny activations of decode (AVX-512, SmolLM2
    shapes: fp32 M=1 GEMVs reach 40-58 GB/s instead of 18, lm_head 6.3 ms -> 2.0 ms at 2 threads;
    fp32 M=32 2-3x; bf16 M=1 ~2x, M=32 ~1.2x). Numerics: same products, another summation order
    (fp32 outputs differ by ~1e-6 relative). Inference only: packing drops the dense weight
    unless something else shares it (a tied lm_head keeps the embedding).
    """

    packed: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        _init_unless_meta(self, super().reset_parameters)

    def pack(self, keep_dense: bool = False) -> bool:
        """Pack the weight for oneDNN; False (and unchanged) where oneDNN cannot run it."""
        if self.packed is not None:
            return True
        w = self.weight.detach()
        if not _onednn_ok(w):
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
            probe = torch.linspace(-1, 1, self.in_features, dtype=w.dtype)[None]  # [1, in]
            ok = torch.allclose(ONEDNN_LINEAR(probe, packed, self.bias, "none", [], ""),
                                F.linear(probe, w, self.bias), rtol=1e-2, atol=1e-2)
        except RuntimeError:
            return False
        if not ok:
            return False
        self.packed = packed
        if not keep_dense:
            self.weight = None  # the packed copy replaces it (saves the weight's memory again)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [T, in] -> [T, out]
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def _init_unless_meta(module: nn.Module, init: Callable[[], None]) -> None:
    """Random init, except on meta tensors (a model built there to be loaded): they hold no values,
    and initialising them still imports torch._dynamo, ~2.5 s of every engine's start."""
    if not module.weight.is_meta:
        init()


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        _init_unless_meta(self, super().reset_parameters)


class RMSNorm(nn.Module):
    # the C++ CPU kernels (engines/cpu_kernels.py), set by CausalLM.use_cpu_kernels; None: torch ops
    fused = None

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics as in HF. `F.rms_norm` is one call but six ATen ops on CPU (~8 us at
        # T=1); the fused kernel is one pass (~1.3 us). fp32 results match HF's formula to 1 ulp
        # (summation order); in bf16 both round once where HF rounds twice (<= 1 bf16 ulp apart).
        if self.fused is not None:
            out = torch.empty(x.shape, dtype=x.dtype)
            self.fused.rms_norm(x, self.weight, self.eps, out)
            return out
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def forward_(self, x: torch.Tensor) -> None:
        """Normalise x in place (x may be a strided view, e.g. heads inside qkv); fused kernel only."""
        self.fused.rms_norm(x, self.weight, self.eps, x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual), the residual stream's add and the next norm in
        one pass on CPU (in place: x and residual are the layer's own temporaries)."""
        if self.fused is not None and x.is_contiguous() and residual.is_contiguous():
            self.fused.add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual + x
        return self.forward(residual), residual


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] -> [-sin[..., :D/2], sin[..., D/2:]], so HF's rotate_half(x) * sin == x.roll(D/2) * signed_sin
    (rotate_half(x) = cat(-x2, x1) for x = cat(x1, x2))."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin_signed [T, 1, D] -> x * cos + rotate_half(x) * sin, in 3 ops
    (roll is one kernel where rotate_half is chunk + neg + cat). Applied to q and k together,
    with cos/sin cast once per step: 27 -> 7 us per layer at T=1 (fp32)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def rope_cache(cfg: ModelConfig, max_len: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rope of the model (ModelConfig.ropes): cos, sin [max_len, head_dim] in float32 (HF's
    non-interleaved layout, times the rope's attention factor as HF scales them)."""
    ropes = cfg.ropes or (default_rope(cfg.rope_theta, cfg.head_dim),)  # a config built in code names none
    t = torch.arange(max_len, dtype=torch.float32)
    out = []
    for r in ropes:
        freqs = torch.outer(t, torch.tensor(r.inv_freq, dtype=torch.float32))  # [max_len, D/2]
        if r.long_inv_freq is not None and max_len > r.long_from:  # longrope: long factors from there on
            freqs[r.long_from:] = torch.outer(t[r.long_from:], torch.tensor(r.long_inv_freq, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        out.append(((emb.cos() * r.attention_factor).to(device), (emb.sin() * r.attention_factor).to(device)))
    return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.h, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # per head (qwen3, gemma3)
            self.q_norm, self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps), RMSNorm(self.d, cfg.rms_norm_eps)
        self.qk_norm_proj = cfg.qk_norm_proj
        if cfg.qk_norm_proj:  # over the whole projections (olmo2)
            self.q_norm = RMSNorm(self.h * self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hkv * self.d, cfg.rms_norm_eps)
        self.rope = cfg.rope_index(layer_idx)
        self.opts = LayerAttn(cfg.window(layer_idx), cfg.attn_scale, cfg.attn_softcap)

    def forward(self, x: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        T, h, d = x.shape[0], self.h, self.d
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        if self.qk_norm_proj:
            qkv = torch.cat((self.q_norm(qkv[:, :h * d]), self.k_norm(qkv[:, h * d:(h + self.hkv) * d]),
                             qkv[:, (h + self.hkv) * d:]), dim=1)
        qk = qkv[:, :(h + self.hkv) * d].view(T, h + self.hkv, d)  # q and k heads side by side
        v = qkv[:, (h + self.hkv) * d:].view(T, self.hkv, d)
        if self.q_norm is not None and not self.qk_norm_proj:
            if self.q_norm.fused is not None:  # in place, inside qkv: no cat
                self.q_norm.forward_(qk[:, :h])
                self.k_norm.forward_(qk[:, h:])
            else:
                qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        qk = apply_rotary(qk, ctx.cos[self.rope], ctx.sin[self.rope])  # one rotary for q and k together
        q, k = qk[:, :h], qk[:, h:]  # [T, H, D], [T, Hkv, D]
        o = ctx.backend.forward(q, k, v, ctx.kv.k[self.layer_idx], ctx.kv.v[self.layer_idx], ctx.meta, self.opts)
        return self.o_proj(o.reshape(T, h * d))


ACT = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * i, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate).mul_(up))


class Norms(NamedTuple):
    """A layer's norms by role (None: that family has none there). The modules keep their
    checkpoint names; the role of a name differs by family (Llama's post_attention_layernorm is
    the one before the MLP, Gemma's and OLMo2's the one after attention)."""
    attn_in: RMSNorm | None
    attn_out: RMSNorm | None
    mlp_in: RMSNorm | None
    mlp_out: RMSNorm | None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # noqa: E731
        if cfg.norms == "pre":  # llama
            self.input_layernorm, self.post_attention_layernorm = norm(), norm()
            roles = (self.input_layernorm, None, self.post_attention_layernorm, None)
        elif cfg.norms == "sandwich":  # gemma: around attention and around the MLP
            self.input_layernorm, self.post_attention_layernorm = norm(), norm()
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
            roles = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                     self.post_feedforward_layernorm)
        else:  # "post", olmo2: each block's output is normed before it joins the residual stream
            self.post_attention_layernorm, self.post_feedforward_layernorm = norm(), norm()
            roles = (None, self.post_attention_layernorm, None, self.post_feedforward_layernorm)
        self.norms = Norms(*roles)  # a tuple, not a module: the norms are registered once, above
        self.self_attn = Attention(cfg, layer_idx)
        if cfg.is_moe(layer_idx):
            s = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoeBlock(cfg, MLP(cfg, s) if s else None)
        else:
            self.mlp = MLP(cfg)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(self, x: torch.Tensor, ctx: AttnContext,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's last block output, the residual stream before it): the add that
        finishes the layer happens in the next norm (RMSNorm.add_forward), as in vLLM. Same sums,
        same rounding as `x + attn(norm(x))` then `x + mlp(norm(x))`."""
        n = self.norms
        x, residual = _join(n.attn_in, x, residual)
        x = self.self_attn(x, ctx)
        x = self._out(n.attn_out, x)
        x, residual = _join(n.mlp_in, x, residual)
        return self._out(n.mlp_out, self.mlp(x)), residual

    def _out(self, norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
        if norm is not None:
            x = norm(x)
        return x * self.residual_multiplier if self.residual_multiplier != 1.0 else x


def _join(norm: RMSNorm | None, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The pending residual add, then the block's input norm: -> (block input, residual stream).
    `residual` None: x is the stream itself (the first layer)."""
    if residual is None:
        return (norm(x) if norm is not None else x), x
    if norm is None:  # a block that reads the stream unnormed (olmo2)
        stream = residual + x
        return stream, stream
    return norm.add_forward(x, residual)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = cfg.embed_scale  # gemma: sqrt(hidden), in the model dtype as HF rounds it
        self.final_softcap, self.logits_scaling = cfg.final_softcap, cfg.logits_scaling
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, hidden]."""
        return self.forward_stages(input_ids, [(range(len(self.layers)), ctx)])

    def forward_stages(self, input_ids: torch.Tensor, stages: list[tuple[range, AttnContext]],
                       between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """The same forward over a device group: stage i runs its layer range on its own device
        with its own context (KV, metadata, rotary tables); the hidden state moves between them.
        `between_layers` runs before every layer (see ModelRunner.layer_hook)."""
        x, residual = self.embed_tokens(input_ids), None  # [T, hidden] each
        if self.embed_scale != 1.0:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        for layers, ctx in stages:
            dev = ctx.cos[0].device  # peer copies, ordered by torch
            x = x.to(dev, non_blocking=True)
            residual = residual.to(dev, non_blocking=True) if residual is not None else None
            # a group's stage runs with its device current (Triton launches there), switched once
            # per stage; one device: the caller's (ModelRunner's) current device already is it
            with torch.cuda.device(dev) if dev.type == "cuda" and len(stages) > 1 else contextlib.nullcontext():
                for i in layers:
                    if between_layers is not None:
                        between_layers()
                    x, residual = self.layers[i](x, ctx, residual)
        return self.norm.add_forward(x, residual)[0] if residual is not None else self.norm(x)

    def place(self, devices: list[torch.device], ranges: list[range]) -> None:
        """Move each layer range to its device: the embedding with the first stage, the final norm
        and lm_head with the last. A tied lm_head gets its own copy when the ends differ."""
        self.embed_tokens.to(devices[0])
        for dev, layers in zip(devices, ranges):
            for i in layers:
                self.layers[i].to(dev)
        tied = getattr(self.lm_head, "weight", None) is self.embed_tokens.weight  # (a QuantLinear has none)
        self.norm.to(devices[-1])
        if tied and devices[-1] != devices[0]:
            self.lm_head.weight = nn.Parameter(self.embed_tokens.weight.detach().to(devices[-1]), requires_grad=False)
        else:
            self.lm_head.to(devices[-1])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, vocab] in float32."""
        logits = self.lm_head(hidden).float()
        if self.logits_scaling != 1.0:  # granite
            logits = logits / self.logits_scaling
        if self.final_softcap:  # gemma2
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def use_cpu_kernels(self, ops) -> None:
        """Run every RMSNorm (and the residual adds) in the fused CPU kernels `ops`
        (engines/cpu_kernels.load()); CPU-only models."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fused = ops

    def pack_weights(self) -> int:
        """Pre-pack every linear layer for oneDNN (CPU fp32/bf16; a no-op elsewhere). Call once,
        after loading: the model is inference-only afterwards. Returns how many were packed."""
        tied = getattr(self.lm_head, "weight", None) is self.embed_tokens.weight  # (a QuantLinear has none)
        n = 0
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                n += m.pack(keep_dense=tied and m is self.lm_head)  # the embedding still reads it
        return n
