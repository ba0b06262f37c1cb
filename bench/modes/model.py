"""The throughput model's side of `bench.modes`: profile a pair the way the runtime serves it,
then predict sync, eager and delayed (every feasible B) for the routing a run observed.

Inputs of a prediction, and where each comes from:
- step cost a + per_seq * b + per_token * T of each model: profiled here, before any run, in a
  worker thread with the intra-op threads the runtime gives it (`aiorouter.cpu_threads`);
- contention kappa_ij(b_i, b_j): profiled here with `CoreShare` in place (cached by model files);
- routing matrix P and tokens computed per request-step tau_i (catch-up extends and first-visit
  prompts make it > 1): observed in the eager and sync runs at the same N, as the router's online
  estimator observes them (the policy's template P can be far off: smollm2's rstitch);
- the runtime's own cost per step beyond the forward (the event loop's scheduling, routing and
  commits, and the hop to the model's worker thread and back): observed in the same runs, as the
  router measures it for its tuner (`ModelMetrics.mean_overhead`), and added to each step. On the
  cpu-tiny pair it is ~0.3-0.5 ms against a ~3 ms small-model step;
- served (`served_profile`): the same profile with each model's step cost scaled, and kappa
  refitted, from the spans of the forwards the eager and sync runs served
  (`aiorouter.tuning.learned`): the start-up contention profile steps both models back to back
  and misses most of what the light model loses in served bursts.
The model never sees a measured throughput. The start-up prediction sees no measured forward
time. The served one sees the forwards of the sync, eager and delayed windows (as the runtime's
re-solves see whatever it served), with the fit on sync and eager alone reported beside it.
"""
from __future__ import annotations

import gc
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from aiorouter.cpu_threads import CoreShare, plan_threads
from aiorouter.tuning.learned import ServedFit, StepSpan, fit_served
from aiorouter.tuning import (
    DELAYED_MARGIN,
    Contention,
    LatencyModel,
    SolveCache,
    StepCost,
    SystemSpec,
    best_thresholds,
    choose_delta,
    choose_schedule,
    fit_step_cost,
    sync_throughput,
)
from engines import Engine, EngineConfig
from engines.profile import contention_pairs, profile_contention, profile_step_latency

STEP_SHAPES = lambda cap: [(1, 1), (4, 1), (cap, 1), (1, 32), (4, 8), (cap, 4)]


@dataclass
class PairProfile:
    names: list[str]
    costs: list[StepCost]
    contention: Contention
    samples: list[dict]
    threads: list[int]
    step_seconds: float  # wall time of the step-cost profile
    contention_seconds: float  # wall time of the contention profile (0 when cached)

    def describe(self) -> dict:
        return {"threads": dict(zip(self.names, self.threads)),
                "step_cost_ms": {n: {"a": 1e3 * c.a, "per_seq": 1e3 * c.per_seq, "per_token": 1e3 * c.per_token}
                                 for n, c in zip(self.names, self.costs)},
                "contention": self.samples, "profile_s": {"step_cost": self.step_seconds,
                                                          "contention": self.contention_seconds}}


def profile_pair(paths: dict[str, Path], cap: int, cache_dir: Path | None) -> PairProfile:
    """Build both engines as the runtime does on CPU and profile step costs and contention."""
    names = list(paths)
    engines = [Engine(p, config=EngineConfig(num_kv_tokens=8192)) for p in paths.values()]
    threads = plan_threads([e.num_params for e in engines])
    share = CoreShare.plan(engines, threads)
    pools = [ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(t,)) for t in threads]
    try:
        t0 = time.perf_counter()
        shapes = STEP_SHAPES(cap)
        costs = []
        for e, pool in zip(engines, pools):
            got = pool.submit(profile_step_latency, e, shapes).result()
            costs.append(fit_step_cost(list(got), list(got.values())))
        t1 = time.perf_counter()
        heavy = max(range(len(engines)), key=lambda i: (threads[i], -i))
        samples = profile_contention(engines, contention_pairs(len(engines), cap, heavy), threads=threads,
                                     executors=pools, wrap=share.step_fn if share else None, cache_dir=cache_dir)
        t2 = time.perf_counter()
    finally:
        for p in pools:
            p.shutdown(wait=True)
        del engines
        gc.collect()
    return PairProfile(names, costs, Contention.from_samples(len(names), samples),
                       [s.__dict__ for s in samples], threads, t1 - t0, t2 - t1)


def observed_routing(runs: list[dict], names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(P, tau) pooled over runs: P[i][j] = handoffs i -> j / request-steps on i; tau_i = tokens
    model i computed / its request-steps, in the runs' steady windows where every run recorded
    them ("window_steps"), since the chain is held to that window: a window holds its own share
    of prompt prefills (smollm2, N = 16, 2 requests a client: the large model's tau 2.59 over the
    whole run, 2.88 in the window, and the eager prediction +5.2 % against -0.1 %)."""
    M = len(names)
    moves, steps, computed = np.zeros((M, M)), np.zeros(M), np.zeros(M)
    for r in runs:
        for i, n in enumerate(names):
            steps[i] += r["request_steps"][n]
            computed[i] += r["tokens_computed"].get(n, 0)
            for j, m in enumerate(names):
                if i != j:
                    moves[i, j] += r["handoffs"].get(f"{n}->{m}", 0)
    P = np.where(steps[:, None] > 0, moves / np.maximum(steps, 1)[:, None], 0.0)
    np.fill_diagonal(P, 0.0)
    np.fill_diagonal(P, 1.0 - P.sum(axis=1))
    if all(r.get("window_steps") and all(r["window_steps"].get(n) for n in names) for r in runs):
        # [M, 2] request-steps and tokens computed per model, summed over the runs' windows
        window = np.array([[r["window_steps"][n] for n in names] for r in runs], dtype=float).sum(axis=0)
        if (window[:, 0] > 0).all():
            steps, computed = window[:, 0], window[:, 1]
    tau = np.where(steps > 0, computed / np.maximum(steps, 1), 1.0)
    return P, np.maximum(tau, 1.0)


def served_profile(profile: PairProfile, runs: list[dict]) -> tuple[PairProfile, ServedFit]:
    """The profile refitted on the runs' served forwards (their "spans", per model; runs one after
    another, so spans of different runs never overlap)."""
    spans = [[StepSpan(*x) for r in runs for x in r["spans"][n]] for n in profile.names]
    fit = fit_served(spans, profile.costs, prior=profile.contention)
    return PairProfile(profile.names, fit.step_costs(profile.costs), fit.contention(), profile.samples,
                       profile.threads, profile.step_seconds, profile.contention_seconds), fit


def observed_overhead(runs: list[dict], names: list[str]) -> np.ndarray:
    """Seconds per step beyond the forward (loop work + hop), per model, pooled over runs."""
    out = np.zeros(len(names))
    for i, n in enumerate(names):
        steps = sum(r["overhead_ms"][n]["steps"] for r in runs)
        total = sum((r["overhead_ms"][n]["loop"] + r["overhead_ms"][n]["hop"]) * r["overhead_ms"][n]["steps"] for r in runs)
        out[i] = 1e-3 * total / steps if steps else 0.0
    return out


def predict(profile: PairProfile, P: np.ndarray, C: np.ndarray, tau: np.ndarray, N: int,
            overhead: np.ndarray | None = None, table_states: int = 3_000_000) -> dict:
    """Predicted tok/s of sync, eager and every feasible B at N, and the schedule the model picks.
    `overhead`: per model, seconds the runtime adds to every step (observed_overhead)."""
    t0 = time.perf_counter()
    extra = np.zeros(len(profile.costs)) if overhead is None else np.asarray(overhead, dtype=float)
    lats = [c.latency(float(t)) + LatencyModel(float(x), 0.0) if x > 0 else c.latency(float(t))
            for c, t, x in zip(profile.costs, tau, extra)]
    con = None if profile.contention.is_zero else profile.contention
    # Only row N is solved here, so the budget is spent on it alone.
    choice = choose_delta(P, lats, N, table_states=table_states, contention=con, min_concurrency=N)
    spec = SystemSpec.build(P, C, lats, choice.delta, con)
    row = best_thresholds(spec, N, cache=SolveCache())
    sync = sync_throughput(spec, N)
    sched = choose_schedule(row, sync, delayed_margin=DELAYED_MARGIN)  # as the router's tuner chooses
    # The same without contention: what the chain predicted before it modelled shared hardware.
    free = best_thresholds(SystemSpec.build(P, C, lats, choice.delta), N, cache=SolveCache())
    return {"delta_ms": 1e3 * choice.delta, "routing_P": P.round(4).tolist(), "tokens_per_step": tau.round(3).tolist(),
            "overhead_ms": (1e3 * extra).round(3).tolist(),
            "latency_ms": [[1e3 * m.a, 1e3 * m.c] for m in lats],
            "best_thresholds": list(row.best), "best_tok_s": row.best_throughput,
            "eager_tok_s": sched.eager, "sync_tok_s": sync.throughput, "schedule": list(sched.choice[:1]) +
            ([list(sched.choice[1])] if len(sched.choice) > 1 else []),
            "by_thresholds": {",".join(map(str, c.B)): c.throughput for c in row.candidates},
            "no_contention": {"best_thresholds": list(free.best), "best_tok_s": free.best_throughput,
                              "eager_tok_s": free.throughput_of((1,) * len(lats))},
            "solve_s": time.perf_counter() - t0}


def predicted_for(pred: dict, mode: str, thresholds: tuple[int, ...] | None) -> float:
    if mode == "sync":
        return pred["sync_tok_s"]
    if mode == "eager":
        return pred["eager_tok_s"]
    return pred["by_thresholds"][",".join(map(str, thresholds))]


def model_at(prof, seen: list[dict], tpl_P: np.ndarray, tpl_C: np.ndarray, n: int) -> dict:
    """The chain's prediction at N from the runs `seen` (sync and eager; interleaved, delayed's
    windows too): routing, tokens per request-step and the loop's cost per step as they observed
    them, on the profile refitted to their forwards (as a runtime re-solve would), with the
    start-up profile's prediction beside it."""
    P, tau = observed_routing(seen, prof.names) if seen else (tpl_P, np.ones(2))
    overhead = observed_overhead(seen, prof.names) if seen else np.zeros(2)
    startup = predict(prof, P, tpl_C, tau, n, overhead)
    served, fit = served_profile(prof, seen) if seen else (prof, None)
    pred = predict(served, P, tpl_C, tau, n, overhead)
    pred["startup"] = startup
    pred["served_fit"] = None if fit is None else {"scales": fit.scales, "slopes": fit.slopes, "kappa": fit.kappa,
                                                  "steps": fit.steps, "runs": len(seen)}
    return pred


# what a prediction keeps of an earlier fit beside it (its first cycle's, its sync and eager fit)
FIT_KEYS = ("schedule", "best_thresholds", "best_tok_s", "eager_tok_s", "sync_tok_s", "by_thresholds", "served_fit")


def delayed_choice(pred: dict, names: list[str]) -> tuple[str, dict[str, int]]:
    """(schedule, thresholds) delayed batching runs at N: the model's best of delayed(B*), eager, sync."""
    sched = pred["schedule"][0]
    return sched, dict(zip(names, pred["best_thresholds"] if sched == "delayed" else (1,) * len(names)))
