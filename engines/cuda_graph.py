"""CUDA graphs for small steps: decodes at bucketed batch sizes, and small mixed steps (a handoff
return is an extend of a few tokens) at bucketed (sequences, tokens), each padded to its bucket.
Anything outside the captured range runs eagerly.

The decisions (which bucket, padding a step to it, staging its metadata into the captured
buffers) are plain functions tested on CPU (tests/test_gpu_graphs.py). `StepGraphs` captures and
replays on CUDA; it has not run on a GPU yet (bench/gpu/check.py checks parity there).
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


class StaticInputs:
    """A graph's inputs (ids, positions and the backend's plan, a NamedTuple of fixed-shape tensors
    and ints) as views into one buffer per dtype on the device, each view 16-byte aligned (as a
    fresh tensor would be, so kernels compile the same). A replay stages the step's host values
    into one pinned buffer per dtype and copies each up at once: 2 copies a step, where padding
    and planning on the device and copying field by field took ~20 small launches. Ints and shapes
    are baked into the graph: a step whose differ is a bucketing bug, refused."""

    def __init__(self, meta: tuple, input_ids: torch.Tensor, positions: torch.Tensor, device: torch.device):
        named = [("input_ids", input_ids), ("positions", positions), *zip(type(meta)._fields, meta)]
        self._ints = {n: v for n, v in named if not isinstance(v, torch.Tensor)}
        self._fields: list[tuple[str, torch.dtype, int, torch.Size]] = []  # name, dtype, offset, shape
        ends: dict[torch.dtype, int] = {}
        for name, t in named:
            if isinstance(t, torch.Tensor):
                step = 16 // t.element_size()
                off = -(-ends.get(t.dtype, 0) // step) * step
                self._fields.append((name, t.dtype, off, t.shape))
                ends[t.dtype] = off + t.numel()
        self.buffers = {dt: torch.zeros(n, dtype=dt, device=device) for dt, n in ends.items()}
        views = {name: self.buffers[dt][off:off + shape.numel()].view(shape) for name, dt, off, shape in self._fields}
        self.input_ids, self.positions = views["input_ids"], views["positions"]
        self.meta = type(meta)(*[views.get(n, self._ints.get(n)) for n in type(meta)._fields])
        self.load(meta, input_ids, positions)

    def load(self, meta: tuple, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Write one step's host values (same shapes and ints as captured) into the buffers."""
        new = {"input_ids": input_ids, "positions": positions, **dict(zip(type(meta)._fields, meta))}
        for name, want in self._ints.items():
            if new[name] != want:
                raise ValueError(f"graph field {name}: captured {want!r}, step has {new[name]!r}")
        stage = {dt: torch.empty(b.numel(), dtype=dt, pin_memory=b.is_cuda) for dt, b in self.buffers.items()}
        for name, dt, off, shape in self._fields:
            t = new[name]
            if t.shape != shape:
                raise ValueError(f"graph buffer {name}: captured {tuple(shape)}, step has {tuple(t.shape)}")
            stage[dt][off:off + shape.numel()].copy_(t.reshape(-1))
        for dt, b in self.buffers.items():  # from pinned memory: no stream sync
            b.copy_(stage[dt], non_blocking=True)


# (ids [T], positions [T], meta, backend) -> hidden [T, H]
ForwardFn = Callable[[torch.Tensor, torch.Tensor, object, AttentionBackend], torch.Tensor]


class _Graph(NamedTuple):
    replay: Callable[[], torch.Tensor]  # -> hidden [Tb, hidden], the captured output buffer on CUDA
    inputs: StaticInputs  # what it reads, captured by address


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
        """A step of that shape that touches nothing, on the host: every row padding (kv_len 0, slot -1)."""
        z = torch.empty(0, dtype=torch.int64)
        return pad_step(BatchLayout(0, [], [], z, torch.zeros(0, 1, dtype=torch.int64), self.page_size), z, z, key,
                        self.max_pages)

    @torch.inference_mode()
    def capture(self, keys: list[GraphKey] | None = None) -> None:
        for key in keys or self.keys():
            layout, ids, pos = self._dummy(key)
            x = StaticInputs(self.backend.plan(layout), ids, pos, self.device)  # planned on the host
            args = (x.input_ids, x.positions, x.meta, self.backend)
            if self.device.type != "cuda":
                self.graphs[key] = _Graph(functools.partial(self.forward, *args), x)
                continue
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):  # warm-up off the capture: Triton compiles here, not inside it
                self.forward(*args)
            g = torch.cuda.CUDAGraph()
            # thread_local: other models' workers keep launching while this thread captures.
            # Always the same stream: torch shares a pool's memory between captures on one stream.
            with torch.cuda.graph(g, pool=self.pool, stream=s, capture_error_mode="thread_local"):
                hidden = self.forward(*args)
            if self.pool is None:
                self.pool = g.pool()
            self.graphs[key] = _Graph(functools.partial(_replay, g, hidden), x)

    def run(self, key: GraphKey, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Replay the step's graph for a host layout (CPU tensors: padded and planned on the host,
        then staged in two copies) -> hidden [T, hidden] for its T real tokens (a view into the
        graph's output: read it before the next replay)."""
        g = self.graphs[key]
        padded, ids, pos = pad_step(layout, input_ids, positions, key, self.max_pages)
        g.inputs.load(self.backend.plan(padded), ids, pos)
        self.num_replays += 1
        return g.replay()[:input_ids.shape[0]]


def _replay(graph: "torch.cuda.CUDAGraph", hidden: torch.Tensor) -> torch.Tensor:
    graph.replay()
    return hidden
