"""bench.modes' bookkeeping: the routing a run observed, and the summary it reports per N."""
import numpy as np
import pytest

from bench.modes import summarise
from bench.modes.model import observed_overhead, observed_routing, predicted_for


def _run(steps, computed, handoffs):
    return {"request_steps": steps, "tokens_computed": computed, "handoffs": handoffs}


def test_observed_routing_pools_runs():
    runs = [_run({"small": 300, "large": 100}, {"small": 600, "large": 500}, {"small->large": 90, "large->small": 100}),
            _run({"small": 100, "large": 50}, {"small": 200, "large": 250}, {"small->large": 30, "large->small": 40})]
    P, tau = observed_routing(runs, ["small", "large"])
    assert P == pytest.approx(np.array([[1 - 120 / 400, 120 / 400], [140 / 150, 1 - 140 / 150]]))
    assert P.sum(axis=1) == pytest.approx([1.0, 1.0])
    assert tau == pytest.approx([800 / 400, 750 / 150])
    # A model that never stepped: it stays put, one token a step.
    P, tau = observed_routing([_run({"small": 10, "large": 0}, {"small": 10}, {})], ["small", "large"])
    assert P[1] == pytest.approx([0.0, 1.0]) and tau[1] == 1.0


def test_observed_routing_counts_tau_in_the_steady_window_where_every_run_has_one():
    runs = [{**_run({"small": 300, "large": 100}, {"small": 600, "large": 500}, {"small->large": 90}),
             "window_steps": {"small": (100, 400), "large": (40, 240)}},
            {**_run({"small": 100, "large": 50}, {"small": 200, "large": 250}, {"small->large": 30}),
             "window_steps": {"small": (50, 50), "large": (10, 60)}}]
    P, tau = observed_routing(runs, ["small", "large"])
    assert tau == pytest.approx([450 / 150, 300 / 50])
    assert P[0, 1] == pytest.approx(120 / 400)  # routing: whole runs
    # one run without a window (its spans did not reach back): whole runs for tau too
    runs[1]["window_steps"] = {"small": None, "large": (10, 60)}
    assert observed_routing(runs, ["small", "large"])[1] == pytest.approx([800 / 400, 750 / 150])


def test_window_steps_counts_steps_that_start_inside_and_knows_when_spans_were_dropped():
    from aiorouter.metrics import SPANS_KEPT
    from bench.modes.interleaved import window_steps
    spans = [(0.0, 0.5, 2, 10), (0.5, 1.0, 3, 3), (1.0, 1.5, 1, 96), (2.0, 2.5, 4, 4)]
    assert window_steps(spans, (0.5, 2.0)) == (4, 99)
    assert window_steps([], (0.0, 1.0)) == (0, 0)
    full = [(1.0 + k, 1.5 + k, 1, 1) for k in range(SPANS_KEPT)]  # the oldest kept starts after the window
    assert window_steps(full, (0.5, 3.0)) is None
    assert window_steps(full, (1.0, 3.0)) == (2, 2)


def test_stagger_spreads_first_requests_over_one_request():
    from bench.modes.cycles import stagger
    assert [stagger(64, 4, k) for k in range(4)] == [16, 32, 48, 64]
    assert stagger(64, 1, 0) == 64 and stagger(3, 16, 0) == 1


def test_closed_loop_with_a_staggered_start_opens_the_window_when_every_first_request_ended():
    """2 clients, requests of 10 ticks; client 0's first is 2 ticks and client 1's 6: the window
    runs from the end of the last first request (~0.06 s) to the first client out of prompts."""
    import asyncio

    from bench.common import closed_loop

    async def send(p):
        for _ in range(p):
            await asyncio.sleep(0.01)
            yield "m"

    def first(k, p):
        return send([2, 6][k])

    res = asyncio.run(closed_loop(send, 2, [10] * 5, 5, first))
    assert res.tokens == 2 + 6 + 3 * 10
    # by then client 1 streamed 6 and client 0 its 2 and ~4 of its second: ~12, give or take a tick
    assert 0.055 <= res.ramp_seconds < 0.09 and 10 <= res.ramp_tokens <= 14
    assert res.window == pytest.approx((res.started + res.ramp_seconds, res.started + res.steady_seconds))
    assert res.steady_tok_s == pytest.approx((res.steady_tokens - res.ramp_tokens) / (res.steady_seconds - res.ramp_seconds))
    # without `first`, the window is the whole time to the drain
    plain = asyncio.run(closed_loop(send, 2, [10] * 4, 4))
    assert plain.ramp_seconds == 0.0 and plain.window[0] == plain.started


def test_observed_overhead_is_a_mean_per_step_over_runs():
    def run(loop, hop, steps):
        return {"overhead_ms": {"small": {"loop": loop, "hop": hop, "steps": steps},
                                "large": {"loop": 0.5, "hop": 0.1, "steps": 0}}}
    got = observed_overhead([run(0.2, 0.1, 100), run(0.4, 0.2, 300)], ["small", "large"])
    assert got[0] == pytest.approx(1e-3 * (0.3 * 100 + 0.6 * 300) / 400)
    assert got[1] == 0.0  # never stepped: nothing observed, nothing added


def test_summary_reads_off_the_targets():
    """Delayed against sync and eager on whole runs; the chain, and the best B, on the steady window."""
    pred = {"best_thresholds": [1, 3], "by_thresholds": {"1,1": 90.0, "1,2": 100.0, "1,3": 110.0},
            "sync_tok_s": 80.0, "eager_tok_s": 90.0, "startup": {"best_thresholds": [1, 2]}}

    def run(whole, steady, predicted, startup):
        return {"tok_s": whole, "steady_tok_s": steady, "predicted_tok_s": predicted, "startup_predicted_tok_s": startup}
    results = {"sync@3": run(85.0, 88.0, 80.0, 90.0), "eager@3": run(100.0, 101.0, 90.0, 99.0),
               "delayed@3": run(104.0, 110.0, 110.0, 120.0)}
    sweep = {"1,1": {"tok_s": 95.0, "steady_tok_s": 96.0}, "1,2": {"tok_s": 108.0, "steady_tok_s": 108.0},
             "1,3": {"tok_s": 105.0, "steady_tok_s": 112.0}}
    s = summarise(3, results, pred, sweep)
    assert s["delayed_over_best_of_sync_eager"] == pytest.approx(1.04)
    assert s["steady_delayed_over_best"] == pytest.approx(110 / 101)
    assert s["prediction_error"]["sync"] == pytest.approx(80 / 88 - 1)
    assert s["startup_prediction_error"]["delayed"] == pytest.approx(120 / 110 - 1)
    assert s["best_B_measured"] == "1,3" and s["whole_run_best_B_measured"] == "1,2"
    assert s["best_B_predicted"] == "1,3" and s["best_B_startup"] == "1,2"
    assert s["measured_loss_at_predicted_best"] == 0.0
    assert s["whole_run_measured_loss_at_predicted_best"] == pytest.approx(1 - 105 / 108)
    assert s["sweep_prediction_error"]["1,1"] == pytest.approx(90 / 96 - 1)
    assert predicted_for(pred, "delayed", (1, 2)) == 100.0 and predicted_for(pred, "sync", None) == 80.0
    assert "delayed_over_best_by_round" not in s  # no rounds recorded
    assert "sync_eager_fit" not in s  # separate runs fit on sync and eager only


def test_summary_reports_the_fit_on_sync_and_eager_alone_beside_the_final_one():
    alone = {"by_thresholds": {"1,1": 90.0, "1,2": 120.0}, "sync_tok_s": 70.0, "eager_tok_s": 90.0}
    pred = {"best_thresholds": [1, 2], "by_thresholds": {"1,1": 95.0, "1,2": 99.0}, "sync_tok_s": 80.0,
            "eager_tok_s": 95.0, "startup": {"best_thresholds": [1, 2]}, "sync_eager_fit": alone}
    results = {f"{m}@2": {"tok_s": v, "steady_tok_s": v, "predicted_tok_s": p, "startup_predicted_tok_s": p,
                          "sync_eager_fit_predicted_tok_s": a}
               for m, v, p, a in (("sync", 80.0, 80.0, 70.0), ("eager", 100.0, 95.0, 90.0), ("delayed", 100.0, 99.0, 120.0))}
    sweep = {"1,1": {"tok_s": 100.0, "steady_tok_s": 100.0}, "1,2": {"tok_s": 96.0, "steady_tok_s": 96.0}}
    s = summarise(2, results, pred, sweep)
    assert s["prediction_error"]["delayed"] == pytest.approx(-0.01)
    fit = s["sync_eager_fit"]
    assert fit["prediction_error"]["sync"] == pytest.approx(70 / 80 - 1)
    assert fit["best_B_predicted"] == "1,2" and fit["measured_loss_at_predicted_best"] == pytest.approx(0.04)
    assert fit["sweep_prediction_error"]["1,2"] == pytest.approx(120 / 96 - 1)


def test_summary_reads_the_best_b_against_the_cycles_where_the_sweep_has_it():
    pred = {"best_thresholds": [1, 2], "by_thresholds": {"1,1": 90.0, "1,2": 100.0},
            "startup": {"best_thresholds": [1, 2]}}
    results = {f"{m}@2": {"tok_s": 90.0, "steady_tok_s": 90.0, "predicted_tok_s": 90.0, "startup_predicted_tok_s": 90.0}
               for m in ("sync", "eager", "delayed")}
    # pooled, (1, 1) looks best; each window against its cycle, (1, 2) is
    sweep = {"1,1": {"tok_s": 100.0, "steady_tok_s": 100.0, "blocked_tok_s": 95.0},
             "1,2": {"tok_s": 96.0, "steady_tok_s": 96.0, "blocked_tok_s": 98.0}}
    s = summarise(2, results, pred, sweep)
    assert s["best_B_measured"] == "1,1" and s["measured_loss_at_predicted_best"] == pytest.approx(0.04)
    assert s["blocked_best_B_measured"] == "1,2" and s["blocked_measured_loss_at_predicted_best"] == 0.0
    del sweep["1,1"]["blocked_tok_s"]  # one point without it: not read that way
    assert "blocked_best_B_measured" not in summarise(2, results, pred, sweep)


def test_summary_pairs_the_modes_round_by_round():
    def run(rounds):
        return {"tok_s": float(np.median(rounds)), "steady_tok_s": 1.0, "predicted_tok_s": 1.0,
                "startup_predicted_tok_s": 1.0, "rounds_tok_s": rounds}
    results = {"sync@1": run([10.0, 12.0, 9.0]), "eager@1": run([11.0, 10.0, 8.0]), "delayed@1": run([10.0, 12.6, 9.9])}
    s = summarise(1, results, {}, {})
    assert s["delayed_over_best_of_sync_eager"] == pytest.approx(1.0)  # medians 10, 10 and 10
    # per round: 10 / 11, 12.6 / 12, 9.9 / 9 -> median 1.05
    assert s["delayed_over_best_by_round"] == pytest.approx(1.05)


def test_closed_loop_steady_window_ends_when_the_first_client_runs_dry():
    """3 clients, 4 requests of 10 tokens at one token a tick for requests 0-2 and of 30 for the
    last: the window holds 3 in flight until the first client finds no prompt left."""
    import asyncio

    from bench.common import closed_loop

    async def send(p):
        for _ in range(p):
            await asyncio.sleep(0.01)
            yield "m"

    res = asyncio.run(closed_loop(send, 3, [10, 10, 10, 30], 4))
    assert res.tokens == 60 and res.streamed == 60
    # the client that took the 4th request streams until ~0.4 s; the others ran dry at ~0.1 s,
    # when the first three requests' 30 tokens were streamed, give or take the tick they end on
    assert 0.09 <= res.steady_seconds < 0.2 and 28 <= res.steady_tokens <= 32
    summary = res.summary()
    assert summary["steady_tok_s"] == pytest.approx(res.steady_tokens / res.steady_seconds)
    assert 1.2 < summary["mean_in_flight"] < 2.0  # 3 for 0.1 s, then 1 for 0.3 s: (0.3 + 0.3 + 0.4) / 0.4


def test_served_profile_scales_the_profile_to_the_runs_forwards():
    from aiorouter.tuning import Contention, StepCost
    from bench.modes.model import PairProfile, served_profile

    cost = [StepCost(2e-3, 0.0, 0.1e-3), StepCost(20e-3, 0.0, 1e-3)]
    prof = PairProfile(["small", "large"], cost, Contention(2), [], [1, 2], 1.0, 1.0)
    # the large model steps alone, 1.2x its profile; the small one never overlaps it either
    spans_l = [(k * 0.1, k * 0.1 + 1.2 * cost[1](2, 4), 2, 4) for k in range(60)]
    spans_s = [(k * 0.1 + 0.05, k * 0.1 + 0.05 + cost[0](1, 1), 1, 1) for k in range(60)]
    runs = [{"spans": {"small": spans_s[:30], "large": spans_l[:30]}},
            {"spans": {"small": spans_s[30:], "large": spans_l[30:]}}]
    served, fit = served_profile(prof, runs)
    assert fit.scales == pytest.approx((1.0, 1.2)) and fit.steps == (60, 60)
    assert served.costs[1](2, 4) == pytest.approx(1.2 * cost[1](2, 4))
    assert served.contention.is_zero


def test_summary_reads_delayed_raced_against_the_better_of_sync_and_eager():
    pred = {"best_thresholds": [1, 1], "by_thresholds": {}, "startup": {"best_thresholds": [1, 1]}}
    results = {f"{m}@4": {"tok_s": t, "steady_tok_s": t, "predicted_tok_s": t, "startup_predicted_tok_s": t}
               for m, t in (("sync", 90.0), ("eager", 100.0), ("delayed", 95.0))}
    s = summarise(4, results, pred, {})
    assert s["delayed_over_best_of_sync_eager"] == pytest.approx(0.95) and "race_delayed" not in s
    # window by window, delayed 2 % over and 4 % under eager on the same prompts
    results["delayed@4"]["race"] = {"against": "eager", "tok_s": [102.0, 48.0], "against_tok_s": [100.0, 50.0]}
    r = summarise(4, results, pred, {})["race_delayed"]
    assert r["against"] == "eager" and r["pairs"] == 2 and r["ratio"] == pytest.approx((1.02 * 0.96) ** 0.5)
    assert r["same_schedule"] is False  # no schedule recorded for delayed: not known to be eager's
    results["delayed@4"]["schedule"] = "eager"  # the chain picked eager: eager raced itself
    assert summarise(4, results, pred, {})["race_delayed"]["same_schedule"] is True
