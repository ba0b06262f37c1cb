"""bench.protocol_cost: each side really runs the default pair in its own process, the log-probability
side gets a log probability for every token, and the ratios are of the sides' medians."""
import json
from pathlib import Path

import pytest

from bench.protocol_cost import SIDES, main

ROOT = Path(__file__).resolve().parents[1]


def test_protocol_cost_runs_each_side_and_reports_their_ratios(tmp_path):
    out = tmp_path / "protocol_cost.json"
    # against this checkout itself: the bench's plumbing, not a figure
    assert main(["--against", str(ROOT), "--rounds", "1", "--n", "2", "--tokens", "4", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got["tok_s"]) == set(SIDES) and all(len(v) == 1 and v[0] > 0 for v in got["tok_s"].values())
    med = got["median_tok_s"]
    assert got["this_over_other"] == pytest.approx(med[SIDES[0]] / med[SIDES[1]], abs=1e-3)
    assert got["logprobs5_over_none"] == pytest.approx(med[SIDES[2]] / med[SIDES[0]], abs=1e-3)


def test_protocol_cost_needs_another_checkout():
    with pytest.raises(SystemExit):
        main(["--rounds", "1"])
