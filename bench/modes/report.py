"""Markdown tables from `bench.modes` output: measured against predicted, per N.

    python -m bench.modes report DIR/modes.json [...] [--plot PNG]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _race(r: dict) -> str:
    """A race's reading (bench.modes.interleaved.race_read): its pairs and standard error."""
    return f"({r['pairs']} pairs; +-{100 * r['log_se']:.1f}%)"


def _race_cell(s: dict) -> str:
    r = s.get("race")
    return "- | " if r is None else (f"{s['race_best_B_measured']} ({s['best_B_predicted']} / {r['against']} "
                                     f"{r['ratio']:.3f}), {_pct(s['race_measured_loss_at_predicted_best'])} "
                                     f"{_race(r)} | ")


def markdown(data: dict) -> str:
    res, pred, summ, sweep = data["results"], data["predictions"], data["summary"], data.get("sweep", {})
    prof = data["profile"]
    il = data["interleave"]
    how = (f"interleaved on one router and one closed loop: {il['cycles']} cycles, each schedule's window at "
           f"least {il['window_s']:g} s, {il['window_lives']:g} request lifetimes and "
           f"{il['window_requests']} answers, after at least {il['settle_s']:g} s and "
           f"{il['settle_lives']:g} lifetimes under it; every window of a cycle serves the same prompts, "
           "without prefix caching")
    out = [f"**{data['pair']}** ({data['policy']} {data['policy_args']}), {data['tokens']} output tokens, {how}; "
           f"profile: step cost {prof['profile_s']['step_cost']:.1f} s, contention "
           f"{prof['profile_s']['contention']:.1f} s (other processes {prof.get('outside_load_cores') or 0:.2f} cores).",
           "", "Whole run, tok/s (what a client gets):", "",
           "| N | sync | eager | delayed ran | delayed | delayed / best of sync, eager | other cores per run |",
           "|---|---:|---:|---|---:|---:|---|"]
    for n in sorted(pred, key=int):
        r = {m: res.get(f"{m}@{n}") for m in ("sync", "eager", "delayed")}
        d = r["delayed"] or {}
        b = d.get("thresholds")
        ran = d.get("schedule", "delayed")
        ran = f"delayed B=({', '.join(map(str, b.values()))})" if ran == "delayed" and b else ran
        loads = ", ".join(f"{x.get('outside_load_cores') or 0:.2f}" for x in r.values() if x)
        ratio = summ[n].get("delayed_over_best_of_sync_eager")
        cell = {m: "-" if x is None else f"{x['tok_s']:.1f}" + (
            f" (windows {', '.join(f'{v:.1f}' for v in x['rounds_tok_s'])})" if "rounds_tok_s" in x else "")
            for m, x in r.items()}
        out.append(f"| {n} | {cell['sync']} | {cell['eager']} | {ran} | {cell['delayed']} | "
                   f"{'-' if ratio is None else f'**{ratio:.3f}**'}"
                   + (f" (by round {summ[n]['delayed_over_best_by_round']:.3f})" if "delayed_over_best_by_round" in summ[n] else "")
                   + (f"; race against {rd['against']}" + (" (the same schedule)" if d.get("schedule") == rd["against"] else "")
                      + f": **{rd['ratio']:.3f}** {_race(rd)}"
                      if (rd := summ[n].get("race_delayed")) else "")
                   + f" | {loads} |")
    alone = all("sync_eager_fit" in summ[n] for n in pred)  # runs before it had the sync/eager fit only
    out += ["", "Every window of the schedule pooled (tokens over seconds), and the chain's prediction: served "
            "(profile refitted on the " + ("measured cycles' sync, eager and delayed windows' forwards) / refitted on "
                                           "their sync and eager windows' alone" if alone else
                                           "sync and eager windows' forwards, every cycle's)")
            + " / start-up profile only:", "",
            "| N | sync | eager | delayed | mean in flight (whole run) | served fit: scale/slope scale, kappa (small; large) |",
            "|---|---|---|---|---|---|"]
    for n in sorted(pred, key=int):
        cells = []
        for m in ("sync", "eager", "delayed"):
            x = res.get(f"{m}@{n}")
            cells.append("-" if x is None else
                         f"{x['steady_tok_s']:.1f} ({_pct(summ[n]['prediction_error'][m])} / "
                         + (f"{_pct(summ[n]['sync_eager_fit']['prediction_error'][m])} / " if alone else "")
                         + f"{_pct(summ[n]['startup_prediction_error'][m])})")
        fl = ", ".join(f"{res[f'{m}@{n}']['mean_in_flight']:.2f}" for m in ("sync", "eager", "delayed")
                       if f"{m}@{n}" in res)
        f = pred[n].get("served_fit") or {}
        sl = f.get("slopes") or f.get("scales")  # (runs before the shape fit had one scale)
        fit = "-" if not f else (f"{f['scales'][0]:.2f}/{sl[0]:.2f}, {f['kappa'][0][1]:.2f}; "
                                 f"{f['scales'][1]:.2f}/{sl[1]:.2f}, {f['kappa'][1][0]:.2f}")
        out.append(f"| {n} | {' | '.join(cells)} | {fl} | {fit} |")
    if sweep:
        blocked = all("blocked_best_B_measured" in summ[n] for n in sweep)  # runs before it pooled only
        raced = any("race" in summ[n] for n in sweep)
        out += ["", "| N | predicted best B (start-up) | measured best B, steady (whole run) | steady loss at the "
                "predicted best (whole run) |" + (" against each window's cycle: measured best B, loss |" if blocked else "")
                + (" race: measured best B, loss at the predicted best (pairs; its standard error) |" if raced else "")
                + " served prediction error over the sweep (min / max) |"
                + (" sync/eager fit: predicted best B, loss, error (min / max) |" if alone else ""),
                "|---|---|---|---|" + ("---|" if blocked else "") + ("---|" if raced else "") + "---|"
                + ("---|" if alone else "")]
        for n in sorted(sweep, key=int):
            s = summ[n]
            errs = list(s["sweep_prediction_error"].values())
            out.append(f"| {n} | {s['best_B_predicted']} ({s['best_B_startup']}) | {s['best_B_measured']} "
                       f"({s['whole_run_best_B_measured']}) | {_pct(s['measured_loss_at_predicted_best'])} "
                       f"({_pct(s['whole_run_measured_loss_at_predicted_best'])}) | "
                       + (f"{s['blocked_best_B_measured']}, {_pct(s['blocked_measured_loss_at_predicted_best'])} | "
                          if blocked else "")
                       + (_race_cell(s) if raced else "")
                       + f"{_pct(min(errs))} / {_pct(max(errs))} |"
                       + (f" {s['sync_eager_fit']['best_B_predicted']}, "
                          f"{_pct(s['sync_eager_fit']['measured_loss_at_predicted_best'])}, "
                          f"{_pct(min(s['sync_eager_fit']['sweep_prediction_error'].values()))} / "
                          f"{_pct(max(s['sync_eager_fit']['sweep_prediction_error'].values()))} |" if alone else ""))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.modes report", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="modes.json files")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG",
                    help="also plot delayed against the better of sync and eager, by race, one line per run")
    a = ap.parse_args(argv)
    runs = [json.loads(p.read_text()) for p in a.runs]
    for data in runs:
        print(markdown(data))
        print()
    if a.plot is not None:
        from bench.plots import modes_races
        print(f"wrote {modes_races(runs, a.plot)}")
    return 0
