"""Markdown tables from `bench.modes` output: measured against predicted, per N.

    python -m bench.modes_report DIR/modes.json [...]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def markdown(data: dict) -> str:
    res, pred, summ, sweep = data["results"], data["predictions"], data["summary"], data.get("sweep", {})
    prof = data["profile"]
    out = [f"**{data['pair']}** ({data['policy']} {data['policy_args']}), {data['tokens']} output tokens, "
           f"{data['requests_per_client']} requests per client; profile: step cost "
           f"{prof['profile_s']['step_cost']:.1f} s, contention {prof['profile_s']['contention']:.1f} s "
           f"(other processes {prof.get('outside_load_cores') or 0:.2f} cores).", "",
           "| N | sync tok/s (pred.) | eager (pred.) | delayed B | delayed (pred.) | delayed / best of sync, eager "
           "| other cores per run | model's schedule |",
           "|---|---|---|---|---|---|---|---|"]
    for n in sorted(pred, key=int):
        cell = {}
        for m in ("sync", "eager", "delayed"):
            r = res.get(f"{m}@{n}")
            cell[m] = "-" if r is None else f"{r['tok_s']:.1f} ({r['predicted_tok_s']:.1f}, {_pct(r['predicted_tok_s'] / r['tok_s'] - 1)})"
        d = res.get(f"delayed@{n}", {})
        loads = ", ".join(f"{res[f'{m}@{n}'].get('outside_load_cores') or 0:.2f}" for m in ("sync", "eager", "delayed")
                          if f"{m}@{n}" in res)
        ratio = summ[n].get("delayed_over_best_of_sync_eager")
        b = d.get("thresholds")
        out.append(f"| {n} | {cell['sync']} | {cell['eager']} | {'/'.join(map(str, b.values())) if b else '-'} | "
                   f"{cell['delayed']} | {'-' if ratio is None else f'{ratio:.2f}'} | {loads} | "
                   f"{pred[n]['schedule']} |")
    if sweep:
        out += ["", "| N | predicted best B | measured best B | measured loss at the predicted best | "
                "prediction error over the sweep (min / max) |", "|---|---|---|---|---|"]
        for n in sorted(sweep, key=int):
            s = summ[n]
            errs = list(s["sweep_prediction_error"].values())
            out.append(f"| {n} | {s['best_B_predicted']} | {s['best_B_measured']} | "
                       f"{_pct(s['measured_loss_at_predicted_best'])} | {_pct(min(errs))} / {_pct(max(errs))} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        print(markdown(json.loads(Path(path).read_text())))
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
