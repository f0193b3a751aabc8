import pytest
import torch

import capsroute
from capsroute import reference
from conftest import TOLERANCE, assert_rel_close, randn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 16), (3, 5, 8), (33,), (2, 0, 4)])
def test_matches_reference(device, dtype, shape):
    s = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    s_ref = s.detach().double().requires_grad_()
    v, v_ref = capsroute.squash(s), reference.squash(s_ref)
    grad = randn(*shape, device=device)
    (g,) = torch.autograd.grad(v, s, grad.to(dtype))
    (g_ref,) = torch.autograd.grad(v_ref, s_ref, grad)
    assert v.dtype == dtype and g.dtype == dtype
    assert_rel_close(v, v_ref, TOLERANCE[dtype], "v")
    assert_rel_close(g, g_ref, TOLERANCE[dtype], "grad")


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


def test_gradcheck(device):
    s = randn(5, 7, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(capsroute.squash, (s,), fast_mode=False)


def test_opcheck(device):
    s = randn(5, 7, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.capsroute.squash.default, (s, 1e-8))


def test_torch_compile_fullgraph(device):
    s = randn(4, 8, dtype=torch.float32, device=device, requires_grad=True)
    fn = torch.compile(lambda x: capsroute.squash(x).sum(), fullgraph=True)
    (g,) = torch.autograd.grad(fn(s), s)
    (g_ref,) = torch.autograd.grad(reference.squash(s).sum(), s)
    assert_rel_close(g, g_ref, 1e-5)
