"""CUDA graphs for small steps: decodes at bucketed batch sizes, and small mixed steps (a handoff
return is an extend of a few tokens) at bucketed (sequences, tokens), each padded to its bucket.
Anything outside the captured range runs eagerly.

The decisions (which bucket, padding a step to it, copying its metadata into the captured
buffers) are plain functions tested on CPU (tests/test_gpu_graphs.py). `StepGraphs` captures and
replays on CUDA; it has not run on a GPU yet (bench/gpu_check.py checks parity there).
"""
from __future__ import annotations

import bisect
import functools
from typing import Callable, NamedTuple

import torch

from engines.attention import AttentionBackend, BatchLayout

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
EXTEND_SEQ_BUCKETS = (1, 2, 4, 8, 16)
EXTEND_TOKEN_BUCKETS = (8, 16, 32, 64)  # beyond: a prefill, big enough that launches do not matter


class GraphKey(NamedTuple):
    num_seqs: int  # padded batch rows
    num_tokens: int  # padded tokens
    decode: bool  # all rows one-token decodes (the decode kernel) or all rows extends


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """Smallest bucket >= n, None when n is past the last one."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def graph_key(layout: BatchLayout, decode_buckets: tuple[int, ...] = DECODE_BUCKETS,
              seq_buckets: tuple[int, ...] = EXTEND_SEQ_BUCKETS,
              token_buckets: tuple[int, ...] = EXTEND_TOKEN_BUCKETS) -> GraphKey | None:
    """The graph a step replays, or None to run it eagerly. An all-decode step takes a decode
    graph; a step with any extend runs every row (decodes too, as q_len 1) as an extend."""
    B, T = len(layout.q_lens), sum(layout.q_lens)
    if layout.num_decodes == B:
        b = bucket(B, decode_buckets)
        return GraphKey(b, b, True) if b is not None else None
    b, t = bucket(B, seq_buckets), bucket(T, token_buckets)
    if b is None or t is None:
        return None
    return GraphKey(b, t, False)


def pad_step(layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor, key: GraphKey,
             max_pages: int) -> tuple[BatchLayout, torch.Tensor, torch.Tensor]:
    """Pad a step to its graph's shapes. Extra rows have q_len 1 (decode graphs) or 0 and kv_len 0;
    extra tokens have slot -1 (written nowhere), token id 0 and position 0; block tables are
    `max_pages` wide (zeros past a row's pages). Real rows and tokens keep their places, so the
    first T outputs are the step's."""
    B, T = len(layout.q_lens), input_ids.shape[0]
    nb, nt = key.num_seqs - B, key.num_tokens - T
    assert nb >= 0 and nt >= 0 and layout.block_tables.shape[1] <= max_pages, (key, B, T)
    bt = layout.block_tables
    bt = torch.nn.functional.pad(bt, (0, max_pages - bt.shape[1], 0, nb))  # [Bb, max_pages]
    pad_t = (0, nt)
    slots = torch.nn.functional.pad(layout.slot_mapping, pad_t, value=-1)
    q_lens = layout.q_lens + [1 if key.decode else 0] * nb
    padded = BatchLayout(key.num_seqs if key.decode else 0, q_lens, layout.kv_lens + [0] * nb, slots, bt,
                         layout.page_size)
    return padded, torch.nn.functional.pad(input_ids, pad_t), torch.nn.functional.pad(positions, pad_t)


def copy_meta(static: tuple, new: tuple) -> None:
    """Copy one step's plan into the buffers a graph captured. Ints and shapes must match: they
    are baked into the graph (a mismatch is a bucketing bug, not a step to run)."""
    for name, a, b in zip(type(static)._fields, static, new):
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape:
                raise ValueError(f"graph buffer {name}: captured {tuple(a.shape)}, step has {tuple(b.shape)}")
            a.copy_(b, non_blocking=True)
        elif a != b:
            raise ValueError(f"graph field {name}: captured {a!r}, step has {b!r}")


# (ids [T], positions [T], meta, backend) -> hidden [T, H]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, object, AttentionBackend], torch.Tensor]


class _Graph(NamedTuple):
    replay: Callable[[], torch.Tensor]  # -> hidden [Tb, hidden], the captured output buffer on CUDA
    input_ids: torch.Tensor  # [Tb]
    positions: torch.Tensor  # [Tb]
    meta: tuple  # the backend's plan, captured by address


class StepGraphs:
    """Captured forwards for a model's small steps. `forward(ids, positions, meta, backend)` is the
    model's eager forward; `backend` must be graph_safe. Every graph is captured on `stream`, the
    owning runner's own stream (engines/streams.py): a pooled capture stream could be another
    model's runner stream, and graphs captured on one stream share its cuBLAS workspace, so two
    models replaying at once would race on it. On a CPU device nothing is captured (`stream` is
    None there): a "graph" re-runs the forward on the same static buffers, which tests everything
    around the capture (buckets, padding, metadata copies) without CUDA."""

    def __init__(self, forward: ForwardFn, backend: AttentionBackend, page_size: int, max_pages: int,
                 device: torch.device, stream: "torch.cuda.Stream | None",
                 decode_buckets: tuple[int, ...] = DECODE_BUCKETS, seq_buckets: tuple[int, ...] = EXTEND_SEQ_BUCKETS,
                 token_buckets: tuple[int, ...] = EXTEND_TOKEN_BUCKETS):
        if not backend.graph_safe:
            raise ValueError(f"{type(backend).__name__} cannot be captured in a CUDA graph")
        self.device = torch.device(device)
        if self.device.type == "cuda" and stream is None:
            raise ValueError("CUDA graphs need the owning runner's stream to capture on")
        self.forward, self.backend, self.page_size, self.max_pages = forward, backend, page_size, max_pages
        self.stream = stream
        self.buckets = (decode_buckets, seq_buckets, token_buckets)
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = None  # one memory pool for every graph: they never run at once
        self.num_replays = 0

    def keys(self) -> list[GraphKey]:
        dec, seqs, toks = self.buckets
        keys = [GraphKey(b, b, True) for b in dec]
        keys += [GraphKey(b, t, False) for b in seqs for t in toks if t >= b]
        return sorted(keys, key=lambda k: -k.num_tokens)  # largest first: smaller ones reuse its pool memory

    def key_for(self, layout: BatchLayout) -> GraphKey | None:
        if layout.block_tables.shape[1] > self.max_pages:  # wider than captured: eager (never expected)
            return None
        key = graph_key(layout, *self.buckets)
        return key if key in self.graphs else None

    def _dummy(self, key: GraphKey) -> tuple[BatchLayout, torch.Tensor, torch.Tensor]:
        """A step of that shape that touches nothing: every row padding (kv_len 0, slot -1)."""
        empty = BatchLayout(0, [], [], torch.empty(0, dtype=torch.int64, device=self.device),
                            torch.zeros(0, 1, dtype=torch.int64, device=self.device), self.page_size)
        z = torch.empty(0, dtype=torch.int64, device=self.device)
        return pad_step(empty, z, z, key, self.max_pages)

    @torch.inference_mode()
    def capture(self, keys: list[GraphKey] | None = None) -> None:
        for key in keys or self.keys():
            layout, ids, pos = self._dummy(key)
            meta = self.backend.plan(layout)
            if self.device.type != "cuda":
                self.graphs[key] = _Graph(functools.partial(self.forward, ids, pos, meta, self.backend), ids, pos, meta)
                continue
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):  # warm-up off the capture: Triton compiles here, not inside it
                self.forward(ids, pos, meta, self.backend)
            g = torch.cuda.CUDAGraph()
            # thread_local: other models' workers keep launching while this thread captures.
            # Always the same stream: torch shares a pool's memory between captures on one stream.
            with torch.cuda.graph(g, pool=self.pool, stream=s, capture_error_mode="thread_local"):
                hidden = self.forward(ids, pos, meta, self.backend)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = _Graph(functools.partial(_replay, g, hidden), ids, pos, meta)

    def run(self, key: GraphKey, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay the step's graph -> hidden [T, hidden] for its T real tokens (a view into the
        graph's output: read it before the next replay)."""
        g = self.graphs[key]
        padded, ids, pos = pad_step(layout, input_ids, positions, key, self.max_pages)
        copy_meta(g.meta, self.backend.plan(padded))
        g.input_ids.copy_(ids, non_blocking=True)
        g.positions.copy_(pos, non_blocking=True)
        self.num_replays += 1
        return g.replay()[:input_ids.shape[0]]


def _replay(graph: "torch.cuda.CUDAGraph", hidden: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return hidden
