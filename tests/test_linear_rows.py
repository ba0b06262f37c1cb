"""oneDNN linear calls run at bucketed row counts (engines.onednn_rows.bucket_rows): a bounded set of
shapes per weight, so oneDNN's per-shape primitive cache stops growing, with the same outputs."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from engines.model import Linear
from engines.onednn_rows import bucket_rows, onednn_rows


@given(st.integers(1, 8192))
def test_bucket_covers_and_bounds_the_padding(t):
    b = bucket_rows(t)
    assert b >= t
    assert b == t if t <= 32 else 8 * (b - t) < t  # under 12.5% padded rows: prefill pays for each


def test_few_row_counts_for_every_prompt_length():
    # 32 exact counts, then 8 per doubling from 32 to 2048
    assert len({bucket_rows(t) for t in range(1, 2049)}) == 32 + 8 * 6


@pytest.mark.parametrize("t", [1, 7, 33, 100, 257, 700])
def test_rows_run_bucketed_and_come_back_unpadded(t):
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    x = torch.randn(t, 64)  # [T, in]
    seen = []
    got = onednn_rows(x, lambda v: seen.append(v.shape[0]) or F.linear(v, w, b))
    assert seen == [bucket_rows(t)]
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 33, 700])
def test_packed_linear_on_padded_rows_equals_the_dense_one(t):
    torch.manual_seed(0)
    lin = Linear(64, 96)
    x = torch.randn(t, 64)  # [T, in]
    want = lin(x)
    assert lin.pack()  # the CPU torch this project pins has oneDNN
    got = lin(x)
    assert got.shape == (t, 96)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
