"""Decode throughput: this engine against HF `generate`, side by side in one process.

    python -m bench.engine_vs_hf                       # SmolLM2-135M; batches 1,8,32; 128 new tokens; fp32 and bf16
    python -m bench.engine_vs_hf --model smollm2-135m,gemma3-270m --quick --dtypes fp32   # a table per model
    python -m bench.engine_vs_hf --quick               # batches 1,8; 32 new tokens; one repeat
    python -m bench.engine_vs_hf --batches 1,32 --dtypes bf16 --repeats 5 --threads 1
    python -m bench.engine_vs_hf --threads 2,1        # one table per intra-op thread count

What is measured, per (dtype, batch), on the same prompts (real text through the chat template,
lengths spread over 20..400 tokens) with greedy decoding and EOS ignored on both sides:
  * end-to-end output tokens/s: batch * new_tokens / wall time of the whole call, prefill included
    (HF: one `model.generate`; engine: `Engine.generate`).
  * decode-only tokens/s: tokens produced by steps that compute no prompt token, over their time.
    HF: timestamps from a no-op stopping criterion (called once per generated token), from the
    first token to the last; engine: its steps that carry no prefill chunk.
HF batches the way it is designed to: a left-padded batch with an attention mask, `use_cache=True`,
eval mode, `torch.inference_mode`, its default (SDPA) attention, the same intra-op thread count.
The engine does not pad: it schedules the prompts with continuous batching and chunked prefill.

Both systems run interleaved (HF, engine, then engine, HF on the next repeat) so load from other
processes hits them alike; medians over repeats are reported, with the machine's load average.
On a shared machine, intra-op parallelism is fragile: an OpenMP team waits for a descheduled
thread at every parallel region (measured: 4-12 ms per region when another process holds a
core), which is why `--threads 2,1` gives a second table at one thread.
A memory-bandwidth floor (weight bytes per decode step / measured copy bandwidth) puts batch-1
step times in perspective.

Writes bench/results/engine_vs_hf.json (every figure, machine facts) and its tables beside it (--md).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file, not only as `python -m bench.engine_vs_hf`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import RESULTS, commas, machine

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_LEN, MAX_LEN = 20, 400  # prompt tokens, chat template included


# -- prompts ------------------------------------------------------------------------------------
_TEXT_MODULES = ("argparse", "asyncio", "collections", "contextlib", "dataclasses", "functools", "itertools",
                 "json", "logging", "pathlib", "re", "subprocess", "threading", "unittest", "inspect",
                 "pickle", "random", "statistics", "textwrap", "zipfile", "tarfile", "decimal", "heapq",
                 "shutil", "socket", "email.message", "http.client", "urllib.parse", "string", "datetime")


@functools.lru_cache(maxsize=1)
def _corpus() -> str:
    """Real English prose, offline and identical everywhere: the standard library's docstrings."""
    parts = []
    for name in _TEXT_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [getattr(mod, a, None) for a in sorted(dir(mod)) if not a.startswith("_")]
        docs = [getattr(o, "__doc__", None) for o in objs if o is mod or callable(o)]
        parts += [" ".join(d.split()) for d in docs if isinstance(d, str) and len(d) > 200]
    return "\n\n".join(dict.fromkeys(parts))  # de-duplicated, order kept


def prompt_lengths(batch: int, lo: int = MIN_LEN, hi: int = MAX_LEN) -> list[int]:
    if batch == 1:
        return [(lo + hi) // 2]
    lens = [round(lo + i * (hi - lo) / (batch - 1)) for i in range(batch)]
    random.Random(batch).shuffle(lens)  # arrival order should not be sorted by length
    return lens


def build_prompts(tok, batch: int) -> list[list[int]]:
    """`batch` chat prompts of real text whose token counts spread evenly over [MIN_LEN, MAX_LEN]
    (from just above the chat template's own length if that is longer: SmolLM2's adds a system turn)."""
    text_ids = tok.encode(_corpus(), add_special_tokens=False)

    def chat(text: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "user", "content": "Summarize this text.\n\n" + text}],
                                      add_generation_prompt=True)
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    overhead = len(chat(""))
    out, off = [], 0
    for n in prompt_lengths(batch, max(MIN_LEN, overhead + 8), MAX_LEN):
        want = max(1, n - overhead)
        ids = chat(tok.decode(text_ids[off:off + want]))
        while len(ids) > n and want > 1:  # re-tokenising may merge differently: trim to fit
            want -= 1
            ids = chat(tok.decode(text_ids[off:off + want]))
        out.append(ids)
        off = (off + 997 * (want + 1)) % max(1, len(text_ids) - MAX_LEN)  # different text per prompt
    return out


# -- the two systems ------------------------------------------------------------------------------
class _Stamp:
    """A stopping criterion that never stops and records when each token was produced."""

    def __init__(self) -> None:
        self.t: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.t.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def run_hf(model, tok, prompts: list[list[int]], new_tokens: int) -> dict:
    import transformers
    enc = tok.pad({"input_ids": prompts}, padding=True, return_tensors="pt")  # left padding (set on tok)
    stamp = _Stamp()
    crit = transformers.StoppingCriteriaList([stamp])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                             max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                             pad_token_id=tok.pad_token_id, stopping_criteria=crit)
    wall = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1]:]
    assert gen.shape[1] == new_tokens, gen.shape
    b = len(prompts)
    dec_time = stamp.t[-1] - stamp.t[0]
    return dict(wall_s=wall, prefill_s=stamp.t[0] - t0, decode_s=dec_time,
                decode_tokens=b * (new_tokens - 1), tokens=gen.tolist())


def run_engine(eng, prompts: list[list[int]], new_tokens: int) -> dict:
    steps: list[tuple[float, int, int]] = []  # (seconds, prompt tokens computed, decode tokens computed)
    inner = eng.step

    def timed_step():
        pre, dec = eng.stats.num_prefill_tokens, eng.stats.num_decode_tokens
        t = time.perf_counter()
        done = inner()
        dt = time.perf_counter() - t
        steps.append((dt, eng.stats.num_prefill_tokens - pre, eng.stats.num_decode_tokens - dec))
        return done

    eng.step = timed_step  # Engine.generate calls self.step(): time each step without changing it
    try:
        t0 = time.perf_counter()
        outs = eng.generate(prompts, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        wall = time.perf_counter() - t0
    finally:
        del eng.step
    assert all(len(o.token_ids) == new_tokens for o in outs)
    pure = [(dt, dec) for dt, pre, dec in steps if pre == 0]  # steps that carry no prompt chunk
    return dict(wall_s=wall, prefill_s=sum(dt for dt, pre, _ in steps if pre > 0), decode_s=sum(dt for dt, _ in pure),
                decode_tokens=sum(dec for _, dec in pure), steps=len(steps), tokens=[o.token_ids for o in outs])


# -- the memory-bandwidth floor ----------------------------------------------------------------------------------------
def bandwidth(threads: int, mib: int = 512, reps: int = 9) -> dict:
    """Copy (read + write counted) and read-only bandwidth in GB/s, medians of `reps`."""
    torch.set_num_threads(threads)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    b.copy_(a)  # fault the pages in
    copy, read = [], []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        copy.append(2 * a.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        a.sum()
        read.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    out = dict(torch_copy_GBps=statistics.median(copy), torch_read_GBps=statistics.median(read), buffer_MiB=mib)
    try:
        import numpy as np
        x = np.ones(mib * 2**20 // 8)
        y = np.empty_like(x)
        np.copyto(y, x)
        nc = []
        for _ in range(reps):
            t = time.perf_counter()
            np.copyto(y, x)
            nc.append(2 * x.nbytes / (time.perf_counter() - t) / 1e9)
        out["numpy_copy_GBps"] = statistics.median(nc)  # numpy copies on one thread
    except ImportError:
        pass
    # Load from other processes only ever lowers a reading: the floor uses the best copy figure
    out["copy_GBps"] = max(out["torch_copy_GBps"], out.get("numpy_copy_GBps", 0.0))
    return out


def weight_bytes(model_path: Path, dtype: torch.dtype) -> dict:
    """Bytes of weights read per decode step: every parameter once (a tied lm_head is the embedding)."""
    from engines.config import ModelConfig
    c = ModelConfig.from_dir(model_path)
    d, h, hkv, i = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
    per_layer = d * (h + 2 * hkv) * c.head_dim + h * c.head_dim * d + 3 * d * i + 2 * d
    params = c.num_hidden_layers * per_layer + c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + d
    elt = torch.empty((), dtype=dtype).element_size()
    return dict(params=params, bytes=params * elt)


# -- report ----------------------------------------------------------------------------------------
def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(runs: list[dict], b: int, new_tokens: int) -> dict:
    e2e = [b * new_tokens / r["wall_s"] for r in runs]
    dec = [r["decode_tokens"] / r["decode_s"] for r in runs if r["decode_s"] > 0]
    step = [r["decode_s"] / (r["decode_tokens"] / b) for r in runs if r["decode_tokens"]]  # exact at batch 1
    return dict(e2e_tok_s=_med(e2e), decode_tok_s=_med(dec), decode_step_ms=1e3 * _med(step),
                prefill_s=_med([r["prefill_s"] for r in runs]), wall_s=_med([r["wall_s"] for r in runs]),
                e2e_tok_s_all=e2e, decode_tok_s_all=dec, load_1min_all=[r["load_1min"] for r in runs])


def markdown(res: dict) -> str:
    m = res["machine"]
    lo = min(min(v) for v in res["prompt_lengths"].values())
    hi = max(max(v) for v in res["prompt_lengths"].values())
    lines = [
        f"## Engine vs HF `generate` ({', '.join(Path(p).name for p in res['models'])}, CPU)",
        "",
        f"{m['cpu']} ({'with' if m['avx512_bf16'] else 'without'} avx512_bf16), {m['cores']} cores; "
        f"torch {m['torch']}, transformers {m['transformers']}; commit `{m['commit'][:10]}`"
        + (" + uncommitted changes" if m.get("uncommitted") else "") + ". "
        f"{res['new_tokens']} new tokens per request, greedy, EOS ignored; prompts {lo}-{hi} tokens of real text "
        f"through the chat template (HF: one left-padded batch with its attention mask; engine: unpadded, continuous "
        f"batching, chunked prefill); medians of {res['repeats']} repeats, HF and engine interleaved. "
        "End-to-end tok/s = batch x new tokens / wall time of the whole call, prefill included. Decode tok/s "
        "excludes prefill: HF from its first generated token to its last; engine over its steps that carry no "
        "prompt chunk. Prefill s: HF's time to first token; engine's time in steps that carry prompt chunks.",
    ]
    for sec in res["sections"]:
        la, bw = sec["load_average"], sec["bandwidth"]
        lines += ["", f"### {Path(sec['model']).name}: {sec['threads']} intra-op thread(s), both systems", "",
                  f"Load average (1/5/15 min) {la['start'][0]:.2f}/{la['start'][1]:.2f}/{la['start'][2]:.2f} at start, "
                  f"{la['end'][0]:.2f}/{la['end'][1]:.2f}/{la['end'][2]:.2f} at end.", "",
                  "| dtype | batch | HF tok/s | engine tok/s | engine/HF | HF decode tok/s | engine decode tok/s | "
                  "engine/HF decode | HF prefill s | engine prefill s | same tokens as HF |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sec["rows"]:
            h, e = r["hf"], r["engine"]
            lines.append(f"| {r['dtype']} | {r['batch']} | {h['e2e_tok_s']:.1f} | {e['e2e_tok_s']:.1f} | "
                         f"**{r['ratio_e2e']:.2f}x** | {h['decode_tok_s']:.1f} | {e['decode_tok_s']:.1f} | "
                         f"{r['ratio_decode']:.2f}x | {h['prefill_s']:.2f} | {e['prefill_s']:.2f} | "
                         f"{r['same_tokens_as_hf']}/{r['batch']} |")
        lines += ["", "Per-repeat engine/HF end-to-end ratios (min..max): " + "; ".join(
            f"{r['dtype']} b{r['batch']} {min(r['ratio_e2e_all']):.2f}..{max(r['ratio_e2e_all']):.2f}"
            for r in sec["rows"]) + "."]
        bws, bwe = sec["bandwidth_start"]["copy_GBps"], sec["bandwidth_end"]["copy_GBps"]
        lines += ["", f"Memory-bandwidth floor at batch 1: copy bandwidth {bw['copy_GBps']:.1f} GB/s, the better of "
                  f"torch `copy_` at {sec['threads']} thread(s) ({bw['torch_copy_GBps']:.1f}) and numpy `copyto` "
                  f"(1 thread, {bw.get('numpy_copy_GBps', float('nan')):.1f}); {bw['buffer_MiB']} MiB buffers, "
                  f"read+write counted, medians of 9, measured at start ({bws:.1f}) and end ({bwe:.1f}) with the "
                  f"better kept; torch read-only {bw['torch_read_GBps']:.1f} GB/s. Weight bytes per decode step: every "
                  "parameter read once (the tied lm_head is the embedding); floor = bytes / bandwidth; "
                  "% of floor = floor / measured batch-1 decode step.", "",
                  "| dtype | weight bytes/step | floor ms/step | HF ms/step | engine ms/step | HF % of floor | "
                  "engine % of floor |", "|---|---:|---:|---:|---:|---:|---:|"]
        for f in sec["floor"]:
            lines.append(f"| {f['dtype']} | {f['weight_bytes'] / 1e6:.0f} MB | {f['floor_ms']:.2f} | "
                         f"{f['hf_step_ms']:.2f} | {f['engine_step_ms']:.2f} | {100 * f['hf_fraction']:.0f}% | "
                         f"{100 * f['engine_fraction']:.0f}% |")
        lines += ["", "Targets (engine >= HF at batch 1, >= 2x HF end-to-end at batch 32): " + "; ".join(
            f"{r['dtype']} b{r['batch']} {'met' if r['target_met'] else 'MISSED'}"
            for r in sec["rows"] if r["target"]) + "."]
    return "\n".join(lines) + "\n"


def run_section(threads: int, path: Path, tok, prompts: dict, dtypes: list[str], args, pbar) -> dict:
    """Every (dtype, batch) for both systems at one intra-op thread count."""
    import transformers

    from engines import Engine
    torch.set_num_threads(threads)
    batches = list(prompts)
    sec: dict = dict(threads=threads, load_average=dict(start=os.getloadavg()), bandwidth_start=bandwidth(threads),
                     rows=[], floor=[])
    torch.set_num_threads(threads)
    max_b, max_len = max(batches), max(len(p) for ps in prompts.values() for p in ps)
    for dname in dtypes:
        dt = DTYPES[dname]
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).eval()
        hf.generation_config.eos_token_id = None  # ignore EOS, like the engine's ignore_eos
        eng = Engine.from_pretrained(path, dtype=dt, enable_prefix_caching=False,  # HF has no prefix cache
                                     num_kv_tokens=max_b * (max_len + args.new_tokens + 16),
                                     max_num_seqs=max(64, max_b))
        # warm both (allocator, oneDNN kernels, KV pages) at the largest batch, a few tokens
        pbar.set_postfix_str(f"t{threads} {dname} warm-up")
        run_hf(hf, tok, prompts[max_b], 4)
        run_engine(eng, prompts[max_b], 4)
        runs: dict = {(b, s): [] for b in batches for s in ("hf", "engine")}
        for rep in range(args.repeats):
            for b in batches:
                for system in (("hf", "engine") if rep % 2 == 0 else ("engine", "hf")):
                    pbar.set_postfix_str(f"t{threads} {dname} b{b} {system} #{rep + 1}")
                    r = (run_hf(hf, tok, prompts[b], args.new_tokens) if system == "hf"
                         else run_engine(eng, prompts[b], args.new_tokens))
                    r["load_1min"] = os.getloadavg()[0]
                    runs[(b, system)].append(r)
                    pbar.update(1)
        for b in batches:
            hr, er = runs[(b, "hf")], runs[(b, "engine")]
            h, e = summarize(hr, b, args.new_tokens), summarize(er, b, args.new_tokens)
            target = 1.0 if b == 1 else (2.0 if b == 32 else None)
            sec["rows"].append(dict(
                dtype=dname, batch=b, hf=h, engine=e, ratio_e2e=e["e2e_tok_s"] / h["e2e_tok_s"],
                ratio_decode=e["decode_tok_s"] / h["decode_tok_s"],
                ratio_e2e_all=[x["wall_s"] / y["wall_s"] for x, y in zip(hr, er)],  # per repeat
                target=target, target_met=None if target is None else e["e2e_tok_s"] / h["e2e_tok_s"] >= target,
                same_tokens_as_hf=sum(x == y for x, y in zip(hr[-1]["tokens"], er[-1]["tokens"])),
                engine_steps=er[-1]["steps"]))
            if b == 1:  # the floor itself is filled in at the end, with the best bandwidth reading
                wb = weight_bytes(path, dt)
                sec["floor"].append(dict(dtype=dname, weight_params=wb["params"], weight_bytes=wb["bytes"],
                                         hf_step_ms=h["decode_step_ms"], engine_step_ms=e["decode_step_ms"]))
        del hf, eng
    sec["load_average"]["end"] = os.getloadavg()
    # Other processes can only lower a bandwidth reading: measure again at the end, keep the better
    sec["bandwidth_end"] = bandwidth(threads)
    sec["bandwidth"] = max(sec["bandwidth_start"], sec["bandwidth_end"], key=lambda x: x["copy_GBps"])
    for f in sec["floor"]:
        f["floor_ms"] = 1e3 * f["weight_bytes"] / (sec["bandwidth"]["copy_GBps"] * 1e9)
        f["hf_fraction"] = f["floor_ms"] / f["hf_step_ms"]
        f["engine_fraction"] = f["floor_ms"] / f["engine_step_ms"]
    return sec


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default=str(torch.get_num_threads()),
                    help="intra-op thread count(s) for both systems, e.g. 2 or 2,1 (one table each)")
    ap.add_argument("--quick", action="store_true", help="batches 1,8; 32 new tokens; 1 repeat")
    ap.add_argument("--model", default="smollm2-135m",
                    help="HF model dir(s) or known model name(s), comma-separated: a table each")
    ap.add_argument("--out", default=str(RESULTS / "engine_vs_hf.json"))
    ap.add_argument("--md", default=None, help="tables file (default: the --out JSON's name, .md)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.new_tokens, args.repeats = "1,8", 32, 1
    batches, threads, dtypes = commas(args.batches, int), commas(args.threads, int), commas(args.dtypes, allowed=DTYPES)

    import transformers
    from tqdm.auto import tqdm

    from engines.known_models import resolve_model_path
    transformers.logging.set_verbosity_error()
    paths = [Path(resolve_model_path(m.strip())) for m in args.model.split(",")]
    res: dict = dict(models=[str(p) for p in paths], new_tokens=args.new_tokens, repeats=args.repeats,
                     batches=batches, prompt_lengths={}, machine={**machine(), "transformers": transformers.__version__},
                     sections=[])
    pbar = tqdm(total=len(paths) * len(threads) * len(dtypes) * len(batches) * args.repeats * 2,
                desc="engine vs HF", unit="run")
    for path in paths:
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        prompts = {b: build_prompts(tok, b) for b in batches}
        res["prompt_lengths"].update({f"{path.name} b{b}": [len(p) for p in ps] for b, ps in prompts.items()})
        for t in threads:
            res["sections"].append({"model": str(path), **run_section(t, path, tok, prompts, dtypes, args, pbar)})
    pbar.close()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res)
    md_path = Path(args.md) if args.md else Path(args.out).with_suffix(".md")
    md_path.write_text(md)
    print(md)
    print(f"wrote {args.out} and {md_path}")
    return res


if __name__ == "__main__":
    main()
