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

    python bench/default_pair.py [--rounds 3] [--taus 0.1,0.2,0.25,0.275,0.3,0.35,0.4] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from aiorouter import Router, RouterConfig
from aiorouter.cpu_threads import plan_threads
from bench.common import OutsideLoad, write_json
from engines import Engine, EngineConfig
from engines.default_model import truncated_model_path
from engines.known_models import default_pair

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


def breakdown(eng: Engine, prompts: list[list[int]], batch: int, n: int = 4) -> dict[str, float]:
    """Where one thread's decode step goes: ms per step in linear layers, attention and the rest."""
    groups = {"linear": ("mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm_for_cpu", "aiorouter_cpu::int4_linear", "aten::_int_mm",
                         "aten::_weight_int8pack_mm", "aten::addmm", "aten::mm"),
              "attention": ("aiorouter_cpu::paged_attention",)}
    torch.set_num_threads(1)
    ps = [prompts[i % len(prompts)] for i in range(batch)]
    eng.generate(ps, max_tokens=1, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        eng.generate(ps, max_tokens=1 + n, temperature=0.0, ignore_eos=True)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    out = {g: sum(e.self_cpu_time_total for e in ev if e.key in names) for g, names in groups.items()}
    out["other"] = total - sum(out.values())
    return {g: round(v / 1e3 / (1 + n), 2) for g, v in out.items()}  # ms per step (prefill step included)


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    batches = [int(b) for b in args.batches.split(",")]

    t0 = time.perf_counter()
    with OutsideLoad() as load:
        costs = step_costs(engines, prompts, batches, args.rounds, args.steps)
    cost_s = time.perf_counter() - t0
    split = {name: {str(b): breakdown(engines[name], prompts, b) for b in batches} for name in ("large", next(iter(cands)))}

    torch.set_num_threads(2)
    large_out = engines["large"].generate(prompts, max_tokens=args.max_tokens, temperature=0.0)
    ref = [(o.text, o.token_ids) for o in large_out]
    agreement = {}
    for name in cands:
        alone = engines[name].generate(prompts, max_tokens=args.max_tokens, temperature=0.0)
        agreement[name] = {"teacher_forced_top1": round(forced_agreement(engines[name], prompts, [o.token_ids for o in large_out]), 3),
                           "alone_vs_large": compare([(o.text, o.token_ids) for o in alone], ref, questions)}
    del engines

    settings = [("rstitch", {"tau": float(t)}, pair["small"]) for t in args.taus.split(",")]
    if args.random_p:
        settings.append(("random", {"p": args.random_p}, pair["small"]))
    if not args.quick:  # the former default pair and policy, for comparison
        settings.append(("rstitch", {"tau": 0.03}, truncated_model_path(pair["large"], 10)))
    ref_router, rows = routing(pair, settings, questions, args.max_tokens)
    chosen = pick(rows)
    path = write_json("default_pair", {
        "pair": {k: str(v) for k, v in pair.items()}, "questions": [q for q, _ in questions], "max_tokens": args.max_tokens,
        "step_cost": costs, "step_cost_seconds": round(cost_s, 1), "step_cost_outside_load_cores": load.cores,
        "step_breakdown_1_thread_ms": split,
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
    print(f"1-thread step breakdown (ms per step: linear / attention / other): {split}")
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


if __name__ == "__main__":
    raise SystemExit(main())
