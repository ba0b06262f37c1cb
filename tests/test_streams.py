"""Stream ownership: every model's runner and graph set hold a stream of their own.

On CPU the factory's stream creator is replaced by one that makes stand-in streams (the only
mock here: the engines, runners and graph sets are the real ones); a creator that recycles
handles, as torch's 32-stream pool does, is refused. On CUDA: real streams, past the pool size."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

from engines import Engine, EngineConfig
from engines.streams import StreamFactory, new_cuda_stream


@dataclass(frozen=True, eq=False)  # identity, not value: two stand-ins are two streams
class FakeStream:
    device: torch.device
    cuda_stream: int


def fresh_creator():
    """A new handle per call: what cudaStreamCreate does."""
    handles = itertools.count(0x1000, 0x10)
    return lambda device: (FakeStream(device, next(handles)), "fake: new")


def pool_creator(size: int):
    """Handles recycled round-robin from `size`: what torch.cuda.Stream() does (size 32)."""
    handles = itertools.cycle(range(0x1000, 0x1000 + 0x10 * size, 0x10))
    return lambda device: (FakeStream(device, next(handles)), "fake: pooled")


@pytest.mark.triton_interp
def test_two_models_runners_and_graph_sets_never_share_a_stream(tiny_qwen3):
    from engines.attention.triton_backend import TritonBackend
    factory = StreamFactory(fresh_creator())
    cfg = EngineConfig(num_kv_tokens=512)
    engines = [Engine(tiny_qwen3, config=cfg, load_tokenizer=False, streams=factory) for _ in range(2)]
    runners = [e.runner for e in engines]
    for r in runners:  # the CPU stand-in of a capture (graph sets are made the same way on CUDA)
        r.capture_graphs(TritonBackend(block_m=16, block_n=16), decode_buckets=(1, 2), seq_buckets=(1,),
                         token_buckets=(8,))
    a, b = runners
    assert a.streams[0] is not b.streams[0] and a.streams[0].cuda_stream != b.streams[0].cuda_stream
    for r in runners:
        assert r.graphs.stream is r.streams[0]  # captured on the runner's own stream, not a pooled one
        assert factory.owner_of(r.streams[0]) == f"model runner {id(r):#x} (stage 0)"
    assert a.graphs is not b.graphs
    records = factory.records()
    assert len(records) == 2 and len({rec.handle for rec in records}) == 2


def test_factory_refuses_a_recycled_stream():
    factory = StreamFactory(pool_creator(2))
    cpu = torch.device("cpu")
    first, second = factory.stream(cpu, "model a"), factory.stream(cpu, "model b")
    assert first.cuda_stream != second.cuda_stream
    with pytest.raises(RuntimeError, match="model a's already; model c would share it"):
        factory.stream(cpu, "model c")  # the pool wrapped around to model a's stream
    assert [r.owner for r in factory.records()] == ["model a", "model b"]


def test_engine_building_fails_rather_than_sharing(tiny_qwen3):
    """A second model whose runner would get the first one's stream is not built."""
    factory = StreamFactory(pool_creator(1))
    Engine(tiny_qwen3, config=EngineConfig(num_kv_tokens=512), load_tokenizer=False, streams=factory)
    with pytest.raises(RuntimeError, match="would share it"):
        Engine(tiny_qwen3, config=EngineConfig(num_kv_tokens=512), load_tokenizer=False, streams=factory)


def test_default_creator_makes_no_stream_on_cpu():
    stream, how = new_cuda_stream(torch.device("cpu"))
    assert stream is None and how.startswith("cpu")
    assert StreamFactory().stream(torch.device("cpu"), "x") is None and StreamFactory().records() == []


@pytest.mark.gpu
def test_cuda_streams_are_new_past_the_pool_size():
    factory = StreamFactory()
    dev = torch.device("cuda:0")
    streams = [factory.stream(dev, f"owner {i}") for i in range(40)]  # torch's pool repeats after 32
    assert len({s.cuda_stream for s in streams}) == 40
    pooled = {torch.cuda.Stream(dev).cuda_stream for _ in range(64)}
    assert not pooled & {s.cuda_stream for s in streams}
    x = torch.ones(1024, device=dev)
    with torch.cuda.stream(streams[0]):
        y = x * 2
    streams[0].synchronize()
    assert y.sum().item() == 2048
