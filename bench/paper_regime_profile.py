"""Where a token's time goes in aiorouter on the sim pair, beyond the 6.0 / 27.9 ms step sleeps.

    python -m bench.paper_regime_profile                  # delayed and eager, N = 4, 128 tokens
    python -m bench.paper_regime_profile --cprofile 25    # and the event loop thread's top functions

Each model is a `SimEngine` subclass that timestamps its own step API (the router serves given
engines as they are), so a step splits into: the launch (`schedule`, on the event loop), the hop
into the model's worker, the forward (the sim's token bookkeeping, then its sleep and the sleep's
overshoot), the hop back to the loop, and `finish` on the loop (the policy's route and the commits
after it show in the event loop's CPU share, printed per run). What is neither a step nor its hops
is the model's idle time: no request ready, or fewer than its delayed threshold. The closing line
is the throughput model's prediction for the same thresholds at the step times as run (launch +
hops + forward): what the runtime would reach if it added nothing else.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from dataclasses import dataclass, field

from bench import workloads as W
from bench.common import closed_loop
from bench.paper_regime import POLICY, POLICY_ARGS, SIM_MS, SIM_VOCAB, WARMUP_TOKENS, solve_sim_thresholds
from engines import EngineConfig
from engines.sim import SimEngine


@dataclass
class StepLog:
    """Per step, perf_counter stamps: schedule start/end (loop), execute start/end (worker),
    sleep start (worker), finish start (loop, right after the await returns)."""

    rows: list[tuple] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    cur: dict = field(default_factory=dict)


class TimedSim(SimEngine):
    """A SimEngine that stamps its step API calls into `log` (same semantics, same sleeps)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log = StepLog()

    def schedule(self):
        t0 = time.perf_counter()
        batch = super().schedule()
        if batch:
            self.log.cur = {"sched0": t0, "sched1": time.perf_counter()}
        return batch

    def execute(self, batch, want_hidden: bool = False):
        t0 = time.perf_counter()
        out = super().execute(batch, want_hidden)
        self.log.cur.update(exec0=t0, exec1=time.perf_counter())
        return out

    def finish(self, batch, out):
        t0 = time.perf_counter()
        res = super().finish(batch, out)
        c = self.log.cur
        self.log.rows.append((c["sched0"], c["sched1"], c["exec0"], c["exec1"], t0, time.perf_counter()))
        self.log.batch.append(len(batch))
        return res


def split(log: StepLog, nominal_s: float, wall: float) -> dict:
    """Sums in ms per step, and the fractions of the run's wall time."""
    n = len(log.rows)
    if not n:
        return {"steps": 0}
    s = {"launch (schedule)": 0.0, "hop to worker": 0.0, "forward": 0.0, "of it, over L": 0.0, "hop back to loop": 0.0,
         "finish": 0.0}
    nxt = [r[0] for r in log.rows[1:]] + [None]
    busy = 0.0
    for (s0, s1, e0, e1, f0, f1), n0 in zip(log.rows, nxt):
        s["launch (schedule)"] += s1 - s0
        s["hop to worker"] += e0 - s1
        s["forward"] += e1 - e0
        s["of it, over L"] += (e1 - e0) - nominal_s
        s["hop back to loop"] += f0 - e1
        s["finish"] += f1 - f0
        busy += (f1 if n0 is None else min(n0, f1)) - s0
    out = {k: 1000 * v / n for k, v in s.items()}
    out.update(steps=n, mean_batch=sum(log.batch) / n, busy_frac=busy / wall, nominal_ms=1000 * nominal_s)
    return out


async def one(mode: str, n: int, tokens: int, thresholds: dict, cprof: cProfile.Profile | None,
              threads: int | None = None) -> dict:
    from aiorouter import Router
    ecfg = EngineConfig(num_kv_tokens=1 << 19, max_model_len=16384)
    engines = {k: TimedSim(ms / 1e3, 0.0, SIM_VOCAB, ecfg) for k, ms in SIM_MS.items()}
    kw = dict(thresholds=thresholds if mode == "delayed" else {"small": 1, "large": 1})
    async with Router(engines, policy=POLICY, policy_args=POLICY_ARGS, entry="small", mode=mode,
                      max_concurrency=n, threads=threads, **kw) as r:
        async def send(p, max_tokens=tokens):
            async for ev in r.stream(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                yield ev.model

        prompts = W.short_prompts(0, 64, 100, 20, SIM_VOCAB)
        await closed_loop(lambda p: send(p, WARMUP_TOKENS), n, W.warmup_prompts(n, vocab=SIM_VOCAB), n)
        for e in engines.values():
            e.log = StepLog()
        cpu0, t0 = time.thread_time(), time.perf_counter()
        if cprof:
            cprof.enable()
        res = await closed_loop(send, n, prompts, 4 * n)
        if cprof:
            cprof.disable()
        wall, loop_cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    return {"tok_s": res.tok_s, "wall_s": wall, "loop_cpu_frac": loop_cpu / wall,
            "models": {k: split(e.log, SIM_MS[k] / 1e3, wall) for k, e in engines.items()}}


def predicted(step_ms: dict[str, float], n: int, B: tuple[int, ...]) -> tuple[float, float]:
    """The throughput model's (delayed at B, eager) throughput with these step times: what the
    schedule reaches when each step lasts what the run measured (forward + hops + launch) and the
    runtime adds nothing else."""
    from aiorouter.tuning import LatencyModel, ModelSpec, choose_delta, threshold_table
    from policies import make_policy
    P, C = make_policy(POLICY, POLICY_ARGS).routing_template()
    lats = [LatencyModel(step_ms[k] / 1e3, 0.0) for k in SIM_MS]
    row = threshold_table(ModelSpec.build(P, C, lats, choose_delta(P, lats, n).delta), n)[n]
    return row.throughput_of(B), row.throughput_of((1,) * len(B))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.paper_regime_profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="delayed,eager")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="Router(threads=...): intra-op threads per worker")
    ap.add_argument("--cprofile", type=int, default=0, metavar="K", help="print the loop thread's top K functions")
    args = ap.parse_args(argv)
    from aiorouter import run
    n = args.concurrency
    thresholds, dtmc = solve_sim_thresholds((0.0, 0.0), max(n, 1))
    print(f"load {os.getloadavg()}; N={n}, {args.tokens} tokens, delayed B={thresholds[n]}, throughput model: "
          f"delayed {dtmc['by_N'][n]['tokens_per_s']:.1f}, eager {dtmc['by_N'][n]['eager_tokens_per_s']:.1f} tok/s")
    for mode in args.modes.split(","):
        prof = cProfile.Profile() if args.cprofile else None
        o = run(one(mode, n, args.tokens, thresholds, prof, args.threads))
        print(f"\n{mode}: {o['tok_s']:.1f} tok/s, wall {o['wall_s']:.1f} s, event loop CPU {100 * o['loop_cpu_frac']:.0f} %")
        for k, m in o["models"].items():
            print(f"  {k}: " + ", ".join(f"{a} {b:.3f}" if isinstance(b, float) else f"{a} {b}" for a, b in m.items()))
        eff = {k: sum(m[x] for x in ("launch (schedule)", "hop to worker", "forward", "hop back to loop"))
               for k, m in o["models"].items()}
        B = tuple(thresholds[n][k] for k in SIM_MS) if mode == "delayed" else (1,) * len(SIM_MS)
        d, e = predicted(eff, n, B)
        print("  steps as run: " + ", ".join(f"{k} {v:.2f} ms" for k, v in eff.items()) +
              f"; the throughput model at them: {d if mode == 'delayed' else e:.1f} tok/s "
              f"(measured {o['tok_s']:.1f}: {100 * o['tok_s'] / (d if mode == 'delayed' else e):.0f} %)")
        if prof:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.cprofile)
            print(s.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
