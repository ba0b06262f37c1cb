"""bench.repeats: which runs a round makes, and how rounds become ratio statistics."""
from bench.repeats import needed_runs, summarize, table
from bench.run import RATIOS


def test_a_round_runs_every_ratio_operand_once():
    runs = needed_runs()
    assert len(runs) == len(set(runs))
    operands = {(wl, n, s) for _, num, den, wl, nn, nd, _ in RATIOS for (n, s) in ((nn, num), (nd, den))}
    assert set(runs) == operands
    assert runs == sorted(runs, key=lambda r: (r[0], r[1]))  # grouped by (workload, N): systems side by side


def test_summary_takes_each_round_ratio_and_skips_failed_runs():
    k = lambda n, s: f"low-effort|{n}|{s}"  # noqa: E731
    rounds = [
        {k(4, "aiorouter"): 300.0, k(4, "std-serving"): 150.0, k(1, "aiorouter"): 100.0, k(16, "aiorouter"): 520.0},
        {k(4, "aiorouter"): 330.0, k(4, "std-serving"): 100.0, k(1, "aiorouter"): 110.0, k(16, "aiorouter"): 440.0},
        {k(4, "aiorouter"): 320.0, k(4, "std-serving"): None, k(1, "aiorouter"): 100.0, k(16, "aiorouter"): 500.0},
    ]
    by = {s["name"]: s for s in summarize(rounds)}
    std = by["aiorouter / Std. Serving, N=4, low-effort"]
    assert std["values"] == [2.0, 3.3] and std["rounds"] == 2 and std["rounds_met"] == 1  # the failed run drops out
    assert abs(std["median"] - 2.65) < 1e-9 and std["min"] == 2.0 and std["max"] == 3.3
    scale = by["throughput N=16 / N=1 (aiorouter)"]
    assert scale["values"] == [5.2, 4.0, 5.0] and scale["median"] == 5.0 and scale["rounds_met"] == 2
    assert by["eager / sync, N=4"]["values"] == [] and by["eager / sync, N=4"]["median"] is None
    md = table(summarize(rounds), {"rounds": rounds, "config": {"requests_per_client": 3},
                                   "machine": {"commit": "abcdef0123"}, "duration_s": 600})
    assert "| eager / sync, N=4 | >= 1.2x | not measured |" in md
    assert "| throughput N=16 / N=1 (aiorouter) | >= 5x | 5.00x | 4.00 - 5.20 | 2 of 3 | 5.20, 4.00, 5.00 |" in md
