"""aiorouter.tuning.service: a re-solve runs in a child process at the lowest CPU priority, its
errors come back, and cancelling ends it at once."""
from __future__ import annotations

import operator
import os
import threading
import time

import pytest

from aiorouter.tuning.search import NICE, ChildCancelled, ChildProcess
from aiorouter.tuning.service import BackgroundSolver
from aiorouter.tuning.learned import TuningCancelled


def test_runs_in_a_child_process_at_the_lowest_priority():
    solver = BackgroundSolver()
    assert solver.run(os.getpid) != os.getpid()
    assert solver.run(os.nice, 0) == NICE  # os.nice(0) reads the child's niceness
    if hasattr(os, "SCHED_IDLE"):  # Linux: below every normal thread, not just niced
        assert solver.run(os.sched_getscheduler, 0) == os.SCHED_IDLE


def test_the_child_imports_neither_torch_nor_the_router():
    # a re-solve's child is seconds of CPU on the models' cores: it must not start by importing them
    loaded = BackgroundSolver().run(eval, "sorted(__import__('sys').modules)")  # (evaluated in the child)
    assert not [m for m in loaded if m == "torch" or m.startswith(("torch.", "aiorouter.router", "engines"))]


def test_an_error_in_the_child_is_raised_in_the_caller():
    with pytest.raises(ZeroDivisionError):
        BackgroundSolver().run(operator.truediv, 1, 0)


def test_cancel_ends_a_running_solve_and_refuses_later_ones():
    solver = BackgroundSolver()
    threading.Timer(1.0, solver.cancel).start()
    t0 = time.perf_counter()
    with pytest.raises(ChildCancelled):
        solver.run(time.sleep, 60)
    assert time.perf_counter() - t0 < 30  # ended, not slept out
    with pytest.raises(TuningCancelled):  # (the router's tuner treats it as a cancelled solve)
        solver.run(os.getpid)


def test_a_tuner_re_solved_in_the_child_equals_one_re_solved_in_this_process():
    import numpy as np

    from aiorouter.tuning.inputs import LatencyModel
    from aiorouter.tuning.tuner import Tuner, TunerConfig
    P, C = [[0.8, 0.2], [0.5, 0.5]], [[1.0, 1.0], [1.0, 1.0]]
    # with a state budget, a re-solve also re-chooses the quantum: the child does both
    cfg = TunerConfig.build(P, C, [LatencyModel(6e-3, 0.1e-3), LatencyModel(28e-3, 0.5e-3)], 4, delta=1e-3,
                            table_states=20_000)
    tuner = Tuner(cfg)
    cost = [LatencyModel(1e-3, 0.05e-3), LatencyModel(1e-3, 0.05e-3)]  # moves the step times: a re-solve
    here = tuner.propose(np.zeros((2, 2)), step_cost=cost)
    there = tuner.propose(np.zeros((2, 2)), step_cost=cost, runner=BackgroundSolver().run)
    assert here is not None and there is not None
    assert [(r.N, r.best, r.best_throughput) for r in there.solved.table.rows] == \
        [(r.N, r.best, r.best_throughput) for r in here.solved.table.rows]
    assert there.solved.schedules == here.solved.schedules
    assert there.solved.delta == here.solved.delta != cfg.delta


def test_a_re_solve_whose_quantum_cannot_fit_keeps_the_schedule():
    import numpy as np

    from aiorouter.tuning.inputs import LatencyModel
    from aiorouter.tuning.tuner import Tuner, TunerConfig
    P, C = [[0.5, 0.5], [0.5, 0.5]], [[1.0, 1.0], [1.0, 1.0]]
    lat = [LatencyModel(1e-3, 1e-5), LatencyModel(20e-3, 1e-3)]
    tuner = Tuner(TunerConfig.build(P, C, lat, 16, delta=20e-3, table_states=1000))
    before = [tuner.schedule(N) for N in range(1, 17)]
    # the large model's step grows to 0.5-1.3 s against the small one's 1 ms: no quantum keeps
    # the N = 1..16 table within 1,000 states
    slow = [LatencyModel(1e-6, 1e-7), LatencyModel(480e-3, 49e-3)]
    assert tuner.propose(np.zeros((2, 2)), step_cost=slow, runner=BackgroundSolver().run) is None
    assert [tuner.schedule(N) for N in range(1, 17)] == before


def test_a_search_child_answers_many_requests_in_one_process_and_keeps_serving_after_an_error():
    child = ChildProcess()
    try:
        pid = child.run(os.getpid)
        assert pid != os.getpid() and child.run(os.nice, 0) == os.nice(0)  # as this one: only the re-solve idles
        with pytest.raises(ZeroDivisionError):
            child.run(operator.truediv, 1, 0)
        assert child.run(os.getpid) == pid  # the same child, still serving
    finally:
        child.close()
    assert child.exit_code == 0  # it ended on its own once its stdin closed, not by a signal
    with pytest.raises(ChildCancelled):
        child.run(os.getpid)
    busy = ChildProcess()
    busy.run(os.getpid)
    busy.kill()  # (cancelling: a signal, whatever it is doing)
    assert busy.exit_code is not None and busy.exit_code < 0


def test_a_search_child_runs_this_checkouts_code_from_any_working_directory(tmp_path, monkeypatch):
    # An `aiorouter` folder where the parent runs (a second checkout, say) must not replace the
    # package the parent runs: the child would solve with other code, and unpickle its own classes.
    import aiorouter.tuning.search as search

    (tmp_path / "aiorouter" / "tuning").mkdir(parents=True)
    for f in ("aiorouter/__init__.py", "aiorouter/tuning/__init__.py"):
        (tmp_path / f).write_text("raise ImportError('the wrong checkout')\n")
    (tmp_path / "aiorouter" / "tuning" / "search.py").write_text("raise ImportError('the wrong checkout')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    child = ChildProcess()
    try:
        got = child.run(eval, "__import__('aiorouter.tuning.search').tuning.search.__file__")
    finally:
        child.close()
    assert got == search.__file__
