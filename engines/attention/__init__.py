"""Attention over the paged KV pool: the backend interface (base.py), one file per backend
(torch_backend.py everywhere, cpu_backend.py on CPU, triton_backend.py and flashinfer_backend.py on
CUDA), and `select_backend` (select.py), which imports a backend only when it picks it."""
from engines.attention.base import FULL, AttentionBackend, BatchLayout, LayerAttn
from engines.attention.select import BACKENDS, has_module, select_backend

__all__ = ["AttentionBackend", "BatchLayout", "FULL", "LayerAttn", "BACKENDS", "has_module", "select_backend"]
