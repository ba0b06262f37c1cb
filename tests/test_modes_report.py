"""`python -m bench.modes report` reads the modes.json runs RESULTS.md cites.

The report is how a run's tables are read; these tests pin that each N gets its row, that the
race figures printed are the summary's, that "(the same schedule)" marks exactly the races where
delayed ran its opponent's schedule, and that every run RESULTS.md names is here to be read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.common import RESULTS
from bench.modes.report import main, markdown

RUNS = sorted(RESULTS.glob("modes-*/modes.json"))


def test_the_runs_results_md_cites_are_the_runs_kept() -> None:
    page = (RESULTS.parent / "RESULTS.md").read_text()
    cited = set(re.findall(r"bench/results/(modes-[\w-]+)/", page))
    assert cited and cited == {p.parent.name for p in RUNS}, (cited, RUNS)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.parent.name)
def test_every_run_reports_one_row_per_concurrency(path: Path) -> None:
    data = json.loads(path.read_text())
    text = markdown(data)
    for n in data["predictions"]:
        # the whole-run table and the predicted-against-measured table, and the sweep's where swept
        want = 2 + (n in data.get("sweep", {}))
        assert sum(line.startswith(f"| {n} |") for line in text.splitlines()) == want, (n, text)


def test_race_cells_are_the_summary_and_mark_the_same_schedule() -> None:
    data = json.loads((RESULTS / "modes-racemodes48b-smollm2" / "modes.json").read_text())
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
    assert marked == 3  # eager at N = 4 and 8, sync at 16; at N = 1 delayed ran eager and raced sync


def test_main_prints_each_file_and_plots_the_races(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "races.png"
    assert main([str(p) for p in RUNS] + ["--plot", str(png)]) == 0
    assert capsys.readouterr().out.count("Whole run, tok/s") == len(RUNS)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
