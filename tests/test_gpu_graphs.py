"""CUDA-graph bookkeeping on CPU: buckets, padding a step to its graph, copying metadata into the
captured buffers, and whole-engine greedy parity with StepGraphs' CPU stand-in for a capture
(the same static buffers re-run eagerly; Triton kernels under the interpreter). The capture and
replay on a real GPU are the `gpu`-marked tests at the end and bench/gpu/check.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engines import Engine, EngineConfig
from engines.attention import BatchLayout
from engines.cuda_graph import GraphKey, StaticInputs, bucket, graph_key, pad_step


def _layout(q_lens, kv_lens, nd, ps=4, width=3):
    T = sum(q_lens)
    bt = torch.arange(len(q_lens) * width).view(len(q_lens), width)
    return BatchLayout(nd, q_lens, kv_lens, torch.arange(T) + 100, bt, ps)


def test_bucket_and_graph_choice():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 8, 9)] == [1, 2, 4, 8, None]
    dec = (1, 2, 4, 8)
    assert graph_key(_layout([1] * 3, [5, 6, 7], 3), dec) == GraphKey(4, 4, True)
    assert graph_key(_layout([1] * 9, [5] * 9, 9), dec) is None  # past the decode buckets: eager
    # a handoff return (an extend of 3 tokens) next to two decodes: one small extend graph
    assert graph_key(_layout([1, 1, 3], [5, 6, 9], 2), dec, (1, 2, 4), (8, 16)) == GraphKey(4, 8, False)
    assert graph_key(_layout([1, 40], [5, 40], 1), dec, (1, 2, 4), (8, 16)) is None  # a prefill: eager
    assert graph_key(_layout([1] * 5, [5] * 4 + [9], 4), dec, (1, 2, 4), (8, 16)) is None  # too many rows


def test_pad_step_keeps_real_rows_and_pads_inert():
    lay = _layout([1, 1, 3], [5, 6, 9], 2)
    ids, pos = torch.tensor([7, 8, 9, 10, 11]), torch.tensor([4, 5, 6, 7, 8])
    p, pids, ppos = pad_step(lay, ids, pos, GraphKey(4, 8, False), max_pages=6)
    assert p.num_decodes == 0 and p.q_lens == [1, 1, 3, 0] and p.kv_lens == [5, 6, 9, 0]
    assert p.block_tables.shape == (4, 6) and torch.equal(p.block_tables[:3, :3], lay.block_tables)
    assert p.block_tables[3].eq(0).all() and p.block_tables[:, 3:].eq(0).all()
    assert p.slot_mapping.tolist() == [100, 101, 102, 103, 104, -1, -1, -1]
    assert pids.tolist() == [7, 8, 9, 10, 11, 0, 0, 0] and ppos.tolist() == [4, 5, 6, 7, 8, 0, 0, 0]
    dec = _layout([1, 1], [5, 6], 2)
    p, _, _ = pad_step(dec, ids[:2], pos[:2], GraphKey(4, 4, True), max_pages=3)
    assert p.num_decodes == 4 and p.q_lens == [1] * 4 and p.kv_lens == [5, 6, 0, 0]
    assert p.slot_mapping.tolist() == [100, 101, -1, -1]


def test_static_inputs_stage_a_step_into_aligned_views():
    """Ids, positions and the plan live in one buffer per dtype, each field 16-byte aligned; a step's
    host values land in them; a shape or int that differs from the capture is refused."""
    from typing import NamedTuple

    class M(NamedTuple):
        a: torch.Tensor  # int32
        slots: torch.Tensor  # int64
        n: int
    i32, i64 = torch.int32, torch.int64
    x = StaticInputs(M(torch.arange(3, dtype=i32), torch.arange(5, dtype=i64), 2), torch.arange(7), torch.arange(7),
                     torch.device("cpu"))
    assert set(x.buffers) == {i32, i64} and x.meta.n == 2
    for t in (x.input_ids, x.positions, x.meta.a, x.meta.slots):  # views of the buffers, aligned
        assert t.untyped_storage().data_ptr() == x.buffers[t.dtype].untyped_storage().data_ptr()
        assert t.data_ptr() % 16 == 0
    x.load(M(torch.tensor([7, 8, 9], dtype=i32), torch.full((5,), -1), 2), torch.arange(7) + 10, torch.arange(7) * 2)
    assert x.meta.a.tolist() == [7, 8, 9] and x.meta.slots.tolist() == [-1] * 5
    assert x.input_ids.tolist() == list(range(10, 17)) and x.positions.tolist() == list(range(0, 14, 2))
    with pytest.raises(ValueError, match="graph buffer a: captured"):
        x.load(M(torch.ones(4, dtype=i32), torch.ones(5, dtype=i64), 2), torch.arange(7), torch.arange(7))
    with pytest.raises(ValueError, match="graph field n: captured 2, step has 3"):
        x.load(M(torch.ones(3, dtype=i32), torch.ones(5, dtype=i64), 3), torch.arange(7), torch.arange(7))
    assert x.meta.a.tolist() == [7, 8, 9]  # a refused step wrote nothing


@pytest.mark.triton_interp
def test_engine_through_graph_buckets_matches_torch(tiny_qwen3):
    """Every small step goes through StepGraphs (padded to its bucket, plan copied into static
    buffers); greedy tokens equal the torch backend's, eager and unpadded."""
    import triton  # noqa: F401  (the test extra brings it)
    from engines.attention.triton_backend import TritonBackend
    prompts = [[5, 6, 7], list(range(2, 40)), [9] * 17]
    cfg = EngineConfig(num_kv_tokens=1024, max_num_batched_tokens=24)  # chunked prefill: mixed small steps
    ref = Engine(tiny_qwen3, config=cfg)
    want = [o.token_ids for o in ref.generate(prompts, max_tokens=10, temperature=0.0, ignore_eos=True)]
    eng = Engine(tiny_qwen3, config=cfg)
    r = eng.runner
    r.capture_graphs(TritonBackend(block_m=16, block_n=16), decode_buckets=(1, 2, 4), seq_buckets=(1, 2, 4),
                     token_buckets=(8, 16, 32))
    got = [o.token_ids for o in eng.generate(prompts, max_tokens=10, temperature=0.0, ignore_eos=True)]
    assert got == want
    assert r.graphs.num_replays >= 10  # decodes at bucket 4 and the small prefill chunks
    # again: prefix-cache hits make extends over a cached prefix
    again = [o.token_ids for o in eng.generate(prompts, max_tokens=10, temperature=0.0, ignore_eos=True)]
    assert again == want
    assert eng.kv_usage().pages_free == eng.kv_usage().pages_total


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cuda_graphs_match_eager_on_gpu(tiny_qwen3, backend):
    import triton  # noqa: F401
    prompts = [[5, 6, 7], list(range(2, 40)), [9] * 17]
    cfg = EngineConfig(num_kv_tokens=1024, max_num_batched_tokens=24, attention_backend=backend)
    eager = Engine(tiny_qwen3, device="cuda", config=replace(cfg, cuda_graphs=False))
    want = [o.token_ids for o in eager.generate(prompts, max_tokens=16, temperature=0.0, ignore_eos=True)]
    graphed = Engine(tiny_qwen3, device="cuda", config=cfg)
    got = [o.token_ids for o in graphed.generate(prompts, max_tokens=16, temperature=0.0, ignore_eos=True)]
    assert got == want and graphed.runner.graphs.num_replays > 0
