"""squash beyond the contract (tests/test_op_contract.py): the dim argument and the zero vector."""

import torch

import capsroute
from capsroute import reference
from helpers import assert_rel_close, randn


def test_dim_argument(device):
    s = randn(4, 6, 5, device=device)
    assert_rel_close(capsroute.squash(s, dim=1), reference.squash(s, dim=1), 1e-12)


def test_zero_gives_zero_and_finite_gradient(device):
    for eps in (1e-8, 0.0):
        s = torch.zeros(3, 8, dtype=torch.float64, device=device, requires_grad=True)
        v = capsroute.squash(s, eps=eps)
        (g,) = torch.autograd.grad(v.sum(), s)
        assert torch.equal(v, torch.zeros_like(v))
        assert torch.isfinite(g).all()
