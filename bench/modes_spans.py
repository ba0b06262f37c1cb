"""Read a `bench.modes --keep-spans` run's forwards back: how steady the machine was, and how well
the served refit predicts the step times of the schedules it was not fitted on.

    python -m bench.modes_spans DIR [--gap 1.5]

Two tables per N, per model:
- each window's mean step time against the start-up profile's cost of the same steps (batch and
  tokens as served): one schedule's windows should read alike, and where they do not, the machine
  moved under them (cpu-tiny, 2026-12-03: one delayed schedule's three windows read 1.09x, 1.32x
  and 2.07x its profiled cost);
- each run's and sweep point's mean step time against the served refit (`bench.modes_model.
  served_profile`, fitted on the sync, eager and delayed runs at that N, as `bench.modes
  --interleave` fits its final prediction; the sweep points' other than delayed's own are never
  in it), with the refit's contention applied to each step's measured overlap.
Windows are told apart by gaps: a window's spans end where another schedule's window (or a settle)
begins, and `--gap` seconds without a forward of the schedule separates two of its windows.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import numpy as np

from aiorouter.tuning import StepCost
from aiorouter.tuning.served import ServedFit, StepSpan, overlap_shares
from bench.modes_model import PairProfile, served_profile

NAMES = ("small", "large")


def windows_of(spans: list[list[float]], gap: float, every: list[list[float]] | None = None) -> list[np.ndarray]:
    """[k] arrays (n, 4) of (start, end, batch, tokens), split where no forward ran for `gap` s;
    with `every` (all models' spans of the run), where none of them ran one: a light model can
    idle for seconds inside a window while the heavy one writes."""
    s = np.array(sorted(spans), dtype=float).reshape(-1, 4)
    a = np.array(sorted(every if every is not None else spans), dtype=float).reshape(-1, 4)
    ends = np.maximum.accumulate(a[:, 1])  # (spans of two models overlap: the latest end so far)
    starts = a[1:, 0][a[1:, 0] - ends[:-1] > gap]  # each window's first start after the first
    return [w for w in np.split(s, np.searchsorted(s[:, 0], starts)) if len(w)]


def profile_ratio(w: np.ndarray, cost: StepCost) -> float:
    """Seconds the window's steps took over what the start-up profile says they cost."""
    return float((w[:, 1] - w[:, 0]).sum() / sum(cost(b, t) for b, t in w[:, 2:4]))


def served_error(fit: ServedFit, costs: list[StepCost], run: dict[str, list], i: int) -> tuple[float, float, float] | None:
    """(measured mean step s, mean batch, refit's error) of model i's steps in `run`, `costs` the
    refitted step costs; None where the model ran none there."""
    mine = [StepSpan(*x) for x in run[NAMES[i]] if x[1] > x[0]]
    if not mine:
        return None
    other = [StepSpan(*x) for x in run[NAMES[1 - i]]]
    c = costs[i]
    o = overlap_shares(mine, other)  # [n] share of each step overlapped by the other model's
    pred = np.array([c(x.batch, x.tokens) for x in mine]) / (1.0 - fit.kappa[i][1 - i] * o)
    t = np.array([x.seconds for x in mine])
    return float(t.mean()), float(np.mean([x.batch for x in mine])), float(pred.mean() / t.mean() - 1)


def report(out_dir: Path, gap: float) -> str:
    data = json.loads((out_dir / "modes.json").read_text())
    with gzip.open(out_dir / "spans.json.gz", "rt") as f:
        spans = json.load(f)
    prof = PairProfile.from_described(data["profile"])
    costs = prof.costs
    lines = []
    for n, runs in spans.items():
        lines += [f"\nN = {n}", "", "| run | model | windows: step time / start-up profile's | mean batch |",
                  "|---|---|---|---:|"]
        for key, run in runs.items():
            for i, name in enumerate(NAMES):
                ws = windows_of(run[name], gap, [x for m in NAMES for x in run[m]])
                if not ws:  # (a model that never stepped in this run's windows)
                    lines.append(f"| {key} | {name} | - | - |")
                    continue
                lines.append(f"| {key} | {name} | {' '.join(f'{profile_ratio(w, costs[i]):.2f}x' for w in ws)} | "
                             f"{np.mean([w[:, 2].mean() for w in ws]):.1f} |")
        fitted = [k for k in (f"sync@{n}", f"eager@{n}", f"delayed@{n}") if k in runs]
        if not fitted:
            continue
        served, fit = served_profile(prof, [{"spans": runs[k]} for k in fitted])
        lines += ["", f"served refit on {', '.join(fitted)}: mean step time predicted against measured", "",
                  "| run | " + " | ".join(f"{m} ms (batch), refit error" for m in NAMES) + " |", "|---|---|---|"]
        for key, run in runs.items():
            cells = []
            for i in range(len(NAMES)):
                got = served_error(fit, served.costs, run, i)
                cells.append("-" if got is None else f"{1e3 * got[0]:.1f} ({got[1]:.1f}), {100 * got[2]:+.0f} %")
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path, help="a bench.modes --out DIR run with --keep-spans")
    ap.add_argument("--gap", type=float, default=1.5, help="seconds without a forward that separate two windows")
    args = ap.parse_args(argv)
    if not (args.dir / "spans.json.gz").exists():
        ap.error(f"{args.dir / 'spans.json.gz'} not found: run bench.modes with --keep-spans --out {args.dir}")
    print(report(args.dir, args.gap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
