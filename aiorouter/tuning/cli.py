"""`aiorouter tune`: print B* and every candidate's predicted tokens/s per N.

    aiorouter tune --P "0.65,0.35;1,0" --C "1,0;1,0" --latency-ms 6.0,27.9 \
                   --concurrency 1-8 [--delta-ms 0.1|auto] [--latency-slope-ms 0.1,0.5]

An explicit --delta-ms is honoured (a chain over --max-states stops with an
error that names the limit); `auto` picks delta from a state budget as the
router does at start-up (`dtmc.choose_delta`).

`main(argv)` takes the arguments after `tune` (server/cli.py delegates to it);
also runnable as `python -m aiorouter.tuning.cli ...`.  Exit status 0 on
success, 2 on bad input (the message names the problem).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence, TextIO

from .dtmc import DEFAULT_MAX_STATES, DEFAULT_TABLE_STATES, choose_delta
from .inputs import LatencyModel, SystemSpec
from .search import SolveCache, ThresholdTable, threshold_table

def parse_matrix(text: str, name: str) -> list[list[float]]:
    """'0.65,0.35;1,0' -> [[0.65, 0.35], [1.0, 0.0]] (rows split by ';')."""
    try:
        rows = [[float(x) for x in row.split(",")] for row in text.strip().split(";") if row.strip()]
    except ValueError:
        raise ValueError(f"--{name}: cannot parse {text!r}; expected rows like '0.65,0.35;1,0'") from None
    if not rows:
        raise ValueError(f"--{name} is empty")
    if len({len(r) for r in rows}) != 1:
        raise ValueError(f"--{name}: rows have different lengths in {text!r}")
    return rows


def parse_floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name}: cannot parse {text!r}; expected numbers like '6.0,27.9'") from None


def parse_concurrency(text: str) -> tuple[int, int]:
    """'1-8' -> (1, 8); '4' -> (4, 4)."""
    try:
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-", 1))
        else:
            lo = hi = int(text)
    except ValueError:
        raise ValueError(f"--concurrency: cannot parse {text!r}; expected 'N' or 'LO-HI'") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"--concurrency {text!r}: need 1 <= LO <= HI")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="aiorouter tune",
        description="Solve the delayed-batching throughput model (DTMC) and print the "
        "optimal thresholds B* for each concurrency N.",
    )
    p.add_argument("--P", required=True, help="routing matrix, rows separated by ';'")
    p.add_argument("--C", required=True, help="committed-token matrix, same layout as P")
    p.add_argument("--latency-ms", required=True, help="per-model step latency in ms (at batch 1 "
                   "when --latency-slope-ms is given: L_i(b) = L_i + slope_i * (b - 1))")
    p.add_argument("--latency-slope-ms", default=None,
                   help="per-model extra ms per request in the batch (batch-dependent latency)")
    p.add_argument("--concurrency", required=True, help="N or a range LO-HI, e.g. 1-8")
    p.add_argument("--delta-ms", default="0.1",
                   help="time quantum in ms (default 0.1), or 'auto': the most accurate quantum whose "
                   "table fits --table-states")
    p.add_argument("--table-states", type=int, default=DEFAULT_TABLE_STATES,
                   help=f"state budget of the whole table for --delta-ms auto (default {DEFAULT_TABLE_STATES:,})")
    p.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES,
                   help=f"state-space limit per chain (default {DEFAULT_MAX_STATES:,})")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: the CPUs, at most 4)")
    p.add_argument("--top", type=int, default=0,
                   help="show only the best K candidates per N (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def spec_from_args(args: argparse.Namespace) -> SystemSpec:
    P = parse_matrix(args.P, "P")
    C = parse_matrix(args.C, "C")
    lat_ms = parse_floats(args.latency_ms, "latency-ms")
    slope_ms = parse_floats(args.latency_slope_ms, "latency-slope-ms") if args.latency_slope_ms else [0.0] * len(lat_ms)
    if len(slope_ms) != len(lat_ms):
        raise ValueError(f"--latency-slope-ms has {len(slope_ms)} values but --latency-ms has {len(lat_ms)}")
    for i, (a, c) in enumerate(zip(lat_ms, slope_ms)):
        if a < 0 or c < 0:
            raise ValueError(f"latency of model {i} must be non-negative (got {a} ms, slope {c} ms)")
        if c > a:
            raise ValueError(f"model {i}: latency at batch 1 ({a} ms) is below its slope ({c} ms/request)")
    # L(b) = a + c*b with L(1) equal to the given latency.
    models = [LatencyModel(a=(a - c) / 1e3, c=c / 1e3) for a, c in zip(lat_ms, slope_ms)]
    if args.delta_ms.strip().lower() == "auto":
        _, hi = parse_concurrency(args.concurrency)
        choice = choose_delta(P, models, hi, table_states=args.table_states,
                              max_states=args.max_states)
        print(f"aiorouter tune: {choice.describe()}", file=sys.stderr)
        return SystemSpec.build(P, C, models, choice.delta)
    try:
        delta_ms = float(args.delta_ms)
    except ValueError:
        raise ValueError(f"--delta-ms: expected a number of ms or 'auto', got {args.delta_ms!r}") from None
    if not delta_ms > 0:
        raise ValueError(f"--delta-ms must be positive, got {args.delta_ms}")
    return SystemSpec.build(P, C, models, delta_ms / 1e3)


def format_table(table: ThresholdTable, top: int = 0) -> str:
    lines = []
    for row in table.rows:
        lines.append(
            f"N={row.N:<3d} B*={row.best}  predicted {row.best_throughput:.1f} tokens/s  "
            f"({len(row.candidates)} feasible B, "
            f"{sum(c.num_states for c in row.candidates):,} states, {row.seconds:.2f}s)"
        )
        cands = sorted(row.candidates, key=lambda r: -r.throughput)
        if top > 0:
            cands = cands[:top]
        width = max(len(str(c.B)) for c in cands)
        lines.append(f"    {'B':<{width}}  {'tokens/s':>10}  {'vs B*':>7}  {'states':>9}")
        for c in cands:
            mark = "*" if c.B == row.best else " "
            lines.append(
                f"  {mark} {str(c.B):<{width}}  {c.throughput:10.2f}  "
                f"{100 * c.throughput / row.best_throughput:6.1f}%  {c.num_states:9,d}"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as e:  # argparse already printed usage / the error
        return int(e.code or 0)
    try:
        spec = spec_from_args(args)
        lo, hi = parse_concurrency(args.concurrency)
        t0 = time.perf_counter()
        table = threshold_table(spec, hi, min_concurrency=lo, max_states=args.max_states,
                                cache=SolveCache(), workers=args.workers,
                                progress=not args.no_progress)
    except ValueError as e:
        print(f"aiorouter tune: error: {e}", file=sys.stderr)
        return 2
    M = spec.M
    lat = ", ".join(
        f"{1e3 * m.a:.3g}+{1e3 * m.c:.3g}*b ms" if m.c else f"{1e3 * m.a:.3g} ms" for m in spec.latency
    )
    print(f"DTMC threshold search: M={M} models, latency [{lat}], delta={1e3 * spec.delta:g} ms, "
          f"N={lo}..{hi}", file=out)
    print(format_table(table, args.top), file=out)
    print(f"solved in {time.perf_counter() - t0:.2f}s", file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
