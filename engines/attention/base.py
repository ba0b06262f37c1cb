"""The attention-backend interface over the paged KV pool.

The engine lays a step out as `BatchLayout` (decodes first, then extends) once; a backend turns it
into its own metadata with `plan` once per step, and `forward` is called per layer. A backend whose
`graph_safe` is True returns plan metadata that a captured CUDA graph can take by copy
(engines/cuda_graph.py). One file per backend beside this one; `select.py` picks one per device.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class BatchLayout(NamedTuple):
    num_decodes: int  # the first num_decodes sequences compute exactly one token each
    q_lens: list[int]  # tokens computed this step, per sequence
    kv_lens: list[int]  # context length after this step, per sequence
    slot_mapping: torch.Tensor  # [T] int64: pool slot for each new token's K/V
    block_tables: torch.Tensor  # [B, max_pages] int64, padded with 0
    page_size: int
    host_block_tables: list[list[int]] | None = None  # the same, unpadded, for planners on the host


class LayerAttn(NamedTuple):
    """What one layer asks of attention beyond causal softmax(q k^T / sqrt(D)) v, from its config:
    the model passes it to every `forward` (layers differ: Gemma 3 has 5 windowed to 1 global)."""
    window: int = 0  # > 0: the query at position p sees keys at positions j with p - window < j <= p,
    #                  the last `window` tokens, its own included (HF's sliding_window, exactly:
    #                  masking_utils ANDs kv_idx > q_idx - sliding_window with kv_idx <= q_idx);
    #                  0: every key j <= p
    scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    softcap: float = 0.0  # > 0: scores -> softcap * tanh(scores / softcap) before softmax (Gemma 2)


FULL = LayerAttn()


class AttentionBackend(ABC):
    graph_safe = False  # plan -> NamedTuple of fixed-shape tensors and ints, forward syncs nothing
    @abstractmethod
    def plan(self, layout: BatchLayout) -> object:
        """Per-step metadata shared by every layer."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: object, layer: LayerAttn = FULL) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], caches [num_slots, Hkv, D] -> out [T, H, D].

        Writes this step's k/v into the caches first. `layer`: this layer's window, scale, softcap."""
