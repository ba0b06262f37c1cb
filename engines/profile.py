"""Measure an engine's decode-step latency at a few batch sizes (the throughput model's L_i(b))."""
from __future__ import annotations

import statistics
import time

from engines.engine import Engine
from engines.runner import ScheduledSeq
from engines.sampling import SamplingParams
from engines.sequence import Sequence


def profile_decode_latency(engine: Engine, batch_sizes: list[int], steps: int = 3, prompt_len: int = 32,
                           warmup: int = 1) -> dict[int, float]:
    """Median seconds of one decode step at each batch size, run through the engine's own runner
    on private sequences whose KV is freed afterwards (the engine must be idle)."""
    bm, runner = engine.block_manager, engine.runner
    vocab = engine.model_config.vocab_size
    out: dict[int, float] = {}
    for b in batch_sizes:
        seqs = [Sequence([(7 * i + j) % vocab for j in range(prompt_len)],
                         SamplingParams(max_tokens=steps + warmup + 1, temperature=0.0)) for i in range(b)]
        try:
            for s in seqs:
                if not bm.reserve(s, len(s.token_ids) + steps + warmup + 1):
                    raise ValueError(f"not enough KV to profile batch size {b}")
            runner.run([ScheduledSeq(s, len(s.token_ids)) for s in seqs])  # prefill
            for s in seqs:
                s.num_computed_tokens = len(s.token_ids)
            times = []
            for i in range(steps + warmup):
                for s in seqs:
                    s.token_ids.append(1 + i % (vocab - 1))
                t0 = time.perf_counter()
                runner.run([ScheduledSeq(s, 1) for s in seqs])
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                for s in seqs:
                    s.num_computed_tokens += 1
            out[b] = statistics.median(times)
        finally:
            for s in seqs:
                bm.free(s)
    return out


def runner_info(engine: Engine) -> dict:
    """What an engine runs on, for benchmark records: attention backend, captured graphs (count,
    replays so far, their backend) and its streams (raw handles; none on CPU)."""
    r = engine.runner
    g = r.graphs
    return {"backend": type(r.backend).__name__, "graphs": len(g.graphs) if g else 0,
            "graph_replays": g.num_replays if g else 0, "graph_backend": type(g.backend).__name__ if g else None,
            "streams": [hex(s.cuda_stream) for s in r.streams if s is not None]}
