import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capsroute
from capsroute import reference
from conftest import TOLERANCE, assert_rel_close, randn



@pytest.fixture
def device(device, request):
    op = "em_routing_pose" if "pose" in request.node.name else "em_routing"
    if device == "cuda" and not torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CUDA"):
        pytest.skip(f"capsroute has no CUDA kernel for {op} yet")
    return device


SHAPES = [(3, 37, 7, 16), (2, 19, 10, 4), (1, 5, 1, 16), (2, 33, 3, 1)]  # B, I, J, H


def make_inputs(B, I, J, H, dtype=torch.float64, device="cpu", generator=None, vote_scale=1.0):
    votes = randn(B, I, J, H, dtype=dtype, device=device, scale=vote_scale, requires_grad=True, generator=generator)
    # Activations well inside (0, 1]: near 0 the outputs bend too sharply for finite differences
    # (gradcheck); exact zeros have their own robustness tests.
    a_in = (0.1 + 0.9 * torch.rand(B, I, dtype=torch.float64, generator=generator)).to(device, dtype).requires_grad_()
    beta_u = randn(J, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=generator)
    beta_a = randn(J, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=generator)
    return votes, a_in, beta_u, beta_a


def run(impl, inputs, iters, grads, **kw):
    pose, a_out = impl.em_routing(*inputs, iters, **kw)
    loss = (pose * grads[0].to(pose.dtype)).sum() + (a_out * grads[1].to(a_out.dtype)).sum()
    return (pose, a_out) + torch.autograd.grad(loss, inputs)


def run_both(inputs, iters, **kw):
    """(pose, a_out, grad_votes, grad_a_in, grad_beta_u, grad_beta_a) from capsroute and the float64 reference."""
    B, I, J, H = inputs[0].shape
    grads = (torch.randn(B, J, H, dtype=torch.float64).to(inputs[0].device),
             torch.randn(B, J, dtype=torch.float64).to(inputs[0].device))
    ref_inputs = tuple(t.detach().double().requires_grad_() for t in inputs)
    return run(capsroute, inputs, iters, grads, **kw), run(reference, ref_inputs, iters, grads, **kw)


NAMES = ["pose", "a_out", "grad_votes", "grad_a_in", "grad_beta_u", "grad_beta_a"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_on_odd_shapes(device, dtype, shape):
    ours, ref = run_both(make_inputs(*shape, dtype=dtype, device=device), 3)
    for name, a, e in zip(NAMES, ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype] * (10 if dtype == torch.float32 else 1), name)


@pytest.mark.parametrize("iters", [1, 2, 3, 5])
@pytest.mark.parametrize("final_lambda", [0.01, 1.0])
def test_every_iteration_count(device, iters, final_lambda):
    ours, ref = run_both(make_inputs(2, 13, 5, 16, device=device), iters, final_lambda=final_lambda)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_gradcheck(device):
    inputs = make_inputs(2, 5, 3, 4, device=device)
    fn = lambda *x: capsroute.em_routing(*x, 3, final_lambda=0.5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=False)


def test_opcheck(device):
    inputs = make_inputs(2, 7, 3, 4, device=device)
    torch.library.opcheck(torch.ops.capsroute.em_routing.default, (*inputs, 3, 0.01, 1e-6))


def test_torch_compile_fullgraph(device):
    inputs = make_inputs(2, 9, 3, 4, dtype=torch.float32, device=device)

    @torch.compile(fullgraph=True)
    def step(*x):
        pose, a_out = capsroute.em_routing(*x)
        return pose.square().sum() + a_out.sum()

    grads = torch.autograd.grad(step(*inputs), inputs)
    pose, a_out = capsroute.em_routing(*inputs)
    grads_eager = torch.autograd.grad(pose.square().sum() + a_out.sum(), inputs)
    for a, e in zip(grads, grads_eager):
        assert_rel_close(a, e, 1e-5)


def test_non_contiguous(device):
    votes = randn(7, 2, 11, 4, device=device).permute(1, 2, 0, 3).requires_grad_()  # (B=2, I=11, J=7, H=4)
    a_in = torch.rand(11, 2, dtype=torch.float64).to(device).t().requires_grad_()
    beta_u = randn(14, device=device)[::2].requires_grad_()
    beta_a = randn(7, device=device, requires_grad=True)
    assert not (votes.is_contiguous() or a_in.is_contiguous() or beta_u.is_contiguous())
    ours, ref = run_both((votes, a_in, beta_u, beta_a), 3)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_empty_batch(device):
    inputs = make_inputs(0, 7, 3, 4, device=device)
    pose, a_out = capsroute.em_routing(*inputs)
    assert pose.shape == (0, 3, 4) and a_out.shape == (0, 3)
    grads = torch.autograd.grad(pose.sum() + a_out.sum(), inputs)
    assert grads[0].shape == inputs[0].shape
    assert torch.equal(grads[2], torch.zeros_like(inputs[2])) and torch.equal(grads[3], torch.zeros_like(inputs[3]))


def assert_all_finite(outputs, what):
    for name, t in zip(NAMES, outputs):
        assert torch.isfinite(t).all(), f"{what}: {name} has NaN or Inf"


@pytest.mark.parametrize("case", ["a_in_zeros", "all_a_in_zero", "identical_votes", "large_votes", "no_mass"])
def test_robust_where_other_implementations_fail(device, case):
    """docs/ops.md, em_routing / issue 3: no NaN or Inf in outputs or gradients in the classic failure cases."""
    votes, a_in, beta_u, beta_a = make_inputs(3, 24, 5, 16, dtype=torch.float32, device=device)
    with torch.no_grad():
        if case == "a_in_zeros":
            a_in[:, ::3] = 0
        elif case == "all_a_in_zero":
            a_in.zero_()
        elif case == "identical_votes":
            votes[:] = votes[:, :1].clone()  # every input casts the same vote: zero variance
        elif case == "large_votes":
            votes.mul_(1e3)
        elif case == "no_mass":  # capsule 0's votes are far from everything else: it ends up with no assignments
            votes[:, :, 0] = 1e4
            a_in[:, : a_in.shape[1] // 2] = 0
    ours, ref = run_both((votes, a_in, beta_u, beta_a), 3)
    assert_all_finite(ours, case)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_storage(device, dtype):
    inputs = make_inputs(3, 37, 10, 16, dtype=dtype, device=device)
    ours, ref = run_both(inputs, 3)
    assert_all_finite(ours, str(dtype))
    for name, a, e in zip(NAMES, ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype] * 4, name)


def test_deterministic(device):
    inputs = make_inputs(4, 33, 10, 16, dtype=torch.float32, device=device)
    runs = [run(capsroute, inputs, 3, (torch.ones(4, 10, 16, device=device), torch.ones(4, 10, device=device)))
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call,message", [
    (lambda v, a, u, b: capsroute.em_routing(v[0], a, u, b), r"votes must have shape \(B, I, J, H\)"),
    (lambda v, a, u, b: capsroute.em_routing(v, a[:, :-1], u, b), r"a_in must have shape \(B, I\) = \(2, 5\)"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u[:-1], b), r"beta_u must have shape \(J,\) = \(3,\)"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u, b.unsqueeze(0)), r"beta_a must have shape \(J,\)"),
    (lambda v, a, u, b: capsroute.em_routing(v, a.float(), u, b), "a_in has dtype Float"),
    (lambda v, a, u, b: capsroute.em_routing(v.int(), a, u, b), "votes must be float32"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u, b, 0), "iters must be >= 1, got 0"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u, b, final_lambda=float("inf")), "final_lambda must be finite"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u, b, eps=0.0), "eps must be finite and > 0"),
    (lambda v, a, u, b: capsroute.em_routing(v, a, u, b, eps=float("nan")), "eps must be finite and > 0"),
])
def test_bad_input_raises_a_clear_error(device, call, message):
    inputs = [t.detach() for t in make_inputs(2, 5, 3, 4, device=device)]
    with pytest.raises(RuntimeError, match=message):
        call(*inputs)


def test_backward_names_saved_statistics_of_the_wrong_rank(device):
    votes, a_in, beta_u, beta_a = (t.detach() for t in make_inputs(2, 5, 3, 4, device=device))
    pose, a_out, stats = torch.ops.capsroute.em_routing(votes, a_in, beta_u, beta_a, 2, 0.01, 1e-6)
    with pytest.raises(RuntimeError, match=r"stats must have shape \(B, iters, J, 2H \+ 1\)"):
        torch.ops.capsroute._em_routing_backward(pose, a_out, votes, a_in, beta_u, beta_a, stats[0], 0.01, 1e-6)


@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 3), I=st.integers(1, 30), J=st.integers(1, 8), H=st.sampled_from([1, 4, 16]),
       iters=st.integers(1, 4), scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=st.integers(0, 2**31))
def test_property_matches_reference(B, I, J, H, iters, scale, seed):
    g = torch.Generator().manual_seed(seed)
    ours, ref = run_both(make_inputs(B, I, J, H, generator=g, vote_scale=scale), iters)
    for name, a, e in zip(NAMES, ours, ref):
        assert_rel_close(a, e, 1e-8, name)


# ---- the fused pose variant: votes_ij = pose_i @ weight_ij ----

def make_pose_inputs(B, I, J, dtype=torch.float64, device="cpu"):
    pose = randn(B, I, 4, 4, dtype=dtype, device=device, requires_grad=True)
    weight = randn(I, J, 4, 4, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    _, a_in, beta_u, beta_a = make_inputs(B, I, J, 16, dtype=dtype, device=device)
    return pose, weight, a_in, beta_u, beta_a


def run_pose_both(inputs, iters=3):
    B, J = inputs[0].shape[0], inputs[1].shape[1]
    grads = (torch.randn(B, J, 16, dtype=torch.float64, device=inputs[0].device),
             torch.randn(B, J, dtype=torch.float64, device=inputs[0].device))
    out = []
    for impl, xs in ((capsroute, inputs), (reference, tuple(t.detach().double().requires_grad_() for t in inputs))):
        pose, a_out = impl.em_routing_pose(*xs, iters)
        loss = (pose * grads[0].to(pose.dtype)).sum() + (a_out * grads[1].to(a_out.dtype)).sum()
        out.append((pose, a_out) + torch.autograd.grad(loss, xs))
    return out


POSE_NAMES = ["pose", "a_out", "grad_pose", "grad_weight", "grad_a_in", "grad_beta_u", "grad_beta_a"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,I,J", [(3, 37, 7), (1, 5, 1), (20, 9, 32)])
def test_pose_variant_matches_reference(device, dtype, B, I, J):
    ours, ref = run_pose_both(make_pose_inputs(B, I, J, dtype=dtype, device=device))
    for name, a, e in zip(POSE_NAMES, ours, ref):
        assert a.dtype == dtype
        assert_rel_close(a, e, TOLERANCE[dtype] * (10 if dtype == torch.float32 else 1), name)


def test_pose_variant_takes_flat_poses(device):
    pose, *rest = make_pose_inputs(2, 6, 3, device=device)
    flat, square = capsroute.em_routing_pose(pose.flatten(-2), *rest), capsroute.em_routing_pose(pose, *rest)
    for a, b in zip(flat, square):
        assert torch.equal(a, b)


def test_pose_variant_gradcheck_and_opcheck(device):
    inputs = make_pose_inputs(2, 3, 2, device=device)
    assert torch.autograd.gradcheck(lambda *x: capsroute.em_routing_pose(*x, 2, final_lambda=0.5), inputs,
                                    fast_mode=False)
    torch.library.opcheck(torch.ops.capsroute.em_routing_pose.default, (*inputs, 3, 0.01, 1e-6))


def test_pose_variant_bad_input(device):
    pose, weight, a_in, beta_u, beta_a = (t.detach() for t in make_pose_inputs(2, 5, 3, device=device))
    with pytest.raises(RuntimeError, match=r"pose must have shape \(B, I, 4, 4\)"):
        capsroute.em_routing_pose(pose[..., :3], weight, a_in, beta_u, beta_a)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(I, J, 4, 4\) with I = 5"):
        capsroute.em_routing_pose(pose, weight[:4], a_in, beta_u, beta_a)
    with pytest.raises(RuntimeError, match=r"a_in must have shape \(B, I\) = \(2, 5\)"):
        capsroute.em_routing_pose(pose, weight, a_in[:1], beta_u, beta_a)


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_pose_variant_every_iteration_count(device, iters):
    ours, ref = run_pose_both(make_pose_inputs(3, 11, 5, device=device), iters)
    for name, a, e in zip(POSE_NAMES, ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_pose_variant_non_contiguous(device):
    pose = randn(4, 4, 2, 9, device=device).permute(2, 3, 1, 0).requires_grad_()  # (B=2, I=9, 4, 4), transposed
    weight = (0.5 * randn(5, 9, 4, 4, device=device)).transpose(0, 1).requires_grad_()  # (I=9, J=5, 4, 4)
    a_in = (0.1 + 0.9 * torch.rand(9, 2, dtype=torch.float64)).to(device).t().requires_grad_()
    beta_u = randn(10, device=device)[::2].requires_grad_()
    beta_a = randn(5, device=device, requires_grad=True)
    assert not (pose.is_contiguous() or weight.is_contiguous() or a_in.is_contiguous() or beta_u.is_contiguous())
    ours, ref = run_pose_both((pose, weight, a_in, beta_u, beta_a))
    for name, a, e in zip(POSE_NAMES, ours, ref):
        assert_rel_close(a, e, 1e-10, name)


def test_pose_variant_empty_batch(device):
    inputs = make_pose_inputs(0, 7, 3, device=device)
    pose, a_out = capsroute.em_routing_pose(*inputs)
    assert pose.shape == (0, 3, 16) and a_out.shape == (0, 3)
    grads = torch.autograd.grad(pose.sum() + a_out.sum(), inputs)
    assert grads[0].shape == inputs[0].shape and grads[2].shape == inputs[2].shape
    for k in (1, 3, 4):  # weight and betas: sums over an empty batch
        assert torch.equal(grads[k], torch.zeros_like(inputs[k]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_pose_variant_low_precision_storage(device, dtype):
    ours, ref = run_pose_both(make_pose_inputs(3, 37, 10, dtype=dtype, device=device))
    for name, a, e in zip(POSE_NAMES, ours, ref):
        assert a.dtype == dtype
        assert torch.isfinite(a).all(), name
        assert_rel_close(a, e, TOLERANCE[dtype] * 4, name)


@pytest.mark.parametrize("case", ["a_in_zeros", "all_a_in_zero", "large_pose"])
def test_pose_variant_robust(device, case):
    pose, weight, a_in, beta_u, beta_a = make_pose_inputs(3, 24, 5, dtype=torch.float32, device=device)
    with torch.no_grad():
        if case == "a_in_zeros":
            a_in[:, ::3] = 0
        elif case == "all_a_in_zero":
            a_in.zero_()
        else:
            pose.mul_(1e3)
    ours, _ = run_pose_both((pose, weight, a_in, beta_u, beta_a))
    for name, t in zip(POSE_NAMES, ours):
        assert torch.isfinite(t).all(), f"{case}: {name} has NaN or Inf"


def test_pose_variant_deterministic_for_any_batch_chunking(device, monkeypatch):
    """The CUDA backward runs the batch in chunks (CAPSROUTE_EM_POSE_BACKWARD_CHUNK overrides their
    size): the gradients are bitwise the same run after run and for any chunk size."""
    inputs = make_pose_inputs(9, 21, 6, dtype=torch.float32, device=device)
    pose, a_out = capsroute.em_routing_pose(*inputs)
    loss = pose.square().sum() + a_out.sum()
    runs = []
    for chunk in (None, None, "1", "4"):
        if chunk is None:
            monkeypatch.delenv("CAPSROUTE_EM_POSE_BACKWARD_CHUNK", raising=False)
        else:
            monkeypatch.setenv("CAPSROUTE_EM_POSE_BACKWARD_CHUNK", chunk)
        runs.append(torch.autograd.grad(loss, inputs, retain_graph=True))
    for other in runs[1:]:
        for name, a, b in zip(POSE_NAMES[2:], runs[0], other):
            assert torch.equal(a, b), name


def test_pose_variant_stats_work_with_either_backend(device):
    """The saved statistics have one layout: the backward of either backend reads either's."""
    inputs = [t.detach() for t in make_pose_inputs(3, 13, 4, device=device)]
    grad_pose, grad_a = torch.randn(3, 4, 16, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    ops = torch.ops.capsroute
    stats_here = ops.em_routing_pose(*inputs, 3, 0.01, 1e-6)[2]
    stats_cpu = ops.em_routing_pose(*[t.cpu() for t in inputs], 3, 0.01, 1e-6)[2]
    assert_rel_close(stats_here, stats_cpu, 1e-10, "stats")
    want = ops._em_routing_pose_backward(grad_pose, grad_a, *[t.cpu() for t in inputs], stats_cpu, 0.01, 1e-6)
    got = ops._em_routing_pose_backward(grad_pose.to(device), grad_a.to(device), *inputs, stats_cpu.to(device),
                                        0.01, 1e-6)
    for name, a, e in zip(POSE_NAMES[2:], got, want):
        assert_rel_close(a, e, 1e-10, name)
