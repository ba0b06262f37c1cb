"""bench.modes_report reads every committed modes.json, old layouts included.

The report is how RESULTS.md's tables were made; these tests pin that each N gets its row, that the
race figures printed are the summary's, and that "(the same schedule)" marks exactly the races where
delayed ran its opponent's schedule.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.common import RESULTS
from bench.modes_report import main, markdown

RUNS = sorted(RESULTS.glob("modes-*/modes.json"))


def test_there_are_runs_to_read() -> None:
    assert len(RUNS) >= 10, RUNS


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.parent.name)
def test_every_run_reports_one_row_per_concurrency(path: Path) -> None:
    data = json.loads(path.read_text())
    text = markdown(data)
    for n in data["predictions"]:
        # the whole-run table and the predicted-against-measured table, and the sweep's where swept
        want = 2 + (n in data.get("sweep", {}))
        assert sum(line.startswith(f"| {n} |") for line in text.splitlines()) == want, (n, text)


def test_race_cells_are_the_summary_and_mark_the_same_schedule() -> None:
    data = json.loads((RESULTS / "modes-racemodes48-smollm2" / "modes.json").read_text())
    text = markdown(data)
    marked = 0
    for n, s in data["summary"].items():
        rd = s["race_delayed"]
        row = next(line for line in text.splitlines() if line.startswith(f"| {n} |"))
        assert f"race against {rd['against']}" in row
        assert f"**{rd['ratio']:.3f}** ({rd['pairs']} pairs; +-{100 * rd['log_se']:.1f}%)" in row
        same = data["results"][f"delayed@{n}"]["schedule"] == rd["against"]
        assert ("(the same schedule)" in row) == same, row
        marked += same
    assert marked == 2  # eager was raced at N = 4 and 16, sync (another schedule) at N = 1 and 8


def test_main_prints_each_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(RUNS[0]), str(RUNS[-1])]) == 0
    assert capsys.readouterr().out.count("Whole run, tok/s") == 2
