"""Targets, the paper's figures beside ours, and the markdown tables of bench/paper_regime.py."""
from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- paper-regime:begin -->", "<!-- paper-regime:end -->"
SHORT = {"aiorouter-delayed": "delayed", "aiorouter-eager": "eager", "aiorouter-sync": "sync",
         "std-serving-http": "Std HTTP", "std-serving-inproc": "Std in-proc", "large-alone": "large alone"}
# The paper's figures (section 5.2): over the stronger baseline, 15 algorithm-workload pairs; Std. Serving's
# loss from 2,048 to 8,192 output tokens; R2R from N = 1 to 16.
PAPER = {"gain": (2.01, 64.15), "std_loss_pct": (58.1, 85.2), "n16_over_n1": 8.61, "per_user_kept_pct": 51.7}


def _ok(r: dict | None) -> bool:
    return r is not None and not r.get("error") and bool(r.get("tokens_per_s"))


def index(runs: list[dict]) -> dict:
    return {(r["engine"], r["pair"], r["workload"], r["max_tokens"], r["N"], r["system"]): r for r in runs if _ok(r)}


def _lengths(ix: dict, engine: str, pair: str, workload: str) -> list[int]:
    return sorted({k[3] for k in ix if k[:3] == (engine, pair, workload)})


def length_pairs(ix: dict) -> list[dict]:
    """Runs 4x apart in output length on ~100-token prompts: low-effort at L against low-effort or
    high-effort (the same prompt family, as in the paper) at 4L."""
    rows = []
    for (engine, pair, wl, L, n, system), base in ix.items():
        if wl != "low-effort":
            continue
        for long_wl in ("low-effort", "high-effort"):
            long = ix.get((engine, pair, long_wl, 4 * L, n, system))
            if long is not None:
                rows.append({"engine": engine, "pair": pair, "system": system, "N": n, "short": f"{wl}@{L}",
                             "long": f"{long_wl}@{4 * L}", "change_pct": 100 * (long["tokens_per_s"] / base["tokens_per_s"] - 1)})
    return sorted(rows, key=lambda r: (r["engine"], r["pair"], r["system"], r["N"]))


def _ratio(ix, a, b) -> float | None:
    ra, rb = ix.get(a), ix.get(b)
    return ra["tokens_per_s"] / rb["tokens_per_s"] if ra and rb else None


def _target(name: str, value: float | None, target: float, above: bool = True, note: str = "") -> dict:
    met = None if value is None else (value >= target if above else value <= target)
    return {"name": name, "value": value, "target": target, "met": met, "note": note}


def analyse(runs: list[dict]) -> dict:
    ix = index(runs)
    targets = []
    lows = _lengths(ix, "sim", "sim", "low-effort")
    L = lows[0] if lows else None
    if L is not None:
        k = lambda n, s: ("sim", "sim", "low-effort", L, n, s)
        d4, s4 = ix.get(k(4, "aiorouter-delayed")), ix.get(k(4, "std-serving-http"))
        bound = ""
        if d4 and s4 and d4.get("ceiling_tokens_per_s"):
            bound = (f"bound: the throughput model's optimum {d4['dtmc_tokens_per_s']:.0f} tok/s = "
                     f"{d4['dtmc_tokens_per_s'] / s4['tokens_per_s']:.2f}x; any system, no waits, "
                     f"{d4['ceiling_tokens_per_s']:.0f} tok/s = {d4['ceiling_tokens_per_s'] / s4['tokens_per_s']:.2f}x")
        targets.append(_target(f"sim low-effort@{L}: delayed / Std HTTP, N=4", _ratio(ix, k(4, "aiorouter-delayed"),
                                                                                    k(4, "std-serving-http")), 3.0,
                               note=bound))
        targets.append(_target(f"sim low-effort@{L}: delayed N=16 / N=1", _ratio(ix, k(16, "aiorouter-delayed"),
                                                                               k(1, "aiorouter-delayed")), 8.0))
        u1, u16 = ix.get(k(1, "aiorouter-delayed")), ix.get(k(16, "aiorouter-delayed"))
        kept = u16["per_user_tokens_per_s"] / u1["per_user_tokens_per_s"] if u1 and u16 else None
        targets.append(_target(f"sim low-effort@{L}: delayed per-user speed N=16 / N=1", kept, 0.5))
    lp = length_pairs(ix)
    for row in lp:
        if row["engine"] == "sim" and row["system"] == "aiorouter-delayed":
            targets.append(_target(f"sim {row['short']} -> {row['long']}: delayed throughput change, N={row['N']} (%)",
                                   abs(row["change_pct"]), 10.0, above=False, note=f"{row['change_pct']:+.1f} %"))
    for L in _lengths(ix, "real", "cpu-tiny", "low-effort")[:1]:
        k = lambda s: ("real", "cpu-tiny", "low-effort", L, 4, s)
        inproc = _ratio(ix, k("aiorouter-delayed"), k("std-serving-inproc"))
        targets.append(_target(f"cpu-tiny low-effort@{L}: delayed / Std HTTP, N=4",
                               _ratio(ix, k("aiorouter-delayed"), k("std-serving-http")), 3.0,
                               note=f"in-process Std: {inproc:.2f}x" if inproc else ""))
    return {"targets": targets, "length_scaling": lp, "paper_side_by_side": side_by_side(ix, lp)}


def side_by_side(ix: dict, lp: list[dict]) -> list[dict]:
    def span(xs):
        xs = [x for x in xs if x is not None]
        return (min(xs), max(xs)) if xs else None

    rows = []
    for engine, pair in sorted({(k[0], k[1]) for k in ix}):
        gains = {k[4]: [] for k in ix}
        for k in ix:
            if k[:2] == (engine, pair) and k[5] == "aiorouter-delayed":
                gains[k[4]].append(_ratio(ix, k, k[:5] + ("std-serving-http",)))
        loss = [-r["change_pct"] for r in lp if (r["engine"], r["pair"], r["system"]) == (engine, pair, "std-serving-http")]
        ours = [r["change_pct"] for r in lp if (r["engine"], r["pair"], r["system"]) == (engine, pair, "aiorouter-delayed")]
        scale, kept = [], []
        for k in ix:
            if k[:2] == (engine, pair) and k[4] == 1 and k[5] == "aiorouter-delayed":
                r1, r16 = ix[k], ix.get(k[:4] + (16, k[5]))
                if r16:
                    scale.append(r16["tokens_per_s"] / r1["tokens_per_s"])
                    kept.append(100 * r16["per_user_tokens_per_s"] / r1["per_user_tokens_per_s"])
        rows.append({"engine": engine, "pair": pair, "gain_over_std_http_n4": span(gains.get(4, [])),
                     "gain_over_std_http": span([g for gs in gains.values() for g in gs]), "std_http_loss_pct": span(loss),
                     "aiorouter_change_pct": span(ours), "n16_over_n1": span(scale), "per_user_kept_pct": span(kept)})
    return rows


# -- markdown ---------------------------------------------------------------------------------------------
def _f(x, fmt="{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _span(s, fmt="{:.2f}", unit="") -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s[0])}{unit}" if abs(s[1] - s[0]) < 1e-9 else f"{fmt.format(s[0])} to {fmt.format(s[1])}{unit}"


def tables(data: dict) -> str:
    ix = index(data["runs"])
    m, prev = data["machine"], data.get("resumed_from")
    # a resumed sweep holds runs of two sessions (or more: resumed_from is the last one's machine)
    runs_s = sum(r.get("wall_s", 0.0) for r in data["runs"])
    kind = f"{'quick' if data['config']['quick'] else 'full'} run" + (", partial" if data.get("partial") else "")
    took = f"{data['duration_s'] / 60:.1f} min" if data.get("duration_s") else f"{runs_s / 60:.1f} min of runs"
    out = [f"Machine: {m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}; commit `{str(m.get('commit'))[:10]}`"
           + (f" (resuming runs made on `{str(prev.get('commit'))[:10]}`, load average {_load(prev.get('load_avg_start'))} "
              f"at start, {_load(prev.get('load_avg_end'))} at end)" if prev else "")
           + f"; {kind} of {len(data['runs'])} runs in {took}; load average {_load(m.get('load_avg_start'))} at start, "
           f"{_load(m.get('load_avg_end'))} at end. Policy random p = 0.35 everywhere; sim steps "
           f"{data['config']['sim_step_ms']} ms, slope {data['config']['sim_slope_ms']} ms per sequence.", ""]
    out += ["### Targets", "", "| target | measured | goal | met? | note |", "|---|---:|---:|---|---|"]
    for t in data["targets"]:
        goal = f"{'>=' if 'change' not in t['name'] else '<='} {t['target']:g}"
        out.append(f"| {t['name']} | {_f(t['value'])} | {goal} | {'-' if t['met'] is None else 'yes' if t['met'] else '**no**'} "
                   f"| {t['note']} |")
    out += ["", "### Side by side with the paper", "",
            "| figure | paper (A100s, SGLang, Qwen3-0.6B/32B) | " + " | ".join(f"{r['pair']} ({r['engine']})" for r in data["paper_side_by_side"]) + " |",
            "|---|---|" + "---|" * len(data["paper_side_by_side"])]
    sbs = data["paper_side_by_side"]
    out.append("| throughput over Std. Serving (paper: 15 algorithm-workload pairs; here: random p = 0.35, "
               "every workload) | 2.01-64.15x over the stronger baseline | " +
               " | ".join(f"N=4: {_span(r['gain_over_std_http_n4'], unit='x')}; all N: {_span(r['gain_over_std_http'], unit='x')}"
                          for r in sbs) + " |")
    out.append("| Std. Serving's loss when outputs grow 4x | 58.1-85.2 % | " +
               " | ".join(_span(r["std_http_loss_pct"], "{:.1f}", " %") for r in sbs) + " |")
    out.append("| aiorouter's change when outputs grow 4x | holds steady | " +
               " | ".join(_span(r["aiorouter_change_pct"], "{:+.1f}", " %") for r in sbs) + " |")
    out.append("| throughput N=16 / N=1 | 8.61x | " + " | ".join(_span(r["n16_over_n1"], unit="x") for r in sbs) + " |")
    out.append("| per-user speed kept at N=16 | 51.7 % | " + " | ".join(_span(r["per_user_kept_pct"], "{:.1f}", " %") for r in sbs) + " |")
    out += ["", "### Throughput, tokens/s (per-user tokens/s)", ""]
    systems = [s for s in SHORT if any(k[5] == s for k in ix)]
    for engine, pair, wl, L in sorted({k[:4] for k in ix}, key=lambda k: (k[0] != "sim", k[1], k[2], k[3])):
        desc = data.get("workloads", {}).get(f"{pair}/{wl}@{L}", {}).get("description", "")
        out += [f"**{pair} ({engine}), {wl}, {L} output tokens**" + (f" -- {desc}" if desc else ""), "",
                "| N | " + " | ".join(SHORT[s] for s in systems) + " | delayed / Std HTTP | delayed / Std in-proc |"
                + (" DTMC bound (delayed) |" if engine == "sim" else ""),
                "|---:|" + "---:|" * (len(systems) + 2) + ("---:|" if engine == "sim" else "")]
        for n in sorted({k[4] for k in ix if k[:4] == (engine, pair, wl, L)}):
            cells = []
            for s in systems:
                r = ix.get((engine, pair, wl, L, n, s))
                cells.append(f"{r['tokens_per_s']:.1f} ({r['per_user_tokens_per_s']:.1f})" if r else "-")
            k = lambda s: (engine, pair, wl, L, n, s)
            row = f"| {n} | " + " | ".join(cells) + f" | {_f(_ratio(ix, k('aiorouter-delayed'), k('std-serving-http')), '{:.2f}x')} " \
                  f"| {_f(_ratio(ix, k('aiorouter-delayed'), k('std-serving-inproc')), '{:.2f}x')} |"
            if engine == "sim":
                d = ix.get(k("aiorouter-delayed"), {}).get("dtmc_tokens_per_s")
                row += f" {_f(d, '{:.1f}')} |"
            out.append(row)
        out.append("")
    out += ["### Where a Std. Serving token's time goes (the paper's Table 10)", "",
            "Per token (= per request: each returns one) in ms, std-serving-http unless noted. *round trip*: the "
            "dispatcher's await of the server; *HTTP outside*: round trip minus the server's handler (client, "
            "loopback, aiohttp framing); *handling*: the handler minus the engine server (decode ids, encode reply); "
            "*queue*: waiting for the step in flight; *step*: the step the request rides in (*wake-up*: from its end to "
            "the reply), split per step into "
            "*admission + prefix match* (`Engine.add` + `Engine.schedule`), *forward* (a sim step's sleep), "
            "*KV update* (`Engine.finish` + `release`: pages written, full ones into the prefix cache); *policy*: "
            "route/send/receive in the dispatcher.", "",
            "| run | model | batch | round trip | HTTP outside | handling | queue | step | wake-up | admission + prefix match | forward | KV update | policy |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, r in sorted(ix.items(), key=lambda kv: (kv[0][0] != "sim", kv[0][1:5])):
        if k[5] not in ("std-serving-http", "std-serving-inproc") or "breakdown" not in r:
            continue
        if k[4] not in ((4,) if k[5] == "std-serving-inproc" else (4, 16)):
            continue  # N = 4 and 16 over HTTP, N = 4 in process (every run's split is in the JSON)
        for model, b in r["breakdown"].items():
            t, st = b["per_token_ms"], b["per_step_ms"]
            label = f"{k[1]} {k[2]}@{k[3]} N={k[4]}" + (" (in-proc)" if k[5] == "std-serving-inproc" else "")
            out.append(f"| {label} | {model} | {b['mean_batch']:.2f} | {t['round_trip']:.2f} | {t['http_outside_server']:.2f} "
                       f"| {t['server_http_handling']:.2f} | {t['queue']:.2f} | {t['step']:.2f} | {t['reply_wakeup']:.2f} | {st['admit_prefix_match']:.3f} "
                       f"| {st['forward']:.2f} | {st['kv_update']:.3f} | {t['policy']:.3f} |")
    return "\n".join(out) + "\n"


def _load(x) -> str:
    return "/".join(f"{v:.2f}" for v in x) if x else "?"


def write(data: dict, md: Path, json_path: Path) -> None:
    """Replace the generated block of `md` (between the markers), or append a section holding one."""
    block = f"{BEGIN}\n_Generated by `python -m bench.paper_regime` into this block; raw data: `{_rel(json_path)}`._\n\n" \
            f"{tables(data)}{END}"
    text = md.read_text() if md.is_file() else "# aiorouter in the paper's regime\n\n"
    if BEGIN in text and END in text:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## The paper's regime (`bench/paper_regime.py`)\n\n" + block + "\n"
    md.write_text(text)


def _rel(p: Path) -> str:
    root = Path(__file__).resolve().parent.parent
    return str(p.resolve().relative_to(root)) if p.resolve().is_relative_to(root) else str(p)


def summary(data: dict) -> str:
    lines = ["targets:"]
    for t in data["targets"]:
        lines.append(f"  {t['name']}: {_f(t['value'])} (goal {'<=' if 'change' in t['name'] else '>='} {t['target']:g}) "
                     f"{'-' if t['met'] is None else 'met' if t['met'] else 'MISSED'} {t['note']}")
    return "\n".join(lines)
