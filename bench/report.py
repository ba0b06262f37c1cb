"""Markdown tables from a bench/run.py JSON.

    python -m bench.report bench/results/full.json [TABLES.md]    # default: beside the JSON (full.md)

(bench.run writes them after a sweep; this redraws the tables and plots of a saved run.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _f(x, nd: int = 1, scale: float = 1.0) -> str:
    return "-" if x is None else f"{x * scale:.{nd}f}"


def ratio_table(ratios: list[dict]) -> str:
    lines = ["| ratio (cpu-tiny, random p=0.35, same run) | measured | target | met? | by how much |",
             "|---|---|---|---|---|"]
    for r in ratios:
        v = r.get("value")
        if v is None:
            lines.append(f"| {r['name']} | not measured | >= {r['target']:g}x | - | - |")
            continue
        margin = r["margin_pct"]
        verdict = "met" if r["met"] else "**missed**"
        how = f"{margin:+.0f}% vs target" if r["met"] else f"{-margin:.0f}% short ({v:.2f}x of {r['target']:g}x)"
        lines.append(f"| {r['name']} ({r['numerator']} / {r['denominator']}) | {v:.2f}x | >= {r['target']:g}x | "
                     f"{verdict} | {how} |")
    return "\n".join(lines)


def results_table(data: dict, pair: str, wl: str) -> str:
    cell = data["results"][pair][wl]
    labels = data.get("systems", {})
    lines = ["| N | system | tok/s | TTFT p50 (ms) | TTFT p90 (ms) | e2e p50 (s) | e2e p90 (s) | per-user tok/s | "
             "small % | large % | mean batch (small/large) | busy % (small/large) | requests | others' CPU (cores) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted(cell, key=int):
        for s in data["config"]["systems"]:
            r = cell[n].get(s)
            if r is None:
                continue
            if r.get("error"):
                lines.append(f"| {n} | {labels.get(s, s)} | error: {r['error'][:80]} |" + " |" * 11)
                continue
            frac = r.get("model_fraction") or {}
            mb = r.get("mean_batch") or {}
            mbs = "/".join(_f(mb.get(k), 1) for k in ("small", "large") if k in mb)
            bz = r.get("busy") or {}
            bzs = "/".join(_f(bz.get(k), 0, 100) for k in ("small", "large") if k in bz)
            lines.append(f"| {n} | {labels.get(s, s)} | {_f(r['tok_s'])} | {_f(r['ttft_p50'], 0, 1e3)} | "
                         f"{_f(r['ttft_p90'], 0, 1e3)} | {_f(r['e2e_p50'], 2)} | {_f(r['e2e_p90'], 2)} | "
                         f"{_f(r.get('per_user_tok_s'))} | {_f(frac.get('small'), 0, 100)} | "
                         f"{_f(frac.get('large'), 0, 100)} | {mbs or '-'} | {bzs or '-'} | {r.get('requests', '-')} | "
                         f"{_f(r.get('outside_cores'), 2)} |")
    return "\n".join(lines)


def by_workload_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    names = list(dict.fromkeys(r["name"] for r in rows))
    cols = list(dict.fromkeys((r["pair"], r["workload"]) for r in rows))
    val = {(r["name"], r["pair"], r["workload"]): r["value"] for r in rows}
    lines = ["| ratio | target | " + " | ".join(f"{p} {w}" for p, w in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    tgt = {r["name"]: r["target"] for r in rows}
    for n in names:
        lines.append(f"| {n} | >= {tgt[n]:g}x | " + " | ".join(_f(val.get((n, p, w)), 2) + ("x" if (n, p, w) in val else "")
                                                          for p, w in cols) + " |")
    return "\n".join(lines)


def _system_of(spec: str) -> tuple[str, str]:
    s, n = spec.split("@N=")
    return s, n


def breakdown_table(data: dict) -> str:
    """For every ratio: where each side's time went (from the run's own counters)."""
    lines = ["| ratio | system @ N | tok/s | mean batch (small/large) | step ms (small/large) | busy % (small/large) | "
             "tokens computed per output token (small/large) |", "|---|---|---|---|---|---|---|"]
    any_row = False
    for r in data["ratios"]:
        cell = data["results"].get(r["pair"], {}).get(r["workload"], {})
        for spec in (r["numerator"], r["denominator"]):
            s, n = _system_of(spec)
            row = cell.get(n, {}).get(s)
            if not row or row.get("error"):
                continue
            any_row = True
            pick = lambda d, nd=1, sc=1.0: "/".join(_f((d or {}).get(k), nd, sc) for k in ("small", "large") if k in (d or {})) or "-"
            tc = row.get("tokens_computed")
            per = {k: v / max(1, row["tokens"]) for k, v in tc.items()} if tc else None
            lines.append(f"| {r['name']} | {data.get('systems', {}).get(s, s)} @ {n} | {_f(row['tok_s'])} | "
                         f"{pick(row.get('mean_batch'))} | {pick(row.get('step_ms'))} | {pick(row.get('busy'), 0, 100)} | "
                         f"{pick(per, 2)} |")
    return "\n".join(lines) if any_row else ""


def render(data: dict, pngs: list | None = None, notes: str | None = None) -> str:
    m, c = data["machine"], data["config"]
    title = "quick run (tiny settings: the figures are not meaningful)" if c.get("quick") else "full sweep"
    la = lambda x: " ".join(f"{v:.2f}" for v in x) if x else "-"
    out = [f"# aiorouter benchmark: {title}", "",
           "Generated by `bench/report.py` from "
           f"`{data.get('json_path', 'bench/results/' + ('quick' if c.get('quick') else 'full') + '.json')}`.", "",
           f"- machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, Python {m.get('python')}",
           f"- commit: `{m.get('commit')}`, {m.get('time')}",
           f"- load average at start: {la(m.get('load_avg_start'))}; at end: {la(m.get('load_avg_end'))} "
           "(1, 5, 15 min; the CPU is shared, so figures above ~1.5 carry others' load)",
           "- other processes' CPU use during the runs (cores, measured from /proc/stat minus this process): "
           + (", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in data["outside_cores"].items())
              if data.get("outside_cores") else "-"),
           (f"- this invocation's sweep: {data.get('sweep_s', 0) / 60:.1f} min (the tables also hold blocks "
            "measured by earlier invocations, merged)" if c.get("merged_from_earlier_invocations")
            else f"- sweep: {data.get('sweep_s', 0) / 60:.1f} min") +
           (f" (estimated {data['estimate_s'] / 60:.1f} min)" if data.get("estimate_s") else ""),
           "- closed loop: " + (", ".join(f"{b} {v}" for b, v in c["requests_per_client_by_block"].items()) + " "
                                if len(set(c.get("requests_per_client_by_block", {}).values())) > 1
                                else f"{c['requests_per_client']} ")
           + f"request(s) per client, at least {c['min_requests']} per run; "
           f"greedy, fixed output lengths (ignore_eos); KV memory {c['kv_memory_gb']} GB per system",
           "- threads: " + "; ".join(f"{k}: {v}" for k, v in c["threads"].items() if k != "hf-naive")
           + "; hf-naive: " + "; ".join(f"{p}: {v}" for p, v in (c["threads"].get("hf-naive") or {}).items()),
           "- pairs: " + "; ".join(f"{p}: small `{Path(v['small']).name}`, large `{Path(v['large']).name}`, "
                                   f"{v['policy']} {v['policy_args']}" for p, v in data["pairs"].items()),
           "- workloads: " + "; ".join(f"{w}: {v['description']}" for w, v in data["workloads"].items()),
           "", "## Targets", "", ratio_table(data["ratios"]), ""]
    bd = breakdown_table(data)
    if bd:
        out += ["### Where the time goes (each ratio's two sides)", "",
                "busy = share of the measured run a model's worker spent inside steps; tokens computed = tokens a "
                "model ran through its layers (prompt prefill and catch-up extends included) per output token.", "",
                bd, ""]
    bw = by_workload_table(data.get("ratios_by_workload") or [])
    if bw:
        out += ["## The same ratios on every pair and workload (context)", "",
                "Every pair routes with its own policy (the header's `pairs` line), so the token fractions "
                "differ from cpu-tiny's.", "", bw, ""]
    for pair, wls in data["results"].items():
        for wl in wls:
            out += [f"## {pair}, {wl}", "", results_table(data, pair, wl), ""]
    if pngs:
        out += ["## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in pngs] + [""]
    if notes:
        out += [notes.strip(), ""]
    return "\n".join(out)


def write(data: dict, md: Path, pngs: list | None = None) -> Path:
    md = Path(md)
    notes = data.get("notes")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(data, pngs, notes))
    return md


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results" / "full.json")
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".md")
    d = json.loads(src.read_text())
    d.setdefault("json_path", str(src))
    from bench.plots import make_all
    pngs = make_all(d, src.parent, src.stem)
    write(d, dst, [p.relative_to(dst.parent) if p.is_relative_to(dst.parent) else p for p in pngs])
    print(dst)
