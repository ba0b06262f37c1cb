"""aiorouter.tuning.background: a re-solve runs in a child process at the lowest CPU priority, its
errors come back, and cancelling ends it at once."""
from __future__ import annotations

import operator
import os
import threading
import time

import pytest

from aiorouter.tuning.background import NICE, BackgroundCancelled, BackgroundSolver
from aiorouter.tuning.online import TuningCancelled


def test_runs_in_a_child_process_at_the_lowest_priority():
    solver = BackgroundSolver()
    assert solver.run(os.getpid) != os.getpid()
    assert solver.run(os.nice, 0) == NICE  # os.nice(0) reads the child's niceness


def test_an_error_in_the_child_is_raised_in_the_caller():
    with pytest.raises(ZeroDivisionError):
        BackgroundSolver().run(operator.truediv, 1, 0)


def test_cancel_ends_a_running_solve_and_refuses_later_ones():
    solver = BackgroundSolver()
    threading.Timer(1.0, solver.cancel).start()
    t0 = time.perf_counter()
    with pytest.raises(BackgroundCancelled):
        solver.run(time.sleep, 60)
    assert time.perf_counter() - t0 < 30  # ended, not slept out
    with pytest.raises(TuningCancelled):  # (the router's tuner treats it as a cancelled solve)
        solver.run(os.getpid)


def test_a_tuner_re_solved_in_the_child_equals_one_re_solved_in_this_process():
    import numpy as np

    from aiorouter.tuning import LatencyModel, Tuner, TunerConfig
    P, C = [[0.8, 0.2], [0.5, 0.5]], [[1.0, 1.0], [1.0, 1.0]]
    cfg = TunerConfig.build(P, C, [LatencyModel(6e-3, 0.1e-3), LatencyModel(28e-3, 0.5e-3)], 4, delta=1e-3)
    tuner = Tuner(cfg)
    cost = [LatencyModel(1e-3, 0.05e-3), LatencyModel(1e-3, 0.05e-3)]  # moves the step times: a re-solve
    here = tuner.propose(np.zeros((2, 2)), step_cost=cost)
    there = tuner.propose(np.zeros((2, 2)), step_cost=cost, runner=BackgroundSolver().run)
    assert here is not None and there is not None
    assert [(r.N, r.best, r.best_throughput) for r in there.solved.table.rows] == \
        [(r.N, r.best, r.best_throughput) for r in here.solved.table.rows]
    assert there.solved.schedules == here.solved.schedules
