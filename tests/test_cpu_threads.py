"""The CPU thread plan: the heaviest model gets every core, the others share; bad specs are refused."""
import pytest

from aiorouter.cpu_threads import plan_threads, resolve_threads


def test_heaviest_model_gets_every_core():
    assert plan_threads([10, 1000], cores=2) == [1, 2]
    assert plan_threads([1000, 10, 50], cores=4) == [4, 1, 1]
    assert plan_threads([5, 5], cores=8) == [8, 4]  # a tie goes to the first model
    assert plan_threads([0], cores=3) == [3]


def test_explicit_threads_override_the_plan():
    names = ["small", "large"]
    assert resolve_threads(3, names, [1, 2]) == [3, 3]
    assert resolve_threads({"small": 2}, names, [1, 2]) == [2, plan_threads([1, 2])[1]]


@pytest.mark.parametrize("spec, msg", [({"huge": 1}, "unknown model 'huge'"), ({"small": 0}, ">= 1"),
                                       ("two", "must be an int"), (True, "must be an int")])
def test_bad_thread_specs_name_the_problem(spec, msg):
    with pytest.raises(ValueError, match=msg):
        resolve_threads(spec, ["small", "large"], [1, 2])


def test_router_refuses_bad_threads_at_construction():
    from aiorouter import Router
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        Router({"a": {"engine": "sim", "latency_ms": 1.0}}, threads={"nope": 2})
