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
    from aiorouter import Router, RouterConfig
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        Router({"a": {"engine": "sim", "latency_ms": 1.0}}, RouterConfig(threads={"nope": 2}))


def _tiny_engines(path, n=2):
    from engines import Engine
    return [Engine.from_pretrained(path, num_kv_tokens=256) for _ in range(n)]


def test_core_share_shrinks_the_heavy_team_while_light_steps_run(tiny_qwen3):
    import threading
    import torch
    from aiorouter.cpu_threads import CoreShare
    engines = _tiny_engines(tiny_qwen3)
    share = CoreShare.plan(engines, [1, 2])
    share.cores = 2  # the bench machine's shape, whatever this one has
    assert share.layer_hook(1) == share.heavy_layer and share.layer_hook(0) is None
    seen = []

    def heavy_thread():  # a worker thread of its own, as in the router (thread counts are per thread)
        torch.set_num_threads(2)
        share.heavy_layer()
        seen.append(torch.get_num_threads())
        share.run_light(0, lambda: (share.heavy_layer(), seen.append(torch.get_num_threads())))
        share.heavy_layer()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=heavy_thread)
    t.start()
    t.join()
    assert seen == [2, 1, 2]
    assert share.light_busy == 0


def test_core_share_counts_a_failed_light_step_back(tiny_qwen3):
    from aiorouter.cpu_threads import CoreShare
    share = CoreShare.plan(_tiny_engines(tiny_qwen3), [1, 2])
    with pytest.raises(ZeroDivisionError):
        share.run_light(0, lambda: 1 / 0)
    assert share.light_busy == 0


class _GpuModel:
    """What CoreShare reads of a model on a GPU (no CUDA here to build a real one)."""
    num_params = 10**9
    device = __import__("torch").device("cuda:0")


def test_core_share_only_when_every_model_is_on_this_cpu(tiny_qwen3):
    from aiorouter.cpu_threads import CoreShare
    from engines.sim import SimEngine
    cpu = _tiny_engines(tiny_qwen3, 1)[0]
    assert CoreShare.plan([cpu, _GpuModel()], [1, 2]) is None
    assert CoreShare.plan([cpu, SimEngine()], [1, 2]) is None  # a sim engine sleeps: it takes no core
    assert CoreShare.plan([cpu], [2]) is None
