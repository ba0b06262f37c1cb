"""The GPU check's correctness sections: the Triton probe and engine parity.

Reference: the torch backend in fp32 (plain SDPA, cuBLAS fp32 with TF32 off). Candidates (the
Triton backend eager and graphed, fp32 and bf16; the torch backend in bf16) are measured twice:
1. teacher-forced on the reference's tokens: the logits' relative error at every position (the
   first is the prefill's), and whether each step's sampled token is the argmax of its logits;
2. free-running greedy tokens against the reference's. fp32 must agree token for token (its
   noise, ~1e-6 relative, is far below any logit margin). bf16 cannot: a random model's top two
   logits are Gaussian draws, their margin is a fixed fraction of the logits' spread whatever the
   weights' std, so bf16 noise flips some (measured on CPU, 144 positions: 5, 10, 7 flips at std
   0.02, 0.1, 0.3), and SmolLM2's real weights (270 MB in bf16) do not fit the 64 MiB a device
   call carries. A bf16 candidate's logit error may be up to 3x the torch backend's own in bf16
   (checked in 1); such an error flips two logits whose margin is up to twice that, so a bf16
   divergence fails only where the fp32 reference's margin there exceeds 6x that yardstick.
"""
from __future__ import annotations

import random

import torch

from bench.gpu.models import PARITY, Run, scaled
from engines import SamplingParams
from engines.profile import runner_info

PROBE_HEADS = [(16, 8), (32, 8), (64, 8)]  # GQA 2, 4, 8: Qwen3-0.6B/1.7B, 8B, 32B


def exact_sdpa():
    """SDPA's math backend: plain fp32 matmuls (TF32 is off by default), where the fused kernels
    may compute fp32 through TF32 tensor cores: the reference must be the exact one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


def _paged_step(gen: torch.Generator, h: int, hkv: int, d: int, ps: int, dtype: torch.dtype, dev: torch.device):
    """Three decodes, an extend over a cached prefix and a fresh prefill, over a shuffled pool."""
    from engines.attention import BatchLayout
    q_lens, kv_lens = [1, 1, 1, 17, 64], [37, 200, 5, 57, 64]
    pages_needed = [-(-n // ps) for n in kv_lens]
    perm = torch.randperm(sum(pages_needed) + 4, generator=gen).tolist()
    tables, slots, off = [], [], 0
    for q, kv, n in zip(q_lens, kv_lens, pages_needed):
        tables.append(perm[off:off + n])
        off += n
        slots += [tables[-1][t // ps] * ps + t % ps for t in range(kv - q, kv)]
    bt = torch.tensor([t + [0] * (max(pages_needed) - len(t)) for t in tables], dtype=torch.int64)
    n_slots = (len(perm)) * ps + 1
    kc, vc = (torch.randn(n_slots, hkv, d, generator=gen) for _ in range(2))
    kc[-1] = vc[-1] = 0  # KVPool's null slot
    T = sum(q_lens)
    q, k, v = torch.randn(T, h, d, generator=gen), torch.randn(T, hkv, d, generator=gen), torch.randn(T, hkv, d, generator=gen)
    layout = BatchLayout(3, q_lens, kv_lens, torch.tensor(slots).to(dev), bt.to(dev), ps)
    return layout, [t.to(dtype).to(dev) for t in (q, k, v, kc, vc)]


def probe(ctx) -> None:
    """Triton against the torch backend on fp32 copies of the same inputs (METHOD.md's reference),
    at the real head shapes; then one Triton launch captured in a CUDA graph and replayed on new
    inputs. `ctx.block_n` other than a power of two makes Triton refuse to compile (the simulated
    failure: a real Triton error, through the backend's own option)."""
    import triton

    from engines.attention import select_backend
    from engines.attention.triton_backend import TritonBackend  # its block size is the simulated failure's knob
    dev, d = ctx.device, (32 if ctx.dry else 128)
    ctx.put("facts", {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                      "capability": torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None,
                      "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__})
    heads = [(4, 2), (8, 2)] if ctx.dry else PROBE_HEADS
    be = TritonBackend(block_n=ctx.block_n)
    gen = torch.Generator().manual_seed(0)
    cases, ok = {}, True
    # every GQA shape in bf16 (what the speed sections run); fp32 (parity's exact check) at one:
    # each (dtype, GQA) is a compile of three kernels, ~1-2 s each on the device
    for dtype, tol, shapes in ((torch.bfloat16, 2e-2, heads), (torch.float32, 1e-4, heads[1:2])):
        for h, hkv in shapes:
            layout, (q, k, v, kc, vc) = _paged_step(gen, h, hkv, d, 16, dtype, dev)
            up = [t.float() for t in (q, k, v, kc, vc)]
            torch_be = select_backend(dev, "torch")
            with exact_sdpa():
                ref = torch_be.forward(*up, torch_be.plan(layout))
            got = be.forward(q, k, v, kc, vc, be.plan(layout))
            rel = ((got.float() - ref).norm() / ref.norm()).item()
            stored = torch.equal(kc.float(), up[3]) and torch.equal(vc.float(), up[4])
            mine = torch_be.forward(q, k, v, kc.clone(), vc.clone(), torch_be.plan(layout))
            cases[f"{str(dtype)[6:]}/h{h}kv{hkv}d{d}"] = {
                "rel_err": rel, "torch_same_dtype_rel_err": ((mine.float() - ref).norm() / ref.norm()).item(),
                "kv_stored": stored, "ok": rel <= tol and stored}
            ok &= cases[list(cases)[-1]]["ok"]
            ctx.put("cases", cases)
    ctx.put("graph_replay", _graph_replay(be, dev, d) if dev.type == "cuda" else "n/a on CPU")
    ok &= ctx.body["graph_replay"] == "n/a on CPU" or ctx.body["graph_replay"]["ok"]
    ctx.put("ok", bool(ok))


def _graph_replay(be, dev: torch.device, d: int) -> dict:
    from engines.streams import StreamFactory
    gen = torch.Generator().manual_seed(1)
    layout, (q, k, v, kc, vc) = _paged_step(gen, 32, 8, d, 16, torch.bfloat16, dev)
    meta = be.plan(layout)
    stream = StreamFactory().stream(dev, "probe")
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        be.forward(q, k, v, kc.clone(), vc.clone(), meta)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        kg, vg = kc.clone(), vc.clone()
        with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
            out = be.forward(q, k, v, kg, vg, meta)
        q.copy_(torch.randn(q.shape, generator=gen).to(q))  # new inputs into the captured buffers
        g.replay()
        want = be.forward(q, k, v, kc.clone(), vc.clone(), meta)
    stream.synchronize()
    return {"ok": bool(torch.equal(out, want)), "max_abs_diff": (out.float() - want.float()).abs().max().item()}


def _generate(eng, prompts: list[list[int]], n: int, forced: list[list[int]] | None = None):
    """Greedy; `forced`: append these tokens instead of the sampled ones (teacher forcing).
    -> (sampled tokens, logits per position [V] on the CPU) per prompt."""
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in prompts]
    row = {s.seq_id: i for i, s in enumerate(seqs)}
    toks, logits = [[] for _ in prompts], [[] for _ in prompts]
    while any(not s.is_finished for s in seqs):
        out = eng.forward()
        for s, t, lg in zip(out.seqs, out.next_tokens, out.logits):
            i = row[s.seq_id]
            toks[i].append(t)
            logits[i].append(lg.float().cpu())
            eng.append_token(s, forced[i][len(toks[i]) - 1] if forced else t)
    return toks, logits


def _forced_metrics(logits, ref_logits, toks, ref_toks) -> dict:
    rel = [[((a - b).norm() / b.norm()).item() for a, b in zip(la, lb)] for la, lb in zip(logits, ref_logits)]
    flat = sorted(x for r in rel for x in r[1:])
    err = max((a - b).abs().max().item() for la, lb in zip(logits, ref_logits) for a, b in zip(la, lb))
    return {"first_step_rel_err": max(r[0] for r in rel), "decode_rel_err_max": flat[-1] if flat else None,
            "decode_rel_err_median": flat[len(flat) // 2] if flat else None, "max_abs_err": err,
            "sampled_is_argmax": all(t == int(lg.argmax()) for ts, ls in zip(toks, logits) for t, lg in zip(ts, ls)),
            "argmax_equals_reference": sum(int(lg.argmax()) == t for ls, rs in zip(logits, ref_toks) for lg, t in zip(ls, rs)),
            "positions": sum(len(r) for r in ref_toks)}


def _greedy_metrics(toks, ref_toks, ref_logits, noise: float | None) -> dict:
    """Free-running tokens against the reference's: per sequence, the first divergence and the
    reference's top-1 margin there; with `noise` (bf16), a divergence at a margin <= 6 * noise is a tie."""
    div = []
    for i, (a, b) in enumerate(zip(toks, ref_toks)):
        j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is not None:
            top = ref_logits[i][j].topk(2).values
            margin = (top[0] - top[1]).item()
            div.append({"seq": i, "pos": j, "ref_margin": margin, "tie": noise is not None and margin <= 6 * noise})
    return {"sequences_equal": sum(a == b for a, b in zip(toks, ref_toks)), "sequences": len(ref_toks),
            "divergences": div, "unexplained": sum(not d["tie"] for d in div)}


def parity(ctx) -> None:
    shape = scaled(PARITY, ctx.dry)
    rng = random.Random(0)
    lens = (5, 37, 120, 2, 64, 9) if not ctx.dry else (5, 20, 2)
    prompts = [[rng.randrange(2, shape.vocab) for _ in range(n)] for n in lens]
    n = 6 if ctx.dry else 32
    fields = dict(num_kv_tokens=4096, max_model_len=1024, max_num_batched_tokens=48)  # chunked prefill: mixed steps
    ctx.put("model", shape.describe())
    f32, bf16 = torch.float32, torch.bfloat16
    ref_run = Run(ctx.device, f32, "torch", False)
    with exact_sdpa():
        ref_t, ref_l = _generate(ref_run.engine(ctx.root, shape, ctx.streams, **fields), prompts, n)
    cands = [("torch", False, bf16)]
    if ctx.attention != "torch":
        ctx.triton_used()
        graphed = (False, True) if ctx.graphs and ctx.device.type == "cuda" else (False,)  # CPU captures nothing
        cands += [("triton", g, dt) for dt in (bf16, f32) for g in graphed]
    results, noise = {}, None
    for be, graphs, dtype in cands:
        key = f"{be}/{str(dtype)[6:]}" + ("/graphs" if graphs else "")
        eng = Run(ctx.device, dtype, be, graphs).engine(ctx.root, shape, ctx.streams, **fields)
        toks, logits = _generate(eng, prompts, n, forced=ref_t)
        res = _forced_metrics(logits, ref_l, toks, ref_t)
        if key == "torch/bfloat16":
            noise = res["max_abs_err"]
        free, _ = _generate(eng, prompts, n)
        res["greedy"] = _greedy_metrics(free, ref_t, ref_l, noise if dtype == bf16 else None)
        res["engine"] = runner_info(eng)
        rel_tol = 1e-4 if dtype == f32 else max(3 * results.get("torch/bfloat16", res)["decode_rel_err_max"] or 0, 1e-2)
        res["ok"] = (res["sampled_is_argmax"] and res["greedy"]["unexplained"] == 0
                     and max(res["first_step_rel_err"], res["decode_rel_err_max"] or 0) <= rel_tol)
        results[key] = res
        ctx.put("candidates", results)
        del eng
    ctx.put("bf16_noise_abs", noise)
    ctx.put("ok", all(r["ok"] for r in results.values()))
