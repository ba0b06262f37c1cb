"""`sample_batched` (the GPU sampler: batched filters, exponential race, no host sync) against
`sample` (the CPU sampler), run on CPU. Its no-sync property is checked on CUDA only."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from engines.sampling import SamplingParams, _filter, _filter_batched, sample, sample_batched

PARAMS = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), SamplingParams(top_p=0.8),
          SamplingParams(min_p=0.1, temperature=0.7), SamplingParams(top_k=20, top_p=0.9, min_p=0.02),
          SamplingParams(temperature=1.3), SamplingParams(top_k=1, temperature=2.0)]


@pytest.mark.parametrize("params", [PARAMS, [SamplingParams(min_p=0.1), SamplingParams(min_p=0.3, temperature=0.5)],
                                    [SamplingParams(top_k=50, min_p=0.05), SamplingParams(top_p=0.5)]])
def test_batched_filters_equal_per_row_filters(params):
    """Same values, same -inf entries, ties included (a tie at a top-k or top-p boundary keeps or
    drops the same token: both sort stably)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        x = torch.randn(len(params), 300, generator=g) * 3
        x[:, 7], x[:, 100] = x[:, 3], x[:, 50]  # exact ties
        got = _filter_batched(x.clone(), params)
        for r, p in enumerate(params):
            assert torch.equal(got[r], _filter(x[r].clone(), p)), p


def test_greedy_rows_and_one_token_supports_are_exact():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(PARAMS), 300, generator=g)
    a = sample(logits, PARAMS, [None] * len(PARAMS))
    b = sample_batched(logits, PARAMS, [None] * len(PARAMS))
    assert a[0] == b[0] == logits[0].argmax() and b[-1] == logits[-1].argmax()


@pytest.mark.parametrize("p", [SamplingParams(top_p=5e-324), SamplingParams(top_p=1e-45, temperature=0.3),
                               SamplingParams(temperature=5e-324), SamplingParams(temperature=1e-7, top_p=0.5)])
def test_extreme_but_valid_parameters_draw_the_most_probable_token(p):
    """What a fuzzer sent the server (tests/test_fuzz.py): a top_p or temperature that float32
    rounds to 0 once made every probability NaN and failed the step; both ask for the argmax."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2)) * 4
    for fn in (sample, sample_batched):
        assert torch.equal(fn(logits, [p] * 3, [None] * 3), logits.argmax(-1)), fn.__name__


def test_exponential_race_draws_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=0.8, top_k=4)
    want = torch.softmax(_filter(logits[0] / 0.8, p), -1)
    n = 20000
    counts = torch.bincount(sample_batched(logits.expand(n, -1), [p] * n, [None] * n), minlength=6).float() / n
    assert counts[4:].sum() == 0
    assert (counts - want).abs().max() < 0.015


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample_batched(logits[2:3], [p], [torch.Generator().manual_seed(7)])
    ps = [SamplingParams(temperature=1.0)] * 2 + [p, SamplingParams(temperature=0.0)]
    batch = sample_batched(logits, ps, [None, None, torch.Generator().manual_seed(7), None])
    assert batch[2] == alone[0]


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    logits = torch.randn(8, 1000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample_batched(logits, PARAMS + [SamplingParams()], [None] * 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (8,) and out.device.type == "cuda"


@given(rows=st.lists(st.lists(st.sampled_from([0.0, 1.5, -3.0, float("nan"), float("inf"), float("-inf")]),
                              min_size=1, max_size=12), min_size=1, max_size=6).filter(lambda r: len({len(x) for x in r}) == 1),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_nonfinite_rows_by_row_sum_equal_the_elementwise_check(rows, dtype):
    """The row-sum shortcut flags exactly the rows that hold a NaN or an infinity, in its tensor
    form and in its host form."""
    from engines.sampling import nonfinite_host_rows, nonfinite_rows
    x = torch.tensor(rows, dtype=dtype)  # [B, V]
    want = (~torch.isfinite(x).all(dim=-1)).tolist()
    assert nonfinite_rows(x).tolist() == want
    assert nonfinite_host_rows(x) == tuple(i for i, b in enumerate(want) if b)
