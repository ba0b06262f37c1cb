"""The throughput model against the runtime (the paper's Figure 10 experiment, on SimEngine).

R2R-like routing (`random`, p = 0.35), small 6.0 ms and large 27.9 ms per step, B_0 = 1 and B_1
from 1 to N, at N = 2, 3, 4, 6, 8 closed-loop clients. The model is fed the step latencies the
sim engines actually take in the runtime (profiled, as a router does at start-up), and its
prediction and best B_1 are compared with what the runtime measures. The latencies are those a
router profiles at start-up: timed from its event loop, so the thread hop of every step (0.1-0.7 ms
depending on load) is in the chain as a per-step cost.

    python bench/dtmc_validation.py [--seconds 4] [--concurrency 2,3,4,6,8]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from aiorouter import Router
from aiorouter.tuning import SystemSpec, solve_grid
from bench.common import RESULTS, write_json

P, L0, L1 = 0.35, 6.0, 27.9


async def measure(n: int, b1: int, seconds: float, max_tokens: int) -> float:
    models = {"small": {"engine": "sim", "latency_ms": L0}, "large": {"engine": "sim", "latency_ms": L1}}
    async with Router(models, policy="random", policy_args={"p": P, "seed": n * 100 + b1}, mode="delayed",
                      thresholds={"small": 1, "large": b1}, max_concurrency=max(8, n)) as r:
        stop = time.perf_counter() + seconds
        start_tokens, t_start = None, None

        async def worker():
            while time.perf_counter() < stop:
                async for _ in r.stream("x", max_tokens=max_tokens, ignore_eos=True):
                    pass

        async def sampler():
            nonlocal start_tokens, t_start
            await asyncio.sleep(min(1.0, seconds / 4))  # warm-up: let the closed loop reach steady state
            start_tokens, t_start = r.metrics.tokens_committed, time.perf_counter()

        ws = [asyncio.create_task(worker()) for _ in range(n)]
        await sampler()
        await asyncio.sleep(max(0.0, stop - time.perf_counter()))
        tokens, t_end = r.metrics.tokens_committed, time.perf_counter()
        for w in ws:
            w.cancel()
        await asyncio.gather(*ws, return_exceptions=True)
        return (tokens - start_tokens) / (t_end - t_start)


async def router_profile(n_max: int) -> tuple[list, dict]:
    """The step latencies a router measures at start-up (thresholds="auto"): each step timed from
    the event loop through the model's worker, so the hop to the worker and back is in L(b) as a
    per-step cost (engines.profile.profile_dispatched_latency)."""
    models = {"small": {"engine": "sim", "latency_ms": L0}, "large": {"engine": "sim", "latency_ms": L1}}
    async with Router(models, policy="random", policy_args={"p": P}, tune_concurrency=n_max,
                      max_concurrency=n_max) as r:
        await r.wait_tuned()
        return list(r.tuning.tuner.config.latency), dict(r.tuning.profiled)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--concurrency", default="2,3,4,6,8")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args(argv)
    ns = [int(x) for x in args.concurrency.split(",")]
    (lat0, lat1), raw = asyncio.run(router_profile(max(ns)))
    spec = SystemSpec.build([[1 - P, P], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], [lat0, lat1], delta=1e-4)
    nominal = SystemSpec.build([[1 - P, P], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]], [L0 / 1000, L1 / 1000], delta=1e-4)
    rows = []
    with tqdm(total=sum(ns), desc="dtmc validation") as bar:
        for n in ns:
            Bs = [(1, b1) for b1 in range(1, n + 1)]
            pred = solve_grid(spec, n, Bs)
            pred_nominal = solve_grid(nominal, n, Bs)
            for (_, b1), pr, pn in zip(Bs, pred, pred_nominal):
                meas = asyncio.run(measure(n, b1, args.seconds, args.max_tokens))
                rows.append({"N": n, "B1": b1, "predicted": pr.throughput, "predicted_nominal_latency": pn.throughput,
                             "measured": meas, "error": pr.throughput / meas - 1})
                bar.update(1)
    summary = []
    for n in ns:
        rs = [r for r in rows if r["N"] == n]
        bp = max(rs, key=lambda r: r["predicted"])
        bm = max(rs, key=lambda r: r["measured"])
        gap = 1 - bp["measured"] / bm["measured"]
        summary.append({"N": n, "best_B1_predicted": bp["B1"], "best_B1_measured": bm["B1"],
                        "measured_gap_of_predicted_best": gap, "ok": bp["B1"] == bm["B1"] or gap <= 0.02,
                        "max_abs_error": max(abs(r["error"]) for r in rs)})
    data = {"p": P, "latency_ms": [L0, L1], "profiled_latency_s": raw,
            "fitted": {"small": [lat0.a, lat0.c], "large": [lat1.a, lat1.c]}, "rows": rows, "summary": summary}
    path = write_json("dtmc_validation", data)
    _plot(rows, ns)
    lines = ["| N | B1 | predicted tok/s | measured tok/s | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['N']} | {r['B1']} | {r['predicted']:.1f} | {r['measured']:.1f} | {r['error']:+.1%} |" for r in rows]
    lines += ["", "| N | best B1 predicted | best B1 measured | measured loss at predicted best | max error |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['N']} | {s['best_B1_predicted']} | {s['best_B1_measured']} | {s['measured_gap_of_predicted_best']:.1%} "
              f"| {s['max_abs_error']:.1%} |" for s in summary]
    print("\n".join(lines))
    (RESULTS.parent / "RESULTS-dtmc-validation.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


def _plot(rows, ns) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in ns:
        rs = [r for r in rows if r["N"] == n]
        line, = ax.plot([r["B1"] for r in rs], [r["predicted"] for r in rs], "-", label=f"N={n} predicted")
        ax.plot([r["B1"] for r in rs], [r["measured"] for r in rs], "o", color=line.get_color(), label=f"N={n} measured")
    ax.set_xlabel("B_1 (large-model threshold), B_0 = 1")
    ax.set_ylabel("committed tokens / s")
    ax.set_title("Throughput model vs runtime (SimEngine, p = 0.35)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "dtmc_validation.png", dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
