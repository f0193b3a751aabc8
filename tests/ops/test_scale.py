"""Shapes far past MNIST (I = 16384 inputs, J = 100 and 1000 outputs, D = 32): the ops still
match the reference. The reference's autograd needs several votes-sized tensors, so these run on
a GPU; the CPU runs only dynamic_routing at J = 100, B = 1, against a float32 reference (a votes
tensor of 210 MB, about 2 GB in all). At J = 1000 the reference is float32 too (float64 copies of
the 2 GB votes would not fit next to autograd's), and dense_capsules uses I = 4096: its weight at
I = 16384 would be 16.8 GB on its own, before gradients and the reference's copies.

At B = 1 or 2 the CUDA routing kernels split each element's rows over many blocks (the row-range
path, see routing_splits in csrc/cuda/agreement_launch.cuh): their gigabytes of votes and float64
references take a while."""

import pytest
import torch

import capsroute
from capsroute import reference
from helpers import HAS_CUDA, assert_rel_close

pytestmark = pytest.mark.slow  # gigabytes of votes per test

I, D, DIN = 16384, 32, 8
GPU_CASES = [
    pytest.param(
        "cuda",
        100,
        id="cuda-J100",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")],
    ),
    pytest.param(
        "cuda",
        1000,
        id="cuda-J1000",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")],
    ),
]


def grads_of(fn, inputs, grad):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    v = fn(*leaves)
    return [v.detach()] + list(torch.autograd.grad(v, leaves, grad))


@pytest.mark.parametrize("device,J", [pytest.param("cpu", 100, id="cpu-J100"), *GPU_CASES])
def test_dynamic_routing_at_scale(device, J):
    B, ref_dtype = (2, torch.float64) if device == "cuda" and J == 100 else (1, torch.float32)
    votes = 0.02 * torch.randn(B, I, J, D, device=device)  # |s| ~ 1 summed over 16384 inputs
    grad = torch.randn(B, J, D, device=device)
    ours = grads_of(lambda x: capsroute.dynamic_routing(x, 3), [votes], grad)
    ref = grads_of(
        lambda x: reference.dynamic_routing(x, 3), [votes.to(ref_dtype)], grad.to(ref_dtype)
    )
    for name, a, e in zip(["v", "grad_votes"], ours, ref):
        assert_rel_close(a, e, 1e-4, name)


@pytest.mark.parametrize("device,J", GPU_CASES)
def test_dense_capsules_at_scale(device, J):
    B, inputs, ref_dtype = (2, I, torch.float64) if J == 100 else (1, 4096, torch.float32)
    u = capsroute.squash(torch.randn(B, inputs, DIN, device=device))
    weight = 0.01 * torch.randn(inputs, J, D, DIN, device=device)
    grad = torch.randn(B, J, D, device=device)
    ours = grads_of(lambda x, w: capsroute.dense_capsules(x, w, 3), [u, weight], grad)
    ref = grads_of(
        lambda x, w: reference.dense_capsules(x, w, 3),
        [u.to(ref_dtype), weight.to(ref_dtype)],
        grad.to(ref_dtype),
    )
    for name, a, e in zip(["v", "grad_u", "grad_weight"], ours, ref):
        assert_rel_close(a, e, 1e-4, name)
