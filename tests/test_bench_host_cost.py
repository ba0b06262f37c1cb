"""bench.host_cost: the ceiling benchmark runs on the real runtime (sim models) and its profile
accounts for the whole of a token's measured host time."""
import json

import pytest

from bench.host_cost import main


def test_host_cost_measures_every_token_and_splits_its_time(tmp_path):
    out = tmp_path / "host_cost.json"
    assert main(["--n", "4", "--modes", "eager,sync", "--tokens", "16", "--rounds", "1", "--profile",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["N"], r["mode"], r["tokens"]) for r in rows] == [(4, "eager", 64), (4, "sync", 64)]
    for r in rows:
        (us,) = r["this_us_per_token"]
        # tok/s from the unrounded median; `us` is that median rounded to 0.01
        assert us > 0 and round(1e6 / (us + 0.005)) <= r["this_tok_s"] <= round(1e6 / (us - 0.005))
        parts = r["parts_us_per_token"]
        assert sum(parts.values()) == pytest.approx(us, rel=0.01)  # shares of the whole, nothing dropped
        # every part matched something: a renamed function or file that PARTS names fails here, not
        # silently in the figures (its time would fall into a neighbour or "other")
        assert all(v > 0 for k, v in parts.items() if k != "other"), parts
