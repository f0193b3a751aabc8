import itertools

import pytest
import torch

import capsroute
from capsroute import reference
from conftest import CUDA, TOLERANCE, assert_rel_close, randn

SHAPES = [(3, 37, 7, 16, 8), (2, 65, 33, 4, 5), (1, 5, 1, 8, 1), (4, 19, 10, 32, 3)]  # B, I, J, D, Din


def run_both(u, weight, bias, iters, leaky, detach, grad):
    """(v, grad_u, grad_weight[, grad_bias]) from capsroute and from the float64 reference."""
    out = []
    for impl, cast in ((capsroute, lambda t: t), (reference, lambda t: t.detach().double().requires_grad_())):
        x, w = cast(u), cast(weight)
        b = cast(bias) if bias is not None else None
        v = impl.dense_capsules(x, w, iters, bias=b, leaky=leaky, detach=detach)
        inputs = (x, w) if b is None else (x, w, b)
        out.append((v,) + torch.autograd.grad(v, inputs, grad.to(v.dtype)))
    return out


def make_inputs(B, I, J, D, Din, dtype=torch.float64, device="cpu", bias=True):
    u = randn(B, I, Din, dtype=dtype, device=device, requires_grad=True)
    weight = randn(I, J, D, Din, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    b = randn(J, D, dtype=dtype, device=device, scale=0.1, requires_grad=True) if bias else None
    return u, weight, b


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_on_odd_shapes(device, dtype, shape):
    B, I, J, D, Din = shape
    u, weight, bias = make_inputs(*shape, dtype=dtype, device=device)
    ours, ref = run_both(u, weight, bias, 3, False, False, randn(B, J, D, device=device))
    for name, a, e in zip(["v", "grad_u", "grad_weight", "grad_bias"], ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype], name)


@pytest.mark.parametrize("iters,leaky,detach,with_bias", list(itertools.product([1, 3], [False, True], [False, True], [False, True])))
def test_every_option_combination(device, iters, leaky, detach, with_bias):
    u, weight, bias = make_inputs(3, 11, 5, 8, 4, device=device, bias=with_bias)
    ours, ref = run_both(u, weight, bias, iters, leaky, detach, randn(3, 5, 8, device=device))
    for a, e in zip(ours, ref):
        assert_rel_close(a, e, 1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage(device, dtype):
    u, weight, bias = make_inputs(4, 37, 10, 16, 8, dtype=dtype, device=device)
    ours, ref = run_both(u, weight, bias, 3, False, False, randn(4, 10, 16, device=device))
    for a, e in zip(ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype])


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", ["3", "300"])
@pytest.mark.parametrize("detach", [False, True])
def test_row_ranges_match_reference(device, monkeypatch, splits, detach):
    """The row-range path of the CUDA routing kernels (see test_dynamic_routing) with votes
    computed from the weight: the reference's results for any number of ranges."""
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", splits)
    B, I, J, D, Din = 2, 133, 10, 16, 8
    u, weight, bias = make_inputs(B, I, J, D, Din, device=device)
    ours, ref = run_both(u, weight, bias, 3, True, detach, randn(B, J, D, device=device))
    for name, a, e in zip(["v", "grad_u", "grad_weight", "grad_bias"], ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_vote_tiles_and_contraction_chunks_cpu():
    """The CPU backend computes votes a tile of elements at a time (slabs of at most 1.5 MB per
    thread) and contracts the vote gradients a chunk of input capsules at a time (4 MB): at this
    shape, on 2 threads, tiles of 2, 2, 2 and 1 elements and chunks of 468 and 32 capsules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        B, I, J, D, Din = 7, 500, 10, 16, 8
        u, weight, bias = make_inputs(B, I, J, D, Din)
        ours, ref = run_both(u, weight, bias, 3, False, False, randn(B, J, D))
    finally:
        torch.set_num_threads(threads)
    for name, a, e in zip(["v", "grad_u", "grad_weight", "grad_bias"], ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_gradcheck(device):
    u, weight, bias = make_inputs(2, 4, 3, 4, 3, device=device)
    fn = lambda x, w, b: capsroute.dense_capsules(x, w, 3, bias=b, leaky=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (u, weight, bias), fast_mode=False)


def test_opcheck(device):
    u, weight, bias = make_inputs(2, 5, 3, 4, 3, device=device)
    for args in [(u, weight, bias, 3, False, False, 1e-8), (u, weight, None, 2, True, True, 1e-8)]:
        torch.library.opcheck(torch.ops.capsroute.dense_capsules.default, args)


def test_torch_compile_fullgraph(device):
    u, weight, bias = make_inputs(2, 9, 3, 4, 5, dtype=torch.float32, device=device)

    @torch.compile(fullgraph=True)
    def step(x, w, b):
        return capsroute.dense_capsules(x, w, 3, bias=b).square().sum()

    loss = step(u, weight, bias)
    grads = torch.autograd.grad(loss, (u, weight, bias))
    loss_eager = capsroute.dense_capsules(u, weight, 3, bias=bias).square().sum()
    grads_eager = torch.autograd.grad(loss_eager, (u, weight, bias))
    assert_rel_close(loss.detach(), loss_eager.detach(), 1e-6)
    for a, e in zip(grads, grads_eager):
        assert_rel_close(a, e, 1e-6)


def test_non_contiguous(device):
    u = randn(7, 3, 11, device=device).permute(1, 2, 0).requires_grad_()  # (B=3, I=11, Din=7)
    weight = randn(11, 5, 7, 4, device=device, scale=0.5).transpose(2, 3).requires_grad_()  # (I, J, D=4, Din=7)
    assert not u.is_contiguous() and not weight.is_contiguous()
    ours, ref = run_both(u, weight, None, 3, False, False, randn(3, 5, 4, device=device))
    for a, e in zip(ours, ref):
        assert_rel_close(a, e, 1e-10)


def test_empty_batch(device):
    u, weight, bias = make_inputs(0, 7, 3, 4, 5, device=device)
    v = capsroute.dense_capsules(u, weight, bias=bias)
    assert v.shape == (0, 3, 4)
    gu, gw, gb = torch.autograd.grad(v.sum(), (u, weight, bias))
    assert gu.shape == u.shape
    assert torch.equal(gw, torch.zeros_like(weight)) and torch.equal(gb, torch.zeros_like(bias))


def test_matches_dynamic_routing_on_the_same_votes(device):
    u, weight, bias = make_inputs(3, 17, 6, 8, 5, dtype=torch.float32, device=device)
    votes = reference.dense_votes(u, weight)
    assert_rel_close(capsroute.dense_capsules(u, weight, bias=bias), capsroute.dynamic_routing(votes, bias=bias), 1e-5)


def test_deterministic(device):
    u, weight, bias = make_inputs(5, 33, 10, 16, 8, dtype=torch.float32, device=device)
    grad = randn(5, 10, 16, dtype=torch.float32, device=device)
    runs = []
    for _ in range(2):
        v = capsroute.dense_capsules(u, weight, bias=bias)
        runs.append((v,) + torch.autograd.grad(v, (u, weight, bias), grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_float16_backward_keeps_a_gradient_above_float16_range():
    """The backward takes the incoming gradient in the accumulation dtype: a float32 gradient of
    1e5 (float16 tops out at 65504) for float16 inputs gives the float32 result, not inf. One
    iteration keeps the vote gradients c_ij gs_j (c = 1/J) well inside the float16 range."""
    B, I, J, D, Din = 2, 6, 16, 8, 4
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(B, I, Din, generator=gen).to("cuda", torch.float16)
    weight = (0.5 * torch.randn(I, J, D, Din, generator=gen)).to("cuda", torch.float16)
    grad_v = torch.randn(B, J, D, generator=gen).cuda()
    grad_v[0, 3, 2] = 1e5
    options = (False, False, 1e-8)  # leaky, detach, eps
    results = []
    for x, w in ((u, weight), (u.float(), weight.float())):
        _, _, s_hist = torch.ops.capsroute.dense_capsules(x, w, None, 1, *options)
        results.append(torch.ops.capsroute._dense_capsules_backward(grad_v, x, w, s_hist, *options)[:2])
    (grad_u_half, grad_w_half), (grad_u_float, grad_w_float) = results
    for name, half, full in (("grad_u", grad_u_half, grad_u_float), ("grad_weight", grad_w_half, grad_w_float)):
        assert full.abs().max() < 65504 and torch.isfinite(half).all(), name
        assert_rel_close(half.float(), full, 1e-2, name)
