"""The default pair (engines.known_models.default_pair): how cheap the small model's steps are,
how well it agrees with the large model, and how the pair routes and answers, in one invocation.

1. Step cost: decode steps of each small candidate against the large model (SmolLM2-135M-Instruct,
   fp32, de-quantized from the wheel's Q4_1 GGUF) at batch 1 and 16 on the questions' own
   contexts. Threads: the serving plan (aiorouter.cpu_threads.plan_threads: the heavier model gets
   every core, the other 1) and equal threads (1 and 1, 2 and 2). A step's cost is the difference
   of two `Engine.generate` calls (1 and 1 + n new tokens, EOS ignored, prompts already in the
   prefix cache) over n; candidates and settings interleaved, medians over rounds.
2. Agreement: teacher-forced greedy top-1 agreement with the large model along its own answers,
   and each small model's answers alone against the large model's.
3. Routing: the questions through `Router` with the pair, per policy setting: the small model's
   share of completion tokens; answers equal to the large model alone (exact token match); and
   "equally correct": the pair's answer contains an expected keyword exactly when the large
   model's does.

    python -m bench.default_pair [--rounds 3] [--taus 0.1,0.2,0.25,0.275,0.3,0.35,0.4] [--quick]
    python -m bench.default_pair kernels [--reps 5]

`kernels`: what the step cost is made of, torch's weight-only int4 / int8 CPU kernels
(engines/quant.py) against the oneDNN-packed fp32 Linear (engines/model.Linear), on SmolLM2-135M's
layer shapes, at 1, 2, 3, 4, 8 and 16 rows, 1 thread. Each layer is built in enough copies to pass
64 MB of fp32 weights and the calls cycle through them, so no weight is in cache when it is read,
as in a decode step of the whole model. Total = 30 layers of each decoder shape plus the head, per
step. Methods: fp32 (oneDNN, packed); int4 (QuantLinear: torch's kernel up to its kernel_rows, the
AMX kernel or bf16 copy above); int4-kernel (`_weight_int4pack_mm_for_cpu` alone, bf16
activations, groups of 32); int4-amx (the project's AMX kernel alone,
engines/csrc/int4_linear_cpu.cpp; where the CPU has AMX-BF16); bf16 (the oneDNN-packed bf16
Linear: what AVX512-BF16 dot products cost, the floor of a weight-only kernel whose activations
stay 16-bit); int8 (`_weight_int8pack_mm`, bf16 activations); w8a8 (`torch._int_mm`, int8
activations per token); int4 on fp32 activations, the kernel's scalar path, at 1 row only; and,
not used by the engine, fbgemm (torch's dynamic int8 linear, VNNI, the rows scaled to [-1, 1]
first so its one input scale acts per token: the cheapest int8 GEMM torch has on CPU, but int8
activations cost SmolLM2 agreement).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiorouter import Router, RouterConfig
from aiorouter.cpu_threads import plan_threads
from bench.common import OutsideLoad, commas, subcommands, write_json
from engines import Engine, EngineConfig, cpu_kernels
from engines.default_model import truncated_model_path
from engines.known_models import default_pair
from engines.model import Linear
from engines.quant import QuantLinear
from engines.quant_formats import quantize_int8

# (question, words of which one must appear in a correct answer), lower case
FACTUAL_QUESTIONS: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("paris",)), ("What is the capital of Japan?", ("tokyo",)),
    ("What is the capital of Italy?", ("rome",)), ("What is the capital of Germany?", ("berlin",)),
    ("What is the capital of Spain?", ("madrid",)),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Which planet is known as the Red Planet?", ("mars",)), ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("What is the chemical formula of water?", ("h2o", "h₂o")),
    ("How many days are there in a week?", ("seven", "7")),
    ("At what temperature in degrees Celsius does water boil at sea level?", ("100",)),
    ("What is the largest ocean on Earth?", ("pacific",)), ("Who painted the Mona Lisa?", ("leonardo", "da vinci")),
    ("Which gas do plants absorb from the air for photosynthesis?", ("carbon dioxide", "co2")),
    ("How many legs does a spider have?", ("eight", "8")),
    ("What is the tallest mountain in the world?", ("everest",)),
    ("Which animal is known as the king of the jungle?", ("lion",)), ("What is the square root of 16?", ("4", "four")),
    ("What language is spoken in Brazil?", ("portuguese",)), ("What is the currency of the United States?", ("dollar",)),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("Who was the first president of the United States?", ("washington",)),
    ("What is the largest mammal in the world?", ("whale",)), ("What color is the sky on a clear day?", ("blue",)),
]


def correct(text: str, keywords: tuple[str, ...]) -> bool:
    return any(k in text.lower() for k in keywords)


def candidates(quick: bool) -> dict[str, dict]:
    """Small-model candidates: Engine keyword arguments. The first is the default."""
    pair = default_pair()
    out = {"int4": {"model_path": pair["small"]},
           "int8": {"model_path": pair["large"], "config": EngineConfig(quantization="int8")},
           "bf16": {"model_path": pair["large"], "dtype": "bfloat16"},
           "first10 (old default)": {"model_path": truncated_model_path(pair["large"], 10)}}
    return dict(list(out.items())[:2]) if quick else out


def chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def decode_ms(eng: Engine, prompts: list[list[int]], batch: int, n: int) -> tuple[float, float]:
    """One decode step at `batch` -> (wall ms, this thread's CPU ms), from two generate calls whose
    prompts the prefix cache holds. The CPU time is the whole step's when torch runs 1 thread
    (its intra-op work then runs inline): it leaves out the time other processes take the core."""
    ps = [prompts[i % len(prompts)] for i in range(batch)]
    eng.generate(ps, max_tokens=1, temperature=0.0, ignore_eos=True)  # fills the prefix cache
    marks = []
    for tokens in (1, 1 + n):
        marks.append((time.perf_counter(), time.thread_time()))
        eng.generate(ps, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    marks.append((time.perf_counter(), time.thread_time()))
    (w0, c0), (w1, c1), (w2, c2) = marks
    return ((w2 - w1) - (w1 - w0)) / n * 1e3, ((c2 - c1) - (c1 - c0)) / n * 1e3


def step_costs(engines: dict[str, Engine], prompts, batches, rounds: int, n: int) -> dict:
    """engines: the large model first, then the small candidates. -> {setting: {batch: {small:
    {threads, large_ms, small_ms, ratio[, cpu ...]}}}}: medians over rounds, all interleaved."""
    (large, *smalls) = engines
    plan = {s: plan_threads([engines[large].num_params, engines[s].num_params]) for s in smalls}
    settings = {"plan": plan, "equal-1": {s: [1, 1] for s in smalls}, "equal-2": {s: [2, 2] for s in smalls}}
    samples: dict[tuple[str, int, int], list[tuple[float, float]]] = {}  # (model, threads, batch)

    def sample(name: str, threads: int, b: int) -> None:
        torch.set_num_threads(threads)
        samples.setdefault((name, threads, b), []).append(decode_ms(engines[name], prompts, b, n))

    for _ in range(rounds):
        for b in batches:
            for tl in sorted({th[0] for per in settings.values() for th in per.values()}):
                sample(large, tl, b)
            for s in smalls:
                for ts in sorted({per[s][1] for per in settings.values()}):
                    sample(s, ts, b)
    wall = {k: statistics.median(w for w, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    out: dict = {}
    for key, per in settings.items():
        for b in batches:
            for s in smalls:
                tl, ts = per[s]
                lg, sm = wall[(large, tl, b)], wall[(s, ts, b)]
                row = {"threads": {"large": tl, "small": ts}, "large_ms": round(lg, 2), "small_ms": round(sm, 2),
                       "ratio": round(sm / lg, 3)}
                if tl == ts == 1:
                    lc, sc = cpu[(large, 1, b)], cpu[(s, 1, b)]
                    row.update(large_cpu_ms=round(lc, 2), small_cpu_ms=round(sc, 2), cpu_ratio=round(sc / lc, 3))
                out.setdefault(key, {}).setdefault(str(b), {})[s] = row
    return out


def forced_agreement(eng: Engine, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Share of the large model's answer tokens that `eng` predicts greedily from the same prefix."""
    cases = [(p + a[:j], a[j]) for p, a in zip(prompts, answers) for j in range(len(a))]
    outs = eng.generate([c for c, _ in cases], max_tokens=1, temperature=0.0, ignore_eos=True)
    return sum(o.token_ids[0] == t for o, (_, t) in zip(outs, cases)) / max(1, len(cases))


def compare(answers, reference, questions) -> dict:
    """answers / reference: one (text, token ids) per question."""
    n = len(questions)
    exact = sum(a[1] == r[1] for a, r in zip(answers, reference))
    ok = [correct(a[0], kw) for a, (_, kw) in zip(answers, questions)]
    ref_ok = [correct(r[0], kw) for r, (_, kw) in zip(reference, questions)]
    return {"exact_match": round(exact / n, 3), "equally_correct": round(sum(x == y for x, y in zip(ok, ref_ok)) / n, 3),
            "correct": sum(ok), "large_alone_correct": sum(ref_ok), "questions": n}


async def ask(models: dict, policy: str, policy_args: dict, questions, max_tokens: int) -> list:
    """Every question at once through a Router; -> GenerateResult per question."""
    async with Router({k: str(v) for k, v in models.items()}, RouterConfig(policy=policy, policy_args=policy_args,
                      entry=next(iter(models)), thresholds={k: 1 for k in models})) as r:
        return await asyncio.gather(*(r.generate([{"role": "user", "content": q}], max_tokens=max_tokens,
                                                 temperature=0.0) for q, _ in questions))


def routing(pair: dict, settings: list[tuple[str, dict, Path]], questions, max_tokens: int) -> tuple[list, list[dict]]:
    """settings: (policy, args, small model path). -> (the large model's answers alone, one row per setting)."""
    alone = asyncio.run(ask({"large": pair["large"]}, "single", {}, questions, max_tokens))
    ref = [(a.text, a.token_ids) for a in alone]
    rows = []
    for policy, args, small_path in settings:
        res = asyncio.run(ask({"small": small_path, "large": pair["large"]}, policy, args, questions, max_tokens))
        small = sum(a.usage["per_model"]["small"] for a in res)
        total = sum(a.usage["completion_tokens"] for a in res)
        rows.append({"policy": policy, "args": args, "small": Path(small_path).name,
                     "small_share": round(small / max(1, total), 3),
                     "completion_tokens": total, **compare([(a.text, a.token_ids) for a in res], ref, questions),
                     "answers": [a.text for a in res]})
    return ref, rows


def pick(rows: list[dict], min_share: float = 0.5, min_match: float = 0.8) -> dict | None:
    """The rstitch setting with the largest small share among those meeting both targets."""
    ok = [r for r in rows if r["policy"] == "rstitch" and r["small"] == rows[0]["small"]
          and r["small_share"] >= min_share and r["exact_match"] >= min_match]
    return max(ok, key=lambda r: (r["small_share"], r["exact_match"])) if ok else None


def pair_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.default_pair", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="step-cost rounds (medians over them)")
    ap.add_argument("--steps", type=int, default=12, help="decode steps per step-cost sample")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--taus", default="0.1,0.2,0.25,0.275,0.3,0.35,0.4", help="rstitch thresholds to sweep")
    ap.add_argument("--random-p", type=float, default=0.35, help="also route with `random` at this p (0: skip)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="int4 and int8 only, one round, two taus")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.taus = 1, "0.1,0.2"
    questions = FACTUAL_QUESTIONS
    pair = default_pair()
    cands = candidates(args.quick)
    engines = {"large": Engine(pair["large"])}
    engines.update({name: Engine(**kw) for name, kw in cands.items()})
    prompts = [chat_ids(engines["large"].tokenizer, q) for q, _ in questions]
    batches = commas(args.batches, int)

    t0 = time.perf_counter()
    with OutsideLoad() as load:
        costs = step_costs(engines, prompts, batches, args.rounds, args.steps)
    cost_s = time.perf_counter() - t0

    torch.set_num_threads(2)
    large_out = engines["large"].generate(prompts, max_tokens=args.max_tokens, temperature=0.0)
    ref = [(o.text, o.token_ids) for o in large_out]
    agreement = {}
    for name in cands:
        alone = engines[name].generate(prompts, max_tokens=args.max_tokens, temperature=0.0)
        agreement[name] = {"teacher_forced_top1": round(forced_agreement(engines[name], prompts, [o.token_ids for o in large_out]), 3),
                           "alone_vs_large": compare([(o.text, o.token_ids) for o in alone], ref, questions)}
    del engines

    settings = [("rstitch", {"tau": t}, pair["small"]) for t in commas(args.taus, float)]
    if args.random_p:
        settings.append(("random", {"p": args.random_p}, pair["small"]))
    if not args.quick:  # the former default pair and policy, for comparison
        settings.append(("rstitch", {"tau": 0.03}, truncated_model_path(pair["large"], 10)))
    ref_router, rows = routing(pair, settings, questions, args.max_tokens)
    chosen = pick(rows)
    path = write_json("default_pair", {
        "pair": {k: str(v) for k, v in pair.items()}, "questions": [q for q, _ in questions], "max_tokens": args.max_tokens,
        "step_cost": costs, "step_cost_seconds": round(cost_s, 1), "step_cost_outside_load_cores": load.cores,
        "agreement": agreement, "large_alone_answers": [t for t, _ in ref_router], "routing": rows,
        "chosen": None if chosen is None else {"policy": chosen["policy"], "args": chosen["args"]}})
    print(f"step cost, small / large (other processes used {load.cores or 0:.2f} cores meanwhile):")
    print("| setting | batch | " + " | ".join(cands) + " |\n|---|---:|" + "---:|" * len(cands))
    for key, per_b in costs.items():
        for b, per in per_b.items():
            print(f"| {key} | {b} | " + " | ".join(f"{v['small_ms']:.1f}/{v['large_ms']:.1f} ms = {v['ratio']:.2f}"
                                                   for v in per.values()) + " |")
            if key == "equal-1":
                print(f"| equal-1, CPU time | {b} | " + " | ".join(
                    f"{v['small_cpu_ms']:.1f}/{v['large_cpu_ms']:.1f} ms = {v['cpu_ratio']:.2f}" for v in per.values()) + " |")
    print("\n| candidate | top-1 agreement | alone: exact | alone: equally correct |\n|---|---:|---:|---:|")
    for name, a in agreement.items():
        print(f"| {name} | {a['teacher_forced_top1']:.3f} | {a['alone_vs_large']['exact_match']:.2f} | "
              f"{a['alone_vs_large']['equally_correct']:.2f} |")
    print("\n| small | policy | small share | exact match | equally correct | correct (large alone) |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['small']} | {r['policy']} {r['args']} | {r['small_share']:.2f} | {r['exact_match']:.2f} | {r['equally_correct']:.2f} | "
              f"{r['correct']} ({r['large_alone_correct']}) |")
    print(f"\nchosen: {None if chosen is None else (chosen['policy'], chosen['args'])}\nwrote {path}")
    return 0


# -- kernels: one step's linears per int4 / int8 kernel -----------------------------------------------
SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}  # [out, in]
PER_STEP = {"qkv_proj": 30, "o_proj": 30, "gate_up_proj": 30, "down_proj": 30, "lm_head": 1}


class _Int4Kernel(torch.nn.Module):
    """The int4 kernel alone at every row count (QuantLinear hands more than INT4_MAX_ROWS rows to
    its bf16 copy), on bf16 activations, or on fp32 ones and scales (what a float32 model would
    hand it: the kernel's scalar path)."""

    def __init__(self, q: QuantLinear, fp32: bool):
        super().__init__()
        self.q, self.fp32, self.sz = q, fp32, q.scales.float() if fp32 else q.scales

    def forward(self, x):
        a = x if self.fp32 else x.to(torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.q.qweight, self.q.group_size, self.sz).float()


class _Int4Amx(torch.nn.Module):
    """The AMX int4 kernel (engines/csrc/int4_linear_cpu.cpp) alone at every row count
    (QuantLinear hands it more than INT4_AMX_MAX_ROWS rows)."""

    def __init__(self, q: QuantLinear):
        super().__init__()
        if q.codes is None:
            raise RuntimeError("this CPU (or build) has no AMX int4 kernel")
        self.q = q

    def forward(self, x):  # x [T, in] fp32 -> [T, out] fp32
        return torch.ops.aiorouter_cpu.int4_linear(x, self.q.codes, self.q.block_scales, self.q.group_size)


class _Bf16(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.lin = Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
        self.lin.weight.data.copy_(w)
        if not self.lin.pack():
            raise RuntimeError("oneDNN cannot pack a bf16 weight on this CPU")

    def forward(self, x):  # x [T, in] fp32 -> [T, out] fp32
        return self.lin(x.to(torch.bfloat16)).float()


class _Fbgemm(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        q, s = quantize_int8(w)
        with warnings.catch_warnings():  # torch 2.13 warns that quantized tensors are deprecated
            warnings.simplefilter("ignore", UserWarning)
            qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros(len(s), dtype=torch.long), 0)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)

    def forward(self, x):  # x [T, in] -> [T, out]
        xs = x.abs().amax(-1, keepdim=True).clamp_min_(1e-12)  # [T, 1]
        return torch.ops.quantized.linear_dynamic(x / xs, self.packed, True).mul_(xs)


def layers(method: str, N: int, K: int, copies: int) -> list[torch.nn.Module]:
    out = []
    for i in range(copies):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(i)) * 0.05
        if method == "fp32":
            lin = Linear(K, N, bias=False)
            lin.weight.data.copy_(w)
            lin.pack()
            out.append(lin)
        elif method in ("bf16", "fbgemm"):
            out.append(_Bf16(w) if method == "bf16" else _Fbgemm(w))
        else:
            q = QuantLinear(w, None, "int4" if method.startswith("int4") else method)
            out.append(_Int4Amx(q) if method == "int4-amx" else
                       _Int4Kernel(q, method == "int4-fp32act") if method.startswith("int4-") else q)
    return out


@torch.inference_mode()
def time_us(mods: list[torch.nn.Module], x: torch.Tensor, reps: int) -> float:
    for m in mods:
        m(x)
    best = []
    for _ in range(reps):
        t = time.perf_counter()
        for m in mods:
            m(x)
        best.append((time.perf_counter() - t) / len(mods))
    return statistics.median(best) * 1e6


def kernels(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.default_pair kernels", description="one step's linears per "
                                 "int4 / int8 kernel, 1 to 16 rows, 1 thread (this module's docstring says which)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    methods = ["fp32", "int4", "int4-kernel", "int4-amx", "bf16", "int8", "w8a8", "fbgemm", "int4-fp32act"]
    if not cpu_kernels.int4_amx_available():
        methods.remove("int4-amx")
    # 2-8: where torch's int4 kernel crosses bf16 (INT4_MAX_ROWS) and the AMX kernel (INT4_AMX_MAX_ROWS)
    rows = (1, 2, 3, 4, 8, 16)
    crossing = ("int4-kernel", "int4-amx", "bf16")
    res: dict = {}
    with OutsideLoad() as load:
        for name, (N, K) in SHAPES.items():
            copies = max(2, -(-64 * 2**20 // (N * K * 4)))
            for method in methods:
                mods = layers(method, N, K, copies if method != "int4-fp32act" else 2)
                for M in rows:
                    if (method == "int4-fp32act" and M > 1) or (M in (2, 3, 4, 8) and method not in crossing):
                        continue
                    x = torch.randn(M, K)
                    res.setdefault(name, {}).setdefault(str(M), {})[method] = round(time_us(mods, x, args.reps), 1)
                del mods
    totals = {str(M): {m: round(sum(res[n][str(M)][m] * PER_STEP[n] for n in SHAPES) / 1e3, 2)
                       for m in methods if m in res["o_proj"][str(M)]} for M in rows}
    path = write_json("quant_kernels", {"threads": 1, "us_per_call": res, "ms_per_step": totals,
                                        "outside_load_cores": load.cores})
    print(f"us per call, 1 thread (other processes used {load.cores or 0:.2f} cores meanwhile)")
    print("| layer [out, in] | rows | " + " | ".join(methods) + " |\n|---|---:|" + "---:|" * len(methods))
    for name, per_m in res.items():
        for M, r in per_m.items():
            print(f"| {name} {list(SHAPES[name])} | {M} | " + " | ".join(str(r.get(m, "-")) for m in methods) + " |")
    for M, t in totals.items():
        print(f"| **a step's linears (ms)** | {M} | " + " | ".join(str(t.get(m, "-")) for m in methods) + " |")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return subcommands(argv, pair_main, kernels=kernels)


if __name__ == "__main__":
    raise SystemExit(main())
