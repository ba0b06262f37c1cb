"""`python -m bench.modes [options]` runs the benchmark; `python -m bench.modes report RUN.json ...`
prints a run's tables (and --plot draws the races)."""
import sys

from bench.modes import main
from bench.modes.report import main as report

if __name__ == "__main__":
    argv = sys.argv[1:]
    raise SystemExit(report(argv[1:]) if argv[:1] == ["report"] else main(argv))
