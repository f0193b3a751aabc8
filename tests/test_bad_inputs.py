"""docs/ops.md, "Bad input": bad input raises an error that says what is wrong (wrong dtypes: test_op_contract)."""
import pytest
import torch

import capsroute
from helpers import HAS_CUDA, randn


def votes(*shape, **kw):
    return randn(*(shape or (2, 5, 3, 4)), **kw)


@pytest.mark.parametrize("call,message", [
    (lambda d: capsroute.dynamic_routing(votes(2, 5, 3, device=d)), r"votes must have shape \(B, I, J, D\)"),
    (lambda d: capsroute.dynamic_routing(votes(device=d), bias=randn(4, 3, device=d)), r"bias must have shape \(J, D\) = \(3, 4\)"),
    (lambda d: capsroute.dynamic_routing(votes(device=d), iters=0), "iters must be >= 1, got 0"),
    (lambda d: capsroute.dynamic_routing(votes(device=d), eps=float("nan")), "eps must be finite"),
    (lambda d: capsroute.dynamic_routing(votes(device=d), eps=float("inf")), "eps must be finite"),
    (lambda d: capsroute.dynamic_routing(votes(device=d), eps=-1.0), "eps must be finite and >= 0"),
    (lambda d: capsroute.dynamic_routing(votes(2, 5, 0, 4, device=d)), "J >= 1"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, device=d), randn(5, 3, 4, 8, device=d)), r"u must have shape \(B, I, Din\)"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, device=d)), r"weight must have shape \(I, J, D, Din\)"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(6, 3, 4, 8, device=d)), "I = 5 and Din = 8"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, 7, device=d)), "I = 5 and Din = 8"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), iters=-2), "iters must be >= 1"),
    (lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), bias=randn(3, 5, device=d)), r"bias must have shape \(J, D\)"),
    (lambda d: capsroute.squash(randn(3, 4, device=d), eps=float("nan")), "eps must be finite"),
])
def test_bad_input_raises_a_clear_error(device, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(device)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device for a device mismatch")
def test_device_mismatch():
    with pytest.raises(RuntimeError, match="bias is on"):
        capsroute.dynamic_routing(votes(device="cuda"), bias=randn(3, 4))
    with pytest.raises(RuntimeError, match="weight is on"):
        capsroute.dense_capsules(randn(2, 5, 8, device="cuda"), randn(5, 3, 4, 8))
