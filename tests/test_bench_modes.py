"""bench.modes' bookkeeping: the routing a run observed, and the summary it reports per N."""
import numpy as np
import pytest

from bench.modes import summarise
from bench.modes_model import observed_overhead, observed_routing, predicted_for


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


def test_observed_overhead_is_a_mean_per_step_over_runs():
    def run(loop, hop, steps):
        return {"overhead_ms": {"small": {"loop": loop, "hop": hop, "steps": steps},
                                "large": {"loop": 0.5, "hop": 0.1, "steps": 0}}}
    got = observed_overhead([run(0.2, 0.1, 100), run(0.4, 0.2, 300)], ["small", "large"])
    assert got[0] == pytest.approx(1e-3 * (0.3 * 100 + 0.6 * 300) / 400)
    assert got[1] == 0.0  # never stepped: nothing observed, nothing added


def test_summary_reads_off_the_targets():
    pred = {"best_thresholds": [1, 3], "by_thresholds": {"1,1": 90.0, "1,2": 100.0, "1,3": 110.0},
            "sync_tok_s": 80.0, "eager_tok_s": 90.0}
    results = {"sync@3": {"tok_s": 85.0, "predicted_tok_s": 80.0}, "eager@3": {"tok_s": 100.0, "predicted_tok_s": 90.0},
               "delayed@3": {"tok_s": 104.0, "predicted_tok_s": 110.0}}
    sweep = {"1,1": {"tok_s": 95.0}, "1,2": {"tok_s": 108.0}, "1,3": {"tok_s": 105.0}}
    s = summarise(3, results, pred, sweep)
    assert s["delayed_over_best_of_sync_eager"] == pytest.approx(1.04)
    assert s["prediction_error"]["sync"] == pytest.approx(80 / 85 - 1)
    assert s["best_B_measured"] == "1,2" and s["best_B_predicted"] == "1,3"
    assert s["measured_loss_at_predicted_best"] == pytest.approx(1 - 105 / 108)
    assert s["sweep_prediction_error"]["1,1"] == pytest.approx(90 / 95 - 1)
    assert predicted_for(pred, "delayed", (1, 2)) == 100.0 and predicted_for(pred, "sync", None) == 80.0
