"""Plots of a bench/run.py JSON (matplotlib, Agg):

* ``<name>-throughput.png``: output tokens/s vs concurrency N, one line per system, one panel per
  (pair, workload);
* ``<name>-tradeoff.png``: throughput vs per-user speed as N grows (the paper's Figure 1b), one
  panel per (pair, workload);
* ``<name>-ablation.png``: sync / eager / delayed throughput at each N (one panel per pair, on
  low-effort or the first workload measured);

(`python -m bench.run report` redraws them from a saved run); and `modes_races`, `soak` and
`dtmc_validation`, which plot bench.modes', bench.soak's and bench.dtmc_validation's runs.
"""
from __future__ import annotations

from pathlib import Path

STYLE = {"aiorouter": ("tab:red", "o", "-"), "eager": ("tab:orange", "s", "--"), "sync": ("tab:brown", "v", "--"),
         "std-serving": ("tab:blue", "^", "-"), "hf-naive": ("tab:purple", "D", "-"),
         "large-alone": ("tab:gray", "x", ":"), "small-alone": ("tab:green", "+", ":")}


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _series(cell: dict, system: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for n in sorted(cell, key=int):
        r = cell[n].get(system)
        if r and not r.get("error") and r.get(key) is not None:
            xs.append(int(n))
            ys.append(r[key])
    return xs, ys


def _panels(data: dict) -> list[tuple[str, str, dict]]:
    return [(p, w, cell) for p, wls in data["results"].items() for w, cell in wls.items()]


def _grid(plt, k: int, w: float = 4.6, h: float = 3.6):
    cols = min(3, max(1, k))
    rows = -(-k // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(max(w * cols, 7.5), h * rows), squeeze=False)
    for ax in axes.flat[k:]:
        ax.set_visible(False)
    return fig, list(axes.flat)


def _label(data: dict, s: str) -> str:
    return data.get("systems", {}).get(s, s)


def _save(plt, fig, path: Path, legend_from=None) -> Path:
    """One legend under every panel (taken from the first), then write and free the figure."""
    if legend_from is not None:
        handles, labels = legend_from.get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8)
        fig.tight_layout(rect=(0, 0.1, 1, 1))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput(data: dict, path: Path) -> Path:
    plt = _plt()
    panels = _panels(data)
    fig, axes = _grid(plt, len(panels))
    for ax, (pair, wl, cell) in zip(axes, panels):
        for s in data["config"]["systems"]:
            xs, ys = _series(cell, s, "tok_s")
            if xs:
                c, m, ls = STYLE.get(s, ("k", ".", "-"))
                ax.plot(xs, ys, color=c, marker=m, linestyle=ls, label=_label(data, s))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ns = sorted({int(n) for n in cell})
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("concurrency N (closed-loop clients)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{pair}, {wl}")
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, legend_from=next(iter(axes)))


def tradeoff(data: dict, path: Path) -> Path:
    plt = _plt()
    panels = _panels(data)
    fig, axes = _grid(plt, len(panels))
    for ax, (pair, wl, cell) in zip(axes, panels):
        for s in data["config"]["systems"]:
            ns, thr = _series(cell, s, "tok_s")
            ns2, per_user = _series(cell, s, "per_user_tok_s")
            keep = [n for n in ns if n in ns2]
            if not keep:
                continue
            x = [per_user[ns2.index(n)] for n in keep]
            y = [thr[ns.index(n)] for n in keep]
            c, m, ls = STYLE.get(s, ("k", ".", "-"))
            ax.plot(x, y, color=c, marker=m, linestyle=ls, label=_label(data, s))
            for n, xi, yi in zip(keep, x, y):
                ax.annotate(f"{n}", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7, color=c)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("per-user speed (tokens/s, median request)")
        ax.set_ylabel("throughput (output tokens/s)")
        ax.set_title(f"{pair}, {wl}: N = 1 .. 16")
        ax.grid(alpha=0.3)
    return _save(plt, fig, path, legend_from=next(iter(axes)))


def ablation(data: dict, path: Path) -> Path:
    plt = _plt()
    modes = [m for m in ("sync", "eager", "aiorouter") if m in data["config"]["systems"]]
    pairs = list(data["results"])
    fig, axes = _grid(plt, max(1, len(pairs)), 5.2, 3.6)
    for ax, pair in zip(axes, pairs):
        wls = data["results"][pair]
        wl = "low-effort" if "low-effort" in wls else next(iter(wls))
        cell = wls[wl]
        ns = sorted(cell, key=int)
        width = 0.8 / max(1, len(modes))
        for k, m in enumerate(modes):
            ys = [(cell[n].get(m) or {}).get("tok_s") or 0.0 for n in ns]
            xs = [i + (k - (len(modes) - 1) / 2) * width for i in range(len(ns))]
            ax.bar(xs, ys, width, color=STYLE[m][0], label={"aiorouter": "delayed"}.get(m, m))
        ax.set_xticks(range(len(ns)), [f"N={n}" for n in ns])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"execution modes: {pair}, {wl}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path)


def soak(data: dict, path: Path) -> Path:
    """bench/soak.py's run over time: request latency (p50, p99 in 10 s windows), the server's RSS,
    and each model's KV pages in use and held by the prefix cache (the long-prompt bursts show)."""
    plt = _plt()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True)
    lat = [w for w in data["latency_10s"] if w["n"]]
    mins = [(w["start_s"] + 5) / 60 for w in lat]
    ax = axes[0]
    ax.plot(mins, [w["p50_s"] for w in lat], color="tab:blue", label="p50 (10 s windows)")
    ax.plot(mins, [w["p99_s"] for w in lat], color="tab:red", label="p99 (10 s windows)")
    ax.set_yscale("log")
    ax.set_ylabel("request latency (s)")
    ax.legend(fontsize=8, loc="upper left")
    cols = data["timeline_columns"]
    tl = [dict(zip(cols, row)) for row in data["timeline"]]
    t = [r["t_s"] / 60 for r in tl]
    axes[1].plot(t, [r["rss_mb"] for r in tl], color="tab:purple")
    axes[1].set_ylabel("server RSS (MB)")
    ax = axes[2]
    for model, color in (("small", "tab:green"), ("large", "tab:orange")):
        ax.plot(t, [r[f"kv_used_{model}"] for r in tl], color=color, label=f"{model}: in use")
        ax.plot(t, [r[f"kv_cached_{model}"] for r in tl], color=color, linestyle=":", label=f"{model}: prefix cache")
        total = data["kv"]["total"].get(model)
        if total:
            ax.axhline(total, color=color, linewidth=0.6, alpha=0.5)
    ax.set_ylabel("KV pages")
    ax.set_xlabel("minutes of load (negative: warm-up)")
    ax.legend(fontsize=8, ncol=2, loc="upper left")
    for ax in axes:
        ax.axvline(0, color="k", linewidth=0.6, alpha=0.4)
        ax.grid(alpha=0.3)
    m = data["machine"]
    fig.suptitle(f"soak: {data['requests_sent']} requests, concurrency {data['concurrency']}, "
                 f"{data['failed_other']} unexpected failures (load avg {m['load_avg'][0]:.1f} on {m['cores']} cores)",
                 fontsize=10)
    return _save(plt, fig, path)


def modes_races(runs: list[dict], path: Path) -> Path:
    """bench.modes' headline: delayed against the better of sync and eager at each N, read by the
    race (ABBA pairs of fresh windows) with its standard error, one line per pair."""
    import math
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for data, color in zip(runs, ("tab:red", "tab:blue", "tab:green")):
        ns = sorted(data["summary"], key=int)
        races = [data["summary"][n]["race_delayed"] for n in ns]
        ys = [r["ratio"] for r in races]
        # the race's standard error is of the log ratio: its band is asymmetric around the ratio
        lo = [y - y * math.exp(-r["log_se"]) for y, r in zip(ys, races)]
        hi = [y * math.exp(r["log_se"]) - y for y, r in zip(ys, races)]
        ax.errorbar([int(n) for n in ns], ys, yerr=[lo, hi], color=color, marker="o", capsize=3,
                    label=f"{data['pair']} ({races[0]['pairs']} pairs a race)")
    ax.axhline(1.0, color="k", linewidth=0.6)
    ax.axhline(0.97, color="k", linewidth=0.6, linestyle=":", label="target 0.97")
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 8, 16], ["1", "4", "8", "16"])
    ax.set_xlabel("concurrency N (closed-loop clients)")
    ax.set_ylabel("delayed / best of sync, eager")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def dtmc_validation(rows: list[dict], ns: list[int], path: Path) -> Path:
    """The chain's predicted throughput against B_1 (lines) and the runtime's measured points, per N."""
    plt = _plt()
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
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def make_all(data: dict, out_dir: Path, name: str) -> list[Path]:
    out_dir = Path(out_dir)
    if not any(cell for wls in data["results"].values() for cell in wls.values()):
        return []
    out = [throughput(data, out_dir / f"{name}-throughput.png"), tradeoff(data, out_dir / f"{name}-tradeoff.png")]
    if any(m in data["config"]["systems"] for m in ("sync", "eager", "aiorouter")):
        out.append(ablation(data, out_dir / f"{name}-ablation.png"))
    return out

