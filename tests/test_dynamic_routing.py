import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capsroute
from capsroute import reference
from conftest import CUDA, HAS_CUDA, TOLERANCE, assert_rel_close, randn

# Odd sizes: I and J not multiples of 32, D in {4, 8, 16, 32}.
SHAPES = [(3, 37, 7, 16), (2, 65, 33, 4), (1, 5, 1, 8), (4, 19, 10, 32), (2, 1, 3, 8)]
OPTIONS = list(itertools.product([1, 2, 3], [False, True], [False, True], [False, True]))  # iters, leaky, detach, bias


def run_both(votes, bias, iters, leaky, detach, grad):
    """(v, c, grad_votes, grad_bias) from capsroute and from the float64 reference on the same values."""
    out = []
    for impl, cast in ((capsroute, lambda t: t), (reference, lambda t: t.detach().double().requires_grad_())):
        x = cast(votes)
        b = cast(bias) if bias is not None else None
        v, c = impl.dynamic_routing_coupling(x, iters, bias=b, leaky=leaky, detach=detach)
        inputs = (x,) if b is None else (x, b)
        grads = torch.autograd.grad(v, inputs, grad.to(v.dtype))
        out.append((v, c) + grads)
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_on_odd_shapes(device, dtype, shape):
    B, I, J, D = shape
    votes = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    bias = randn(J, D, dtype=dtype, device=device, scale=0.1, requires_grad=True)
    grad = randn(B, J, D, device=device)
    ours, ref = run_both(votes, bias, 3, False, False, grad)
    for name, a, e in zip(["v", "c", "grad_votes", "grad_bias"], ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype], name)


@pytest.mark.parametrize("iters,leaky,detach,with_bias", OPTIONS)
def test_every_option_combination(device, iters, leaky, detach, with_bias):
    B, I, J, D = 3, 13, 6, 8
    votes = randn(B, I, J, D, device=device, requires_grad=True)
    bias = randn(J, D, device=device, scale=0.3, requires_grad=True) if with_bias else None
    ours, ref = run_both(votes, bias, iters, leaky, detach, randn(B, J, D, device=device))
    for name, a, e in zip(["v", "c", "grad_votes", "grad_bias"], ours, ref):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage(device, dtype):
    B, I, J, D = 4, 37, 10, 16
    votes = randn(B, I, J, D, dtype=dtype, device=device, requires_grad=True)
    bias = randn(J, D, dtype=dtype, device=device, scale=0.1, requires_grad=True)
    ours, ref = run_both(votes, bias, 3, False, False, randn(B, J, D, device=device))
    for name, a, e in zip(["v", "c", "grad_votes", "grad_bias"], ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype], name)


@pytest.mark.parametrize("leaky,detach", [(False, False), (True, False), (False, True)])
def test_gradcheck(device, leaky, detach):
    votes = randn(2, 5, 3, 4, device=device, requires_grad=True)
    bias = randn(3, 4, device=device, scale=0.3, requires_grad=True)

    def fn(x, b):
        return capsroute.dynamic_routing(x, 3, bias=b, leaky=leaky, detach=detach)

    if detach:  # the coupling is a constant: check against the reference's gradient instead of finite differences
        ours, ref = run_both(votes, bias, 3, leaky, True, randn(2, 3, 4, device=device))
        for a, e in zip(ours[2:], ref[2:]):
            assert_rel_close(a, e, 1e-10)
    else:
        assert torch.autograd.gradcheck(fn, (votes, bias), fast_mode=False)


def test_opcheck(device):
    votes = randn(2, 7, 3, 4, device=device, requires_grad=True)
    bias = randn(3, 4, device=device, requires_grad=True)
    for args in [(votes, bias, 3, False, False, 1e-8), (votes, None, 2, True, True, 1e-8)]:
        torch.library.opcheck(torch.ops.capsroute.dynamic_routing.default, args)


def test_torch_compile_fullgraph(device):
    votes = randn(2, 9, 3, 4, dtype=torch.float32, device=device, requires_grad=True)

    @torch.compile(fullgraph=True)
    def step(x):
        return capsroute.dynamic_routing(x, 3).square().sum()

    loss = step(votes)
    (g,) = torch.autograd.grad(loss, votes)
    x = votes.detach().requires_grad_()
    loss_ref = capsroute.dynamic_routing(x, 3).square().sum()
    (g_ref,) = torch.autograd.grad(loss_ref, x)
    assert_rel_close(loss.detach(), loss_ref.detach(), 1e-6)
    assert_rel_close(g, g_ref, 1e-6)


def test_non_contiguous(device):
    base = randn(5, 3, 11, 8, device=device)  # (J, B, I, D) storage
    votes = base.permute(1, 2, 0, 3).requires_grad_()
    bias = randn(8, 5, device=device).t().requires_grad_()
    assert not votes.is_contiguous() and not bias.is_contiguous()
    ours, ref = run_both(votes, bias, 3, True, False, randn(3, 5, 8, device=device))
    for a, e in zip(ours, ref):
        assert_rel_close(a, e, 1e-10)


def test_empty_batch(device):
    votes = randn(0, 7, 3, 4, device=device, requires_grad=True)
    bias = randn(3, 4, device=device, requires_grad=True)
    v, c = capsroute.dynamic_routing_coupling(votes, bias=bias)
    assert v.shape == (0, 3, 4) and c.shape == (0, 7, 3)
    gv, gb = torch.autograd.grad(v.sum(), (votes, bias))
    assert gv.shape == votes.shape and torch.equal(gb, torch.zeros_like(bias))


def test_nan_stays_in_its_batch_element(device):
    votes = randn(3, 6, 4, 8, device=device, requires_grad=True)
    with torch.no_grad():
        votes[1, 2, 0, 3] = float("nan")
    v = capsroute.dynamic_routing(votes)
    assert torch.isnan(v[1]).all()
    assert torch.isfinite(v[[0, 2]]).all()
    (g,) = torch.autograd.grad(v[[0, 2]].sum(), votes)
    assert torch.isfinite(g[[0, 2]]).all()


def test_coupling_is_not_differentiable(device):
    votes = randn(2, 5, 3, 4, device=device, requires_grad=True)
    v, c = capsroute.dynamic_routing_coupling(votes)
    assert v.requires_grad and not c.requires_grad
    assert torch.allclose(c.sum(-1), torch.ones(2, 5, dtype=c.dtype, device=device))


def test_deterministic(device):
    votes = randn(4, 33, 10, 16, dtype=torch.float32, device=device, requires_grad=True)
    bias = randn(10, 16, dtype=torch.float32, device=device, requires_grad=True)
    grad = randn(4, 10, 16, dtype=torch.float32, device=device)
    runs = []
    for _ in range(2):
        v = capsroute.dynamic_routing(votes, bias=bias)
        runs.append((v,) + torch.autograd.grad(v, (votes, bias), grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# Options for the row-range tests: (iters, leaky, detach, bias).
SPLIT_OPTIONS = [(3, False, False, True), (3, True, True, False), (1, False, False, True), (2, True, False, True)]


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", ["2", "5", "300"])
@pytest.mark.parametrize("iters,leaky,detach,with_bias", SPLIT_OPTIONS)
def test_row_ranges_match_reference(device, monkeypatch, splits, iters, leaky, detach, with_bias):
    """When the batch is too small to fill the GPU, each element's rows are routed in ranges, one
    block each, whose partial sums are added in order (CAPSROUTE_ROUTING_SPLITS forces how many):
    the results are the reference's for any number of ranges, more ranges than rows included."""
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", splits)
    B, I, J, D = 3, 133, 10, 16
    votes = randn(B, I, J, D, device=device, scale=0.3, requires_grad=True)
    bias = randn(J, D, device=device, scale=0.3, requires_grad=True) if with_bias else None
    ours, ref = run_both(votes, bias, iters, leaky, detach, randn(B, J, D, device=device))
    for name, a, e in zip(["v", "c", "grad_votes", "grad_bias"], ours, ref):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
def test_row_ranges_deterministic_and_checked(device, monkeypatch):
    votes = randn(2, 300, 10, 16, dtype=torch.float32, device=device, requires_grad=True)
    grad = randn(2, 10, 16, dtype=torch.float32, device=device)
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", "4")
    runs = []
    for _ in range(2):
        v = capsroute.dynamic_routing(votes)
        runs.append((v,) + torch.autograd.grad(v, votes, grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", "0")
    with pytest.raises(RuntimeError, match="CAPSROUTE_ROUTING_SPLITS must be an integer >= 1"):
        capsroute.dynamic_routing(votes)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), I=st.integers(1, 40), J=st.integers(1, 12), D=st.sampled_from([1, 3, 4, 8, 16]),
       iters=st.integers(1, 4), leaky=st.booleans(), scale=st.sampled_from([1e-3, 1.0, 10.0]), seed=st.integers(0, 2**31))
def test_property_matches_reference(B, I, J, D, iters, leaky, scale, seed):
    g = torch.Generator().manual_seed(seed)
    votes = randn(B, I, J, D, scale=scale, requires_grad=True, generator=g)
    ours, ref = run_both(votes, None, iters, leaky, False, randn(B, J, D, generator=g))
    for name, a, e in zip(["v", "c", "grad_votes"], ours, ref):
        assert_rel_close(a, e, 1e-9, name)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_float16_backward_keeps_a_gradient_above_float16_range():
    """The backward takes the incoming gradient in the accumulation dtype: a float32 gradient of
    1e5 (float16 tops out at 65504) for float16 votes gives the float32 result, not inf. One
    iteration keeps every vote gradient c_ij gs_j (c = 1/J) well inside the float16 range."""
    B, I, J, D = 2, 6, 16, 8
    gen = torch.Generator().manual_seed(0)
    votes = torch.randn(B, I, J, D, generator=gen).to("cuda", torch.float16)
    grad_v = torch.randn(B, J, D, generator=gen).cuda()
    grad_v[0, 3, 2] = 1e5
    options = (False, False, 1e-8)  # leaky, detach, eps
    results = []
    for x in (votes, votes.float()):
        _, _, s_hist = torch.ops.capsroute.dynamic_routing(x, None, 1, *options)
        results.append(torch.ops.capsroute._dynamic_routing_backward(grad_v, x, s_hist, *options)[0])
    grad_half, grad_float = results
    assert grad_float.abs().max() < 65504 and torch.isfinite(grad_half).all()
    assert_rel_close(grad_half.float(), grad_float, 1e-2, "grad_votes")
