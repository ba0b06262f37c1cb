"""CUDA graphs of the R2R and CITER router networks: the padding to batch buckets on CPU (where
nothing is captured and the padded static buffers run eagerly), the capture itself on CUDA only."""
from __future__ import annotations

import pytest
import torch

from policies.networks import CITERRouter, GraphedForward, R2RRouter


def test_router_network_graph_padding_keeps_rows():
    """Padded to buckets, R2R and CITER networks in eval mode give the unpadded outputs, inside
    and past the last bucket."""
    torch.manual_seed(0)
    r2r = R2RRouter(torch.randn(50, 16), 16, logits_size=8, hidden_dims=[32, 32]).eval()
    citer = CITERRouter(16).eval()
    with torch.no_grad():  # BatchNorm running stats away from the defaults
        for m in citer.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2)
    for b in (1, 3, 5, 9):
        h, tok, lg = torch.randn(b, 16), torch.randint(0, 50, (b,)), torch.randn(b, 8)
        with torch.inference_mode():
            g = GraphedForward(r2r, [h, tok, lg], buckets=(1, 4, 8))
            torch.testing.assert_close(g(h, tok, lg), r2r(h, tok, lg))
            gc = GraphedForward(citer, [h], buckets=(1, 4, 8))
            torch.testing.assert_close(gc(h), citer(h))


@pytest.mark.gpu
def test_router_network_graphs_on_cuda():
    net = CITERRouter(32).cuda().eval()
    h = torch.randn(5, 32)
    with torch.inference_mode():
        want = torch.sigmoid(net(h.cuda()).squeeze(-1)).cpu()
    got = net.prob(h)
    assert net._graphs is not None
    torch.testing.assert_close(got, want)
