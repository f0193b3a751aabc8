"""squash beyond the contract (tests/ops/test_op_contract.py): the dim argument and the zero vector,
also through the reference (forward mode, double backward)."""

import math

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


def test_zero_through_the_reference():
    """At s = 0 the reference, which forward mode and create_graph run, gives the fused op's 0 and
    zero gradient, also for eps = 0 where its formula reads 0/0; so does Efficient-CapsNet's squash,
    whose Jacobian there is its scale times the identity."""
    s = torch.zeros(3, 8, dtype=torch.float64, requires_grad=True)
    for eps in (1e-8, 0.0):
        v, jvp = torch.func.jvp(lambda x: capsroute.squash(x, eps=eps), (s,), (torch.ones_like(s),))
        assert torch.equal(v, torch.zeros_like(v)) and torch.equal(jvp, torch.zeros_like(jvp))
        (g,) = torch.autograd.grad(capsroute.squash(s, eps=eps).sum(), s, create_graph=True)
        assert torch.equal(g, torch.zeros_like(g))
        n = math.sqrt(eps)
        scale = -math.expm1(-n) / n if n > 0 else 1.0
        (g,) = torch.autograd.grad(reference.squash_exp(s, eps=eps).sum(), s, create_graph=True)
        assert_rel_close(g, torch.full_like(g, scale), 1e-15)
