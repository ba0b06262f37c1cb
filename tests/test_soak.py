"""The soak's --quick run (bench/soak.py): a real `aiorouter serve` under 2 minutes of mixed load with
failures on purpose. Nothing but the injected requests may fail, no KV page may stay in use, the
prefix cache must give its pages back on a flush, RSS may not creep (the server on bench.soak's default
"bounded" glibc malloc settings: the check is for leaks, not glibc's retention; see MALLOC there), /health
must always answer."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.common import ROOT


@pytest.mark.slow
def test_soak_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.soak", "--quick", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    d = json.loads((tmp_path / "soak.json").read_text())
    assert d["requests_sent"] > 100 and d["completed"] > 0.6 * d["requests_sent"], d["requests_sent"]
    assert d["failed_other"] == 0, d["failures"]
    assert d["failed_injected"] > 0 and d["faults_not_fired"] == 0, d["by_kind"]
    assert d["kv_pages_in_use_after_drain"] == 0, d["kv"]
    kv = d["kv"]
    assert sum(kv["cached_after_drain"].values()) > 0  # the prefix cache held pages after the load ...
    assert kv["pages_freed_by_flush"] == kv["cached_after_drain"]  # ... and gave every one back
    assert sum(kv["cached_after_flush"].values()) == 0 and sum(kv["used_after_flush"].values()) == 0
    assert kv["preemptions"]["large"] > 0  # the bursts did drive the large pool dry
    assert d["rss_growth"] is not None and d["rss_growth"] < 0.05, d["rss_minute_medians_mb"]
    assert d["health"]["failures"] == 0 and d["health"]["checks"] >= 100, d["health"]
    assert d["router_tasks"] == {"running": 2, "stopped": 0}
    assert len(d["latency_windows"]) == 2 and all(w["n"] > 0 for w in d["latency_windows"])
    assert d["server_exit_code"] == 0
    assert proc.returncode == 0 and d["ok"], proc.stdout[-3000:]
    assert (tmp_path / "soak.png").stat().st_size > 0
