"""Schedules measured in turn on one router (bench.modes): Router.set_schedule and
the steady closed loop's windows, on SimEngine."""
from __future__ import annotations

import numpy as np
import pytest

from aiorouter import Router, RouterConfig
from bench.modes.interleaved import SteadyLoop, pooled

SIM = {"small": {"engine": "sim", "latency_ms": 2.0}, "large": {"engine": "sim", "latency_ms": 6.0}}
ARGS = dict(policy="random", policy_args={"p": 0.35, "seed": 1})


async def test_set_schedule_switches_every_concurrency_while_serving():
    async with Router(SIM, RouterConfig(**ARGS, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=4)) as r:
        r.set_schedule("sync")
        assert [r.schedule(n) for n in range(1, 5)] == ["sync"] * 4
        res = await r.generate([1, 2, 3], max_tokens=12, ignore_eos=True)  # serves under the new schedule
        assert len(res.token_ids) == 12
        r.set_schedule("delayed", {"large": 3})
        assert r.schedule(2) == "delayed" and r.thresholds(2) == {"small": 1, "large": 3}
        r.set_schedule("eager", {"large": 3})  # eager is every B = 1, whatever is passed
        assert r.schedule(4) == "eager" and r.thresholds(4) == {"small": 1, "large": 1}
        with pytest.raises(ValueError, match="unknown schedule 'fast'"):
            r.set_schedule("fast")
        with pytest.raises(ValueError, match="needs thresholds"):
            r.set_schedule("delayed")
        with pytest.raises(ValueError, match="unknown model 'huge'"):
            r.set_schedule("delayed", {"huge": 2})
        assert len((await r.generate([4, 5], max_tokens=5, ignore_eos=True)).token_ids) == 5  # still serving


async def test_set_schedule_refuses_a_router_whose_schedule_it_does_not_own():
    with pytest.raises(RuntimeError, match="not started"):
        Router(SIM, RouterConfig(**ARGS, thresholds={"large": 2})).set_schedule("sync")
    async with Router(SIM, RouterConfig(**ARGS, mode="eager", thresholds={"large": 1})) as r:
        with pytest.raises(ValueError, match="mode 'eager'"):
            r.set_schedule("sync")
    async with Router(SIM, RouterConfig(**ARGS, tune_concurrency=2, max_concurrency=2)) as r:  # thresholds="auto"
        with pytest.raises(ValueError, match="its tuner owns the schedule"):
            r.set_schedule("sync")


async def test_steady_loop_windows_start_and_end_on_answers_and_never_repeat_a_prompt():
    asked = []

    def prompt_at(i):
        asked.append(i)
        return [1 + i % 7, 2, 3]

    async with Router(SIM, RouterConfig(**ARGS, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=4)) as r:
        async with SteadyLoop(r, 3, prompt_at, 8, first_tokens=lambda k: 2 + 2 * k) as loop:
            await loop.ramped.wait()
            w = [await loop.measure(m, {"small": 1, "large": 2}, 0.05, 0.3, window_requests=5)
                 for m in ("sync", "delayed", "sync")]
            finished = loop.finished
        assert r.num_active == 0  # leaving the loop cancelled its requests, and the router dropped them
    assert asked == list(range(len(asked))) and finished >= 3
    assert [x["schedule"] for x in w] == ["sync", "delayed", "sync"]
    assert w[0]["thresholds"] is None and w[1]["thresholds"] == {"small": 1, "large": 2}
    for x in w:
        assert x["seconds"] >= 0.3 and x["requests"] >= 5 and x["tokens"] > 0 and x["tok_s"] == pytest.approx(x["tokens"] / x["seconds"])
        assert 2.0 < x["mean_in_flight"] <= 3.0  # three clients, each between two requests only briefly
        assert x["request_steps"]["small"] > 0 and x["handoffs"].get("small->large", 0) > 0
        assert x["window_steps"]["small"][0] <= x["request_steps"]["small"]  # steps begun in the window
    both = pooled([w[0], w[2]])
    assert both["tok_s"] == pytest.approx((w[0]["tokens"] + w[2]["tokens"]) / (w[0]["seconds"] + w[2]["seconds"]))
    assert both["rounds_tok_s"] == [w[0]["tok_s"], w[2]["tok_s"]] and both["windows"] == 2
    assert both["requests"] == w[0]["requests"] + w[2]["requests"]
    assert both["request_steps"]["large"] == w[0]["request_steps"]["large"] + w[2]["request_steps"]["large"]
    n = {k: w[0]["overhead_ms"][k]["steps"] + w[2]["overhead_ms"][k]["steps"] for k in ("small", "large")}
    assert both["overhead_ms"]["small"]["steps"] == n["small"]
    assert both["overhead_ms"]["small"]["loop"] == pytest.approx(
        (w[0]["overhead_ms"]["small"]["loop"] * w[0]["overhead_ms"]["small"]["steps"]
         + w[2]["overhead_ms"]["small"]["loop"] * w[2]["overhead_ms"]["small"]["steps"]) / n["small"])
    assert len(both["spans"]["large"]) == len(w[0]["spans"]["large"]) + len(w[2]["spans"]["large"])


async def test_a_window_never_goes_on_without_a_client_that_died():
    def prompt_at(i):
        if i >= 4:
            raise ValueError(f"no prompt {i}")
        return [1, 2, 3]

    async with Router(SIM, RouterConfig(**ARGS, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=4)) as r:
        async with SteadyLoop(r, 2, prompt_at, 6) as loop:
            with pytest.raises(RuntimeError, match="client died: ValueError\\('no prompt 4'\\)"):
                for _ in range(20):
                    await loop.measure("eager", {"small": 1}, 0.01, 0.05)
        assert len((await r.generate([5, 6], max_tokens=3, ignore_eos=True)).token_ids) == 3  # the router serves on


async def test_windows_given_one_prompt_list_serve_the_same_requests():
    """At N = 1 a window opens on the answer before prompts(0) is sent, so two windows given one
    list hold the same requests; with the random policy keyed on the prompt they route alike."""
    asked: dict[str, list[int]] = {"sync": [], "eager": [], "loop": []}

    def prompts_for(key):
        def at(i):
            asked[key].append(i)
            return [10 + i, 2, 3, 4]
        return at

    args = dict(policy="random", policy_args={"p": 0.35, "seed": 1, "key": "prompt"})
    async with Router(SIM, RouterConfig(**args, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=2)) as r:
        async with SteadyLoop(r, 1, prompts_for("loop"), 8) as loop:
            await loop.ramped.wait()
            w = {m: await loop.measure(m, {"small": 1}, 0.02, 0.001, window_requests=5, prompts=prompts_for(m))
                 for m in ("sync", "eager")}
    for m, x in w.items():
        assert x["requests"] == 5 and x["tokens"] == 5 * 8  # requests prompts(0..4), whole
        assert asked[m] == list(range(len(asked[m]))) and len(asked[m]) >= 5  # from 0, in order, once each
    assert w["sync"]["handoffs"] == w["eager"]["handoffs"] and w["sync"]["handoffs"]["small->large"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "2", "--sweep-rounds", "3"], "--sweep-rounds must be between 1 and --rounds (2), got 3"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--race-modes", "-2"], "--race-modes K must be >= 0, got -2"),
    (["--confirm", "2"], "--confirm K >= 0 needs --sweep"),
    (["--sweep", "--confirm", "1", "--confirm-margin", "1.5"], "--confirm-margin is a share in [0, 1)"),
    (["--race", "4"], "--race K >= 0 needs --sweep"),
    (["--sweep", "--race", "-1"], "--race K >= 0 needs --sweep"),
    (["--window", "0"], "--window must be > 0"),
])
def test_modes_refuses_options_that_do_not_fit_together(argv, message, capsys):
    from bench.modes import main
    with pytest.raises(SystemExit) as e:
        main(argv)  # refused before any model is loaded
    assert e.value.code == 2 and message in capsys.readouterr().err


def _window(tok_s: float, seconds: float = 1.0) -> dict:
    """A window record as pooled() reads it: one model, tok_s over `seconds`."""
    m = {"small": 0}
    return {"tokens": tok_s * seconds, "seconds": seconds, "steps": {"small": 1}, "requests": 1, "tok_s": tok_s,
            "mean_in_flight": 1.0, "tokens_computed": m, "request_steps": m, "step_time_sum": {"small": 0.0},
            "overhead_ms": {"small": {"loop": 0.0, "hop": 0.0, "steps": 0}}, "window_steps": {"small": None},
            "handoffs": {}, "spans": {"small": []}, "schedule": "delayed", "thresholds": None}


def test_a_sweep_point_pools_the_delayed_windows_that_ran_its_schedule():
    from bench.modes.cycles import point_windows
    names = ["small", "large"]
    points = [("1,1", "delayed", {}), ("1,2", "delayed", {})]
    w = {"1,1": [_window(10)], "1,2": [_window(20)], "delayed": [_window(30), _window(40)]}
    got = point_windows(w, points, "delayed", {"small": 1, "large": 2}, names)
    assert [x["tok_s"] for x in got["1,2"]] == [20, 30, 40] and [x["tok_s"] for x in got["1,1"]] == [10]
    # delayed that ran eager's schedule is not the sweep's (1, 1): its windows stay its own
    got = point_windows(w, points, "eager", {"small": 1, "large": 1}, names)
    assert [x["tok_s"] for x in got["1,1"]] == [10] and [x["tok_s"] for x in got["1,2"]] == [20]


def test_contenders_are_the_points_near_the_measured_top_and_the_predicted_best():
    from bench.modes.cycles import contenders
    by_point = {"1,1": [_window(100)], "1,2": [_window(95), _window(93)], "1,3": [_window(90)], "1,4": [_window(80)]}
    # the chain's best among the points swept (its overall best, (2, 3) here, was not swept)
    pred = {"best_thresholds": [2, 3], "by_thresholds": {"1,1": 1.0, "1,2": 1.1, "1,3": 1.2, "1,4": 1.3, "2,3": 2.0}}
    assert contenders(by_point, pred, 0.06) == ["1,1", "1,2", "1,4"]  # 94 within 6 % of 100, 90 not
    pred["by_thresholds"]["1,2"] = 5.0
    assert contenders(by_point, pred, 0.11) == ["1,1", "1,2", "1,3"]


def test_contenders_can_rank_the_points_by_another_rate():
    from bench.modes.cycles import contenders
    by_point = {"1,1": [_window(100)], "1,2": [_window(80)], "1,3": [_window(60)]}
    pred = {"by_thresholds": {"1,1": 1.0, "1,2": 1.0, "1,3": 2.0}}
    slowest_first = lambda w: 1000.0 / w[0]["tok_s"]  # noqa: E731
    assert contenders(by_point, pred, 0.1, slowest_first) == ["1,3"]  # its own top, and the chain's best


def _in_cycle(tok_s: float, cycle: int) -> dict:
    return {**_window(tok_s), "cycle": cycle}


def test_a_blocked_rate_reads_each_window_against_its_cycle():
    from bench.modes.interleaved import blocked, cycle_reference
    # cycle 2 ran at half speed: sync and eager read 50 and 200 there (geometric mean 100) against
    # 100 and 400 (200) in cycles 0 and 1
    w = {"sync": [_in_cycle(100, 0), _in_cycle(100, 1), _in_cycle(50, 2)],
         "eager": [_in_cycle(400, 0), _in_cycle(400, 1), _in_cycle(200, 2), _in_cycle(400, 3)]}
    ref = cycle_reference(w)
    assert ref == pytest.approx({0: 200.0, 1: 200.0, 2: 100.0})  # cycle 3 lacks sync: no reference
    level = 500 / 3
    # a point measured in the slow cycle at half its fast-cycle rate is as fast as one measured at
    # that rate in a fast cycle; pooled, it would read 3/4 of it
    fast, slow_too = [_in_cycle(220, 0), _in_cycle(220, 1)], [_in_cycle(220, 0), _in_cycle(110, 2)]
    assert blocked(fast, ref) == pytest.approx(level * 1.1) and blocked(slow_too, ref) == pytest.approx(level * 1.1)
    assert pooled(slow_too)["tok_s"] == pytest.approx(165.0)
    assert blocked([_in_cycle(220, 0), _in_cycle(999, 3)], ref) == pytest.approx(level * 1.1)  # cycle 3 left out
    assert blocked([_in_cycle(220, 3)], ref) != blocked([_in_cycle(220, 3)], ref)  # nothing to read: NaN


def test_the_sweep_cycles_are_spread_over_the_run():
    from bench.modes.cycles import spread
    assert spread(3, 6) == {0, 2, 4} and spread(3, 8) == {0, 2, 5} and spread(6, 6) == set(range(6))
    assert spread(1, 6) == {0}


def test_a_race_takes_turns_in_pairs_and_reads_the_geometric_mean_ratio():
    from bench.modes.interleaved import race_order, race_read
    assert race_order("1,2", "1,3", 3) == ["1,2", "1,3", "1,3", "1,2", "1,2", "1,3"]
    r = race_read([100.0, 90.0, 120.0], [100.0, 100.0, 100.0])
    assert r["ratio"] == pytest.approx((0.9 * 1.2) ** (1 / 3)) and r["pairs"] == 3
    logs = np.log([1.0, 0.9, 1.2])
    assert r["log_se"] == pytest.approx(logs.std(ddof=1) / np.sqrt(3))
    # a schedule twice as fast in a window the machine ran at half speed still reads twice as fast
    assert race_read([200.0, 100.0], [100.0, 50.0]) == {"ratio": pytest.approx(2.0), "log_se": 0.0, "pairs": 2}
    with pytest.raises(ValueError, match="pairs of windows, got 2 and 1"):
        race_read([1.0, 2.0], [1.0])


def test_the_summary_reads_the_race_for_the_predicted_best():
    from bench.modes import sweep_read
    by = {"1,1": 100.0, "1,2": 90.0, "1,3": 80.0}
    sweep = {"1,1": {"steady_tok_s": 90.0, "race_tok_s": [90.0, 100.0]},
             "1,2": {"steady_tok_s": 99.0}, "1,3": {"steady_tok_s": 95.0, "race_tok_s": [100.0, 100.0]}}
    s = sweep_read(by, sweep)
    # the sweep's windows put (1, 2) 10 % over the chain's (1, 1); the race, (1, 3) 5.1 % over it
    assert s["best_B_measured"] == "1,2" and s["measured_loss_at_predicted_best"] == pytest.approx(1 - 90 / 99)
    assert s["race_best_B_measured"] == "1,3" and s["race"]["against"] == "1,3"
    assert s["race_measured_loss_at_predicted_best"] == pytest.approx(1 - 0.9 ** 0.5)
    sweep["1,1"]["race_tok_s"] = [110.0, 100.0]
    s = sweep_read(by, sweep)
    assert s["race_best_B_measured"] == "1,1" and s["race_measured_loss_at_predicted_best"] == 0.0
    by["1,2"] = 200.0  # a prediction whose best was not raced has no race reading
    assert "race" not in sweep_read(by, sweep)


async def test_a_race_measures_the_predicted_best_against_the_best_other_point_on_fresh_prompts():
    from types import SimpleNamespace
    from bench.modes.cycles import race
    names = ["small", "large"]
    points = [(f"1,{b}", "delayed", {"small": 1, "large": b}) for b in (1, 2, 3)]
    # (1, 3) measured best so far, (1, 2) predicted best: those two race, (1, 1) does not
    windows = {"sync": [_in_cycle(100, 0)], "eager": [_in_cycle(100, 0)], "delayed": [],
               "1,1": [_in_cycle(90, 0)], "1,2": [_in_cycle(95, 0)], "1,3": [_in_cycle(99, 0)]}
    pred = {"by_thresholds": {"1,1": 1.0, "1,2": 3.0, "1,3": 2.0}}
    asked = []
    in_cycle = lambda c: (lambda i: asked.append((c, i)) or [10 + c, 11 + i, 3])  # noqa: E731
    args = SimpleNamespace(race=2, rounds=3, confirm=1)
    async with Router(SIM, RouterConfig(**ARGS, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=4)) as r:
        async with SteadyLoop(r, 2, lambda i: [1, 2, i % 50], 6) as loop:
            await loop.ramped.wait()
            got = await race(loop, 2, args, windows, points, pred, ("eager", dict.fromkeys(names, 1), names),
                             (0.02, 0.1, 0.0, 0.0, 2), in_cycle)
            no_race = await race(loop, 2, SimpleNamespace(race=0, rounds=3, confirm=1), windows, points, pred,
                                 ("eager", dict.fromkeys(names, 1), names), (0.02, 0.1, 0.0, 0.0, 2), in_cycle)
    assert set(got) == {"1,2", "1,3"} and len(got["1,2"]) == len(got["1,3"]) == 2 and no_race == {}
    assert all(x > 0 for v in got.values() for x in v)
    # four windows, two a pair: pair k serves cycle 4 + k's prompts (after 3 cycles and 1 confirm cycle)
    assert sorted({c for c, _ in asked}) == [4, 5]


async def test_the_modes_race_puts_delayed_against_the_better_of_sync_and_eager_on_fresh_prompts():
    from types import SimpleNamespace
    from bench.modes.cycles import race_modes
    names = ["small", "large"]
    # sync pooled higher than eager so far: delayed races sync
    windows = {"sync": [_in_cycle(110, 0)], "eager": [_in_cycle(100, 0)], "delayed": [_in_cycle(120, 0)]}
    asked = []
    in_cycle = lambda c: (lambda i: asked.append((c, i)) or [10 + c, 11 + i, 3])  # noqa: E731
    ran = ("delayed", {"small": 1, "large": 2}, names)
    periods = (0.02, 0.1, 0.0, 0.0, 2)
    async with Router(SIM, RouterConfig(**ARGS, mode="delayed", thresholds={"small": 1, "large": 1},
                                        max_concurrency=4)) as r:
        async with SteadyLoop(r, 2, lambda i: [1, 2, i % 50], 6) as loop:
            await loop.ramped.wait()
            got = await race_modes(loop, 2, SimpleNamespace(race_modes=3), windows, ran, periods, in_cycle, first=7)
            none = await race_modes(loop, 2, SimpleNamespace(race_modes=0), windows, ran, periods, in_cycle, first=7)
            last = r.schedule(2)  # pairs in turn delayed, sync / sync, delayed / delayed, sync
    assert got["against"] == "sync" and len(got["tok_s"]) == len(got["against_tok_s"]) == 3 and none == {}
    assert last == "sync"
    assert all(x > 0 for x in got["tok_s"] + got["against_tok_s"])
    # six windows, two a pair: pair k serves cycle 7 + k's prompts
    assert sorted({c for c, _ in asked}) == [7, 8, 9]
