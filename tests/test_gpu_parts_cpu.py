"""The GPU path's pure-Python pieces, checked on CPU: backend choice, paged metadata, joint KV."""
from __future__ import annotations

import random

import pytest
import torch

import engines.attention.select as attention_select
from engines.attention import BatchLayout, select_backend
from engines.attention.torch_backend import TorchBackend
from engines.attention.cpu_backend import CpuBackend
from engines.memory import ModelFootprint, joint_kv_tokens
from engines.paged_meta import build_paged_meta, slots_from_meta


def test_cpu_never_picks_a_cuda_backend_even_when_installed(monkeypatch):
    monkeypatch.setattr(attention_select, "has_module", lambda name: True)  # as if flashinfer and triton were installed
    assert isinstance(select_backend(torch.device("cpu")), (TorchBackend, CpuBackend))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend(torch.device("cpu"), "flashinfer")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(torch.device("cpu"), "magic")


@pytest.mark.parametrize("seed", range(5))
def test_paged_meta_matches_torch_reference(seed):
    """The CSR metadata names exactly the pool slots the torch backend gathers."""
    rng = random.Random(seed)
    ps, B = 4, 6
    free = list(range(200))
    rng.shuffle(free)
    q_lens, kv_lens, tables = [], [], []
    for i in range(B):
        n = rng.randrange(1, 40)
        q = 1 if i < 3 else rng.randrange(1, n + 1)  # three decodes first, then extends
        pages = -(-n // ps) + rng.randrange(2)  # a table may hold an extra, not yet used page
        q_lens.append(q), kv_lens.append(n), tables.append([free.pop() for _ in range(pages)])
    meta = build_paged_meta(q_lens, kv_lens, tables, ps)
    assert meta.qo_indptr[-1] == sum(q_lens) and len(meta.kv_indptr) == B + 1
    assert all(1 <= x <= ps for x in meta.kv_last_page_len)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    layout = BatchLayout(3, q_lens, kv_lens, torch.zeros(sum(q_lens), dtype=torch.int64), bt, ps)
    tmeta = TorchBackend().plan(layout)
    ref, off = [], 0
    for g in tmeta.decode_groups:  # decode slots are stored group after group, each [n, max_kv]
        rows = tmeta.decode_slots[off:off + (g.end - g.start) * g.max_kv].view(-1, g.max_kv)
        ref += [rows[i - g.start, :kv_lens[i]].tolist() for i in range(g.start, g.end)]
        assert all(x == -1 for i in range(g.start, g.end) for x in rows[i - g.start, kv_lens[i]:].tolist())
        off += (g.end - g.start) * g.max_kv
    for i, e in enumerate(tmeta.extends, start=3):
        ref.append(e.kv_slots.tolist() if e.kv_slots is not None else
                   [tables[i][t // ps] * ps + t % ps for t in range(kv_lens[i])])
    assert slots_from_meta(meta, ps) == ref


def test_paged_meta_rejects_bad_lengths():
    with pytest.raises(ValueError, match="needs 2 pages"):
        build_paged_meta([1], [5], [[3]], 4)
    with pytest.raises(ValueError, match="bad lengths"):
        build_paged_meta([3], [2], [[3]], 4)


def test_joint_kv_tokens():
    gib = 2**30
    a = ModelFootprint("small", 1 * gib, 100_000)
    b = ModelFootprint("large", 16 * gib, 400_000)
    t = joint_kv_tokens([a, b], 80 * gib, memory_fraction=0.9, page_size=16)
    budget = 0.9 * 80 * gib - 17 * gib
    assert t % 16 == 0 and t * 500_000 <= budget < (t + 16) * 500_000
    # sharing a device halves what each would get alone only through the summed per-token cost
    alone = joint_kv_tokens([b], 80 * gib, memory_fraction=0.9)
    assert alone > t
    with pytest.raises(ValueError, match="no room"):
        joint_kv_tokens([b], 16 * gib)
    with pytest.raises(ValueError, match="memory_fraction"):
        joint_kv_tokens([a], 80 * gib, memory_fraction=1.5)


def test_cuda_order_flashinfer_then_triton_then_torch(monkeypatch):
    """On CUDA the first installed backend wins; constructing the Triton backend needs no GPU."""
    from engines.attention.triton_backend import TritonBackend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(attention_select, "has_module", lambda name: name == "triton")
    assert isinstance(select_backend(torch.device("cuda:0")), TritonBackend)
    monkeypatch.setattr(attention_select, "has_module", lambda name: False)
    assert isinstance(select_backend(torch.device("cuda:0")), TorchBackend)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backend(torch.device("cpu"), "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it on CPU (tests, dry runs)
    assert isinstance(select_backend(torch.device("cpu"), "triton"), TritonBackend)
    assert isinstance(select_backend(torch.device("cpu")), CpuBackend)  # triton is never the default there


def test_parse_device_groups():
    from engines.devices import parse_devices, split_layers
    assert parse_devices("cuda:0,1") == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert parse_devices("cuda:0, cuda:2") == [torch.device("cuda:0"), torch.device("cuda:2")]
    assert parse_devices("cpu") == [torch.device("cpu")] and parse_devices(None) == [torch.device("cpu")]
    assert parse_devices("cpu,cpu") == [torch.device("cpu")] * 2  # a split testable without GPUs
    for bad, msg in [("cuda:0,0", "twice"), ("cuda:0,,1", "empty"), ("1,2", "bare index"), ("cpu,cuda:0", "mixes"),
                     ("gpu:0", "not a device")]:
        with pytest.raises(ValueError, match=msg):
            parse_devices(bad)
    assert split_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert split_layers(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    with pytest.raises(ValueError):
        split_layers(2, 3)
    from aiorouter.spec import ModelSpec
    with pytest.raises(ValueError, match="twice"):
        ModelSpec(path="x", device="cuda:1,1")
    assert ModelSpec(path="x", device="cuda:0,1").device == "cuda:0,1"


@pytest.mark.parametrize("tie", [False, True])
def test_device_group_of_two_cpus_matches_one_device(tmp_path, tie):
    """A "cpu,cpu" group runs the pipeline split (layer ranges, per-stage KV pools and plans, hidden
    state handed on) on one machine: logits equal the unsplit model's."""
    from conftest import make_tiny_qwen3
    from engines import Engine, EngineConfig, SamplingParams
    path = make_tiny_qwen3(tmp_path / "m", layers=3, tie=tie, seed=2)
    cfg = EngineConfig(num_kv_tokens=512)
    one, two = Engine(path, config=cfg), Engine(path, device="cpu,cpu", config=cfg)
    assert [st.layers for st in two.runner.stages] == [range(0, 2), range(2, 3)]
    prompts = [[5, 6, 7], list(range(2, 30)), [9] * 11]
    logits = []
    for eng in (one, two):
        seqs = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for p in prompts]
        steps = []
        while any(not s.is_finished for s in seqs):
            out = eng.forward()
            steps.append(out.logits)
            for s, t in zip(out.seqs, out.next_tokens):
                eng.append_token(s, t)
        logits.append((steps, [s.output_ids for s in seqs]))
    assert logits[0][1] == logits[1][1]
    for a, b in zip(logits[0][0], logits[1][0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # oneDNN-packed vs plain linears
