"""Per-layer attention options (base.LayerAttn: sliding window, softmax scale, logit softcap) in every
attention backend, against a dense float64 reference written from the definitions.

One batch holds decodes and extends with and without a cached prefix (a prefill, a chunk of a long
prompt, handoff resumes of a few tokens), page size 16, GQA (H=4, Hkv=2). Windows of 1, 16 and 32
tokens are shorter than most contexts here (up to 100 tokens); 10**6 is longer than all of them."""
from __future__ import annotations

import random

import pytest
import torch

from attn_cases import random_step
from engines.attention import FULL, LayerAttn
from engines.attention.cpu_backend import KERNEL_MAX_Q, CpuBackend, load
from engines.attention.torch_backend import TorchBackend

H, HKV, PS = 4, 2, 16
WINDOWS = [1, 16, 32, 10**6]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # bf16: the backends round P and O to bf16 on the way


def reference(layout, q, k, v, kc, vc, layer: LayerAttn) -> torch.Tensor:
    """The definition, one sequence at a time in float64: query at position p (the last q_len of
    kv_len) sees keys at positions j with p - window < j <= p (HF's sliding_window_overlay and
    causal mask), scores scale * q.k, then softcap * tanh(scores / softcap)."""
    kc, vc = kc.clone(), vc.clone()
    kc[layout.slot_mapping], vc[layout.slot_mapping] = k, v
    d = q.shape[-1]
    scale = layer.scale if layer.scale is not None else d ** -0.5
    out, q0 = torch.empty(q.shape, dtype=torch.float64), 0
    for i, (q_len, kv_len) in enumerate(zip(layout.q_lens, layout.kv_lens)):
        pos = torch.arange(kv_len)
        slots = layout.block_tables[i, pos // PS] * PS + pos % PS
        keys = kc[slots].double().repeat_interleave(H // HKV, dim=1)  # [kv_len, H, D]: head j uses KV head j // G
        vals = vc[slots].double().repeat_interleave(H // HKV, dim=1)
        qpos = torch.arange(kv_len - q_len, kv_len)
        s = torch.einsum("qhd,khd->hqk", q[q0:q0 + q_len].double(), keys) * scale
        if layer.softcap > 0:
            s = layer.softcap * torch.tanh(s / layer.softcap)
        see = pos[None, :] <= qpos[:, None]
        if layer.window > 0:
            see &= pos[None, :] > qpos[:, None] - layer.window
        s = s.masked_fill(~see, float("-inf"))
        out[q0:q0 + q_len] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), vals)
        q0 += q_len
    return out


def mixed_step(seed: int, dtype: torch.dtype, d: int = 32, num_decodes: int = 4):
    """Decodes and four extends in one batch over random_step's pool: a whole prompt (no cached
    prefix), a long chunk on a cached prefix (SDPA in the CPU backend), and resumes of 3 and
    KERNEL_MAX_Q tokens on cached prefixes (the CPU kernel). Contexts 40..99, on shuffled pages.
    -> (layout, q, k, v, k cache, v cache)"""
    rng = random.Random(seed)
    layout, kc, vc, g = random_step(rng, num_decodes, 4, PS, HKV, d, dtype, max_ctx=100)
    kv_lens = [rng.randrange(40, 100) for _ in range(num_decodes)] + [70, 90, 60, 80]
    q_lens = [1] * num_decodes + [70, 40, 3, KERNEL_MAX_Q]
    pages = list(range(kc.shape[0] // PS))  # the pool holds (rows) * ceil(100 / PS) + 3 pages
    rng.shuffle(pages)
    tables = [[pages.pop() for _ in range(-(-n // PS))] for n in kv_lens]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    slots = [t[p // PS] * PS + p % PS for t, ql, kl in zip(tables, q_lens, kv_lens) for p in range(kl - ql, kl)]
    layout = layout._replace(q_lens=q_lens, kv_lens=kv_lens, block_tables=bt,
                             slot_mapping=torch.tensor(slots, dtype=torch.int64))
    T = sum(q_lens)
    q = torch.randn(T, H + HKV, d, generator=g).to(dtype)[:, :H]  # strided rows, as the model passes them
    k = torch.randn(T, HKV, d, generator=g).to(dtype)
    v = torch.randn(T, HKV, d, generator=g).to(dtype)
    return layout, q, k, v, kc, vc


def run(backend, layout, q, k, v, kc, vc, layer=None):
    kc, vc = kc.clone(), vc.clone()
    meta = backend.plan(layout)
    if layer is None:
        return backend.forward(q, k, v, kc, vc, meta)
    return backend.forward(q, k, v, kc, vc, meta, layer)


def check(backend, layer, dtype, seed=0, d=32):
    layout, q, k, v, kc, vc = mixed_step(seed, dtype, d)
    got = run(backend, layout, q, k, v, kc, vc, layer)
    want = reference(layout, q, k, v, kc, vc, layer)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    return layout, got


LAYERS = [LayerAttn(window=w) for w in WINDOWS] + [
    LayerAttn(scale=0.07), LayerAttn(softcap=2.0), LayerAttn(softcap=50.0, scale=0.3),
    LayerAttn(window=16, scale=0.1, softcap=3.0), LayerAttn(window=1, softcap=5.0)]
IDS = [f"w{l.window}-s{l.scale}-c{l.softcap}" for l in LAYERS]


def test_the_batch_has_every_kind_of_row():
    layout, *_ = mixed_step(0, torch.float32)
    nd = layout.num_decodes
    ext = list(zip(layout.q_lens[nd:], layout.kv_lens[nd:]))
    assert nd == 4 and all(kv > 32 for kv in layout.kv_lens[:nd])  # decodes longer than the windows
    assert any(q == kv for q, kv in ext) and any(q < kv for q, kv in ext)  # with and without a prefix
    assert any(q > KERNEL_MAX_Q for q, kv in ext) and any(q <= KERNEL_MAX_Q < kv for q, kv in ext)
    assert max(layout.kv_lens) < 10**6 and min(layout.kv_lens) > 32


def test_reference_window_follows_hf_masks():
    """The reference's rule is transformers' own: sliding_window_causal_mask_function(w)."""
    from transformers.masking_utils import sliding_window_causal_mask_function
    for w in (1, 3, 16):
        fn = sliding_window_causal_mask_function(w)
        pos = torch.arange(40)
        hf = fn(torch.tensor(0), torch.tensor(0), pos[:, None], pos[None, :])  # [40, 40], as HF's vmap sees it
        ours = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
        assert torch.equal(hf, ours)
        assert int(ours[39].sum()) == w  # the last `w` tokens, the query's own included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", LAYERS, ids=IDS)
def test_torch_backend(layer, dtype):
    check(TorchBackend(), layer, dtype)


def test_windows_change_the_result():
    """The windows above matter: a window shorter than the context gives a different answer than
    full attention (so a backend ignoring `window` would fail the tests)."""
    layout, q, k, v, kc, vc = mixed_step(1, torch.float32)
    full = reference(layout, q, k, v, kc, vc, FULL)
    for w in (1, 16, 32):
        assert (reference(layout, q, k, v, kc, vc, LayerAttn(window=w)) - full).abs().max() > 1e-2
    assert torch.equal(reference(layout, q, k, v, kc, vc, LayerAttn(window=10**6)), full)
    assert (reference(layout, q, k, v, kc, vc, LayerAttn(softcap=2.0)) - full).abs().max() > 1e-2


def test_window_one_is_the_value_itself():
    """window=1: each query sees only its own key, so its output is its own value row."""
    layout, q, k, v, kc, vc = mixed_step(2, torch.float32)
    for backend in (TorchBackend(), CpuBackend(load())):
        got = run(backend, layout, q, k, v, kc, vc, LayerAttn(window=1))
        torch.testing.assert_close(got, v.repeat_interleave(H // HKV, dim=1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_full_is_the_fast_path(dtype):
    """LayerAttn() takes the FULL branch: bit-identical to calling without a layer, on every row."""
    layout, q, k, v, kc, vc = mixed_step(3, dtype)
    base = run(TorchBackend(), layout, q, k, v, kc, vc)
    assert torch.equal(run(TorchBackend(), layout, q, k, v, kc, vc, LayerAttn()), base)
    assert torch.equal(run(TorchBackend(), layout, q, k, v, kc, vc, FULL), base)
    torch.testing.assert_close(base.double(), reference(layout, q, k, v, kc, vc, FULL),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_torch_windowed_decodes_gather_only_the_window():
    """A windowed layer's decodes gather min(kv_len, window) keys each, not the whole context."""
    layout, q, k, v, kc, vc = mixed_step(4, torch.float32)
    backend = TorchBackend()
    meta = backend.plan(layout)
    backend.forward(q, k, v, kc.clone(), vc.clone(), meta, LayerAttn(window=16))
    window, _, groups = meta.memo[("window", 16)]
    assert window == 16 and max(g.max_kv for g in groups) == 16
    backend.forward(q, k, v, kc.clone(), vc.clone(), meta, LayerAttn(window=10**6))
    assert meta.memo[("window", 10**6)][2] is meta.decode_groups  # no decode exceeds it: plan's gather


def test_cpu_kernel_builds():
    assert load() is not None, "the CPU attention kernel did not build (needs g++ and ninja)"


@pytest.mark.parametrize("d", [32, 64])  # 64: the kernel's compiled-in head dim (and AVX-512 blocks, where built)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", LAYERS, ids=IDS)
def test_cpu_backend(layer, dtype, d):
    check(CpuBackend(load()), layer, dtype, d=d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_full_is_the_fast_path(dtype):
    """LayerAttn() takes the unchanged FULL call, and the kernel's window code leaves a window
    longer than every context on the FULL loops: bit-identical results."""
    backend = CpuBackend(load())
    layout, q, k, v, kc, vc = mixed_step(5, dtype, d=64)
    base = run(backend, layout, q, k, v, kc, vc)
    assert torch.equal(run(backend, layout, q, k, v, kc, vc, LayerAttn()), base)
    meta = backend.plan(layout)
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[layout.slot_mapping], vc2[layout.slot_mapping] = k, v
    full, wide = torch.zeros_like(base), torch.zeros_like(base)
    load()(q, kc2, vc2, meta.block_tables, meta.seqs, PS, 64 ** -0.5, full)
    load()(q, kc2, vc2, meta.block_tables, meta.seqs, PS, 64 ** -0.5, wide, 10**6, 0.0)
    assert torch.equal(full, wide) and full.abs().sum() > 0


def poison_outside_windows(layout, kc, vc, window):
    """NaN into every pooled key/value older than the first key any query of its sequence sees
    (position < kv_len - q_len - window + 1): a backend that reads them, even masked, returns NaN."""
    kc, vc = kc.clone(), vc.clone()
    for i, (q_len, kv_len) in enumerate(zip(layout.q_lens, layout.kv_lens)):
        for p in range(kv_len - q_len - window + 1):
            s = int(layout.block_tables[i, p // PS]) * PS + p % PS
            kc[s], vc[s] = float("nan"), float("nan")
    return kc, vc


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_keys_before_the_window_are_never_read(backend):
    be = TorchBackend() if backend == "torch" else CpuBackend(load())
    layout, q, k, v, kc, vc = mixed_step(6, torch.float32)
    layer = LayerAttn(window=16)
    pk, pv = poison_outside_windows(layout, kc, vc, 16)
    assert pk.isnan().any()
    got = run(be, layout, q, k, v, pk, pv, layer)
    torch.testing.assert_close(got.double(), reference(layout, q, k, v, kc, vc, layer), atol=1e-5, rtol=1e-5)


TRITON_LAYERS = [pytest.param(layer, marks=pytest.mark.triton_interp, id=i) for layer, i in zip(LAYERS, IDS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", TRITON_LAYERS)
def test_triton_backend(layer, dtype):
    """Under the interpreter on CPU tensors. Blocks of 16 keys and queries: windows start inside,
    at and past block edges, and the 70-token prefill spans 5 query blocks."""
    from engines.attention.triton_backend import TritonBackend
    check(TritonBackend(block_m=16, block_n=16), layer, dtype)


@pytest.mark.triton_interp
def test_triton_keys_before_the_window_are_never_loaded():
    from engines.attention.triton_backend import TritonBackend
    layout, q, k, v, kc, vc = mixed_step(6, torch.float32)
    layer = LayerAttn(window=16)
    pk, pv = poison_outside_windows(layout, kc, vc, 16)
    got = run(TritonBackend(16, 16), layout, q, k, v, pk, pv, layer)
    torch.testing.assert_close(got.double(), reference(layout, q, k, v, kc, vc, layer), atol=1e-5, rtol=1e-5)


@pytest.mark.triton_interp
def test_triton_full_unchanged():
    """FULL compiles the kernels without the window and softcap code: same numbers as before, and
    a window longer than every context gives the same answer."""
    from engines.attention.triton_backend import TritonBackend
    layout, q, k, v, kc, vc = mixed_step(7, torch.float32)
    base = run(TritonBackend(16, 16), layout, q, k, v, kc, vc)
    assert torch.equal(run(TritonBackend(16, 16), layout, q, k, v, kc, vc, LayerAttn()), base)
    torch.testing.assert_close(run(TritonBackend(16, 16), layout, q, k, v, kc, vc, LayerAttn(window=10**6)), base,
                               atol=1e-6, rtol=1e-6)


def on_cuda(layout, *tensors):
    layout = layout._replace(slot_mapping=layout.slot_mapping.cuda(), block_tables=layout.block_tables.cuda())
    return (layout, *(t.cuda() for t in tensors))


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS, ids=IDS)
def test_triton_backend_compiled(layer):
    """The compiled kernels on CUDA (bf16 tl.dot there), against the reference."""
    from engines.attention.triton_backend import TritonBackend
    layout, q, k, v, kc, vc = mixed_step(0, torch.bfloat16, d=64)
    got = run(TritonBackend(), *on_cuda(layout, q, k, v, kc, vc), layer).cpu()
    torch.testing.assert_close(got.double(), reference(layout, q, k, v, kc, vc, layer), atol=4e-2, rtol=4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", LAYERS, ids=IDS)
def test_flashinfer_backend(layer):
    """window_left = window - 1, sm_scale, logits_soft_cap, against the reference and TorchBackend;
    two kinds of layer in one step, as Gemma 3 runs them, each on its own plan."""
    pytest.importorskip("flashinfer")
    from engines.attention.flashinfer_backend import FlashInferBackend
    layout, q, k, v, kc, vc = mixed_step(0, torch.bfloat16, d=64)
    cl, cq, ck, cv, ckc, cvc = on_cuda(layout, q, k, v, kc, vc)
    backend = FlashInferBackend(torch.device("cuda"))
    backend.bind(H, HKV, 64, torch.bfloat16)
    meta = backend.plan(cl)
    outs = [backend.forward(cq, ck, cv, ckc.clone(), cvc.clone(), meta, kind).cpu() for kind in (layer, FULL, layer)]
    assert torch.equal(outs[0], outs[2])  # FULL's plan in between left this kind's alone
    for kind, got in ((layer, outs[0]), (FULL, outs[1])):
        want = reference(layout, q, k, v, kc, vc, kind)
        torch.testing.assert_close(got.double(), want, atol=4e-2, rtol=4e-2)
        torch.testing.assert_close(got.float(), run(TorchBackend(), cl, cq, ck, cv, ckc, cvc, kind).cpu().float(),
                                   atol=4e-2, rtol=4e-2)
