"""conv_em_routing beyond the contract (tests/ops/test_op_contract.py): the cross-window E-step (each
child's assignments sum to 1), agreement with em_routing_pose when there is one window, padding
as children of zero activation, uncovered children, flat poses, bad input, and on CUDA the
kernel's path, its agreement with the CPU kernel and saved statistics shared by both backends."""

import pytest
import torch

import capsroute
from capsroute import reference
from helpers import CUDA, assert_rel_close
from op_db import CONV_EM_ROUTING, conv_em_inputs


def detached(inputs):
    return tuple(t.detach() for t in inputs)


@pytest.mark.parametrize("stride,padding", [(1, 0), (2, 1), (1, 2)])
def test_each_childs_assignments_sum_to_one(stride, padding):
    pose, a_in, weight, beta_u, beta_a = detached(conv_em_inputs((2, 6, 5, 3, 4, 3)))
    R = reference.conv_em_assignments(
        pose, a_in, weight, beta_u, beta_a, 3, stride=stride, padding=padding
    )
    B, H, W, C_in = a_in.shape
    windows = reference.conv_windows(H, W, 3, stride, padding)
    per_child = R.sum(-1).reshape(B, -1, C_in)  # (B, windows x K x K, C_in)
    total = per_child.new_zeros(B, (H + 2 * padding) * (W + 2 * padding), C_in).index_add(
        1, windows.flatten(), per_child
    )
    grid = total.reshape(B, H + 2 * padding, W + 2 * padding, C_in)[
        :, padding : padding + H, padding : padding + W
    ]
    covered = (
        grid.new_zeros(H + 2 * padding, W + 2 * padding)
        .flatten()
        .index_fill(0, windows.flatten(), 1)
    )
    covered = covered.reshape(H + 2 * padding, W + 2 * padding)[
        padding : padding + H, padding : padding + W
    ]
    assert covered.sum() > 0
    expected = covered[None, :, :, None].expand_as(grid)
    assert_rel_close(grid, expected, 1e-12, "sum of assignments per child")


def test_one_window_is_em_routing_pose(device):
    """K = H = W: the window's children have no other window, so this is em_routing_pose."""
    pose, a_in, weight, beta_u, beta_a = detached(conv_em_inputs((3, 3, 3, 4, 5, 3), device=device))
    inputs = [t.clone().requires_grad_() for t in (pose, a_in, weight, beta_u, beta_a)]
    conv = capsroute.conv_em_routing(*inputs)
    conv = (conv[0].reshape(3, 5, 16), conv[1].reshape(3, 5))
    flat = [
        inputs[0].reshape(3, -1, 4, 4),
        inputs[2].reshape(-1, 5, 4, 4),
        inputs[1].reshape(3, -1),
        *inputs[3:],
    ]
    per_window = capsroute.em_routing_pose(*flat)
    cotangents = [torch.randn_like(o) for o in conv]
    for name, a, b in zip(["pose", "a_out"], conv, per_window):
        assert_rel_close(a, b, 1e-12, name)
    grads_conv = torch.autograd.grad(conv, inputs, cotangents)
    grads_window = torch.autograd.grad(per_window, inputs, cotangents)
    for name, a, b in zip(["pose", "a_in", "weight", "beta_u", "beta_a"], grads_conv, grads_window):
        assert_rel_close(a, b, 1e-12, f"grad_{name}")


def test_overlapping_windows_differ_from_windows_routed_alone():
    pose, a_in, weight, beta_u, beta_a = detached(conv_em_inputs((1, 4, 4, 2, 3, 3)))
    conv_pose, _ = capsroute.conv_em_routing(pose, a_in, weight, beta_u, beta_a, final_lambda=1.0)
    windows = reference.conv_windows(4, 4, 3, 1, 0)
    window_pose = pose.reshape(1, 16, 2, 4, 4)[:, windows].reshape(4, -1, 4, 4)
    window_a = a_in.reshape(1, 16, 2)[:, windows].reshape(4, -1)
    alone, _ = capsroute.em_routing_pose(
        window_pose, weight.reshape(-1, 3, 4, 4), window_a, beta_u, beta_a, final_lambda=1.0
    )
    assert (conv_pose.reshape(4, 3, 16) - alone).abs().max() > 1e-3


def test_padding_is_children_of_zero_activation(device):
    """A padded position takes no part in any sum, as a child of zero activation does not."""
    pose, a_in, weight, beta_u, beta_a = detached(conv_em_inputs((2, 4, 5, 2, 3, 3), device=device))
    padded_pose = torch.nn.functional.pad(pose, (0, 0, 0, 0, 0, 0, 1, 1, 1, 1))
    padded_a = torch.nn.functional.pad(a_in, (0, 0, 1, 1, 1, 1))
    with_padding = capsroute.conv_em_routing(
        pose, a_in, weight, beta_u, beta_a, stride=2, padding=1
    )
    explicit = capsroute.conv_em_routing(padded_pose, padded_a, weight, beta_u, beta_a, stride=2)
    for name, a, b in zip(["pose", "a_out"], with_padding, explicit):
        assert_rel_close(a, b, 1e-12, name)


@pytest.mark.parametrize("stride,padding", [(3, 0), (2, 2)])
def test_strides_and_padding_match_the_reference(device, stride, padding):
    """Stride 3 with K = 2 leaves children no window covers: they get zero gradients."""
    sample = CONV_EM_ROUTING.draw(
        (2, 7, 6, 2, 3, 2), device, torch.float64, stride=stride, padding=padding
    )
    for name, actual, expected in CONV_EM_ROUTING.compare(sample):
        assert_rel_close(actual, expected, 1e-10, name)


@pytest.mark.parametrize("iters", [1, 2, 4])
def test_every_iteration_count(device, iters):
    sample = CONV_EM_ROUTING.draw((2, 5, 4, 2, 3, 3), device, torch.float64, iters=iters, padding=1)
    for name, actual, expected in CONV_EM_ROUTING.compare(sample):
        assert_rel_close(actual, expected, 1e-10, name)


def test_takes_flat_poses(device):
    pose, *rest = detached(conv_em_inputs((2, 4, 4, 2, 3, 3), device=device))
    flat, square = (
        capsroute.conv_em_routing(pose.flatten(-2), *rest),
        capsroute.conv_em_routing(pose, *rest),
    )
    for a, b in zip(flat, square):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("stride,padding,K", [(1, 1, 3), (2, 0, 1), (2, 1, 3)])
def test_cuda_kernel_matches_the_cpu_kernel(device, stride, padding, K):
    """The CUDA kernels (path conv-em-parent-child) against the CPU kernel in float64: overlapping
    windows with padding, K = 1 at stride 2 (children no window contains), C_out = 5."""
    inputs = [t.detach() for t in conv_em_inputs((2, 6, 5, 3, 5, K), device=device)]

    def run(tensors):
        leaves = [t.clone().requires_grad_() for t in tensors]
        pose, a_out = capsroute.conv_em_routing(
            *leaves, 3, stride=stride, padding=padding, final_lambda=0.5
        )
        cotangent = torch.randn(pose.shape, generator=torch.Generator().manual_seed(0))
        loss = (pose * cotangent.to(pose)).sum() + a_out.square().sum()
        return [pose, a_out, *torch.autograd.grad(loss, leaves)]

    capsroute.clear_kernel_paths()
    got = run(inputs)
    for direction in ("forward", "backward"):
        assert capsroute.last_kernel_path("conv_em_routing", direction) == "conv-em-parent-child"
    want = run([t.cpu() for t in inputs])
    names = ["pose", "a_out", "grad_pose", "grad_a_in", "grad_weight", "grad_beta_u", "grad_beta_a"]
    for name, a, e in zip(names, got, want):
        assert_rel_close(a.cpu(), e, 1e-10, name)


def test_stats_work_with_either_backend(device):
    """The saved statistics have one layout: the backward of either backend reads either's."""
    inputs = [t.detach() for t in conv_em_inputs((2, 5, 4, 2, 3, 3), device=device)]
    options = (3, 1, 1, 0.01, 1e-6)  # iters, stride, padding, final_lambda, eps
    ops = torch.ops.capsroute
    stats_here = ops.conv_em_routing(*inputs, *options)[2]
    stats_cpu = ops.conv_em_routing(*[t.cpu() for t in inputs], *options)[2]
    assert_rel_close(stats_here.cpu(), stats_cpu, 1e-10, "stats")
    grad_pose = torch.randn(2, 5, 4, 3, 16, dtype=torch.float64)
    grad_a = torch.randn(2, 5, 4, 3, dtype=torch.float64)
    want = ops._conv_em_routing_backward(
        grad_pose, grad_a, *[t.cpu() for t in inputs], stats_cpu, *options[1:]
    )
    got = ops._conv_em_routing_backward(
        grad_pose.to(device), grad_a.to(device), *inputs, stats_cpu.to(device), *options[1:]
    )
    for name, a, e in zip(CONV_EM_ROUTING.input_names, got, want):
        assert_rel_close(a.cpu(), e, 1e-10, f"grad_{name}")


@pytest.mark.parametrize(
    "change,message",
    [
        (
            dict(weight=lambda w: w.new_zeros(5, 5, 2, 3, 4, 4)),
            r"kernel size K = 5 is larger than the padded input \(4 x 4",
        ),
        (dict(stride=0), "stride must be >= 1, got 0"),
        (dict(padding=-1), "padding must be >= 0, got -1"),
        (
            dict(weight=lambda w: w[:, :, :1]),
            "weight has C_in = 1 \\(its dim 2\\) but pose has C_in = 2",
        ),
        (dict(pose=lambda p: p[..., :3, :3]), r"pose must have shape \(B, H, W, C_in, 4, 4\)"),
        (dict(pose=lambda p: p[0]), r"pose must have shape \(B, H, W, C_in, 4, 4\)"),
        (dict(weight=lambda w: w[:, :2]), r"weight must have shape \(K, K, C_in, C_out, 4, 4\)"),
        (dict(weight=lambda w: w[..., :3]), r"weight must have shape \(K, K, C_in, C_out, 4, 4\)"),
        (dict(a_in=lambda a: a[:, :3]), r"a_in must have shape \(B, H, W, C_in\) = \[2, 4, 4, 2\]"),
        (dict(beta_u=lambda b: b[:2]), r"beta_u must have shape \(J,\) = \(3,\)"),
        (dict(iters=0), "iters must be >= 1, got 0"),
        (dict(eps=0.0), "eps must be finite and > 0"),
    ],
)
def test_bad_input(device, change, message):
    names = ("pose", "a_in", "weight", "beta_u", "beta_a")
    tensors = dict(zip(names, detached(conv_em_inputs((2, 4, 4, 2, 3, 3), device=device))))
    options = {}
    for key, value in change.items():
        if key in tensors:
            tensors[key] = value(tensors[key])
        else:
            options[key] = value
    with pytest.raises(RuntimeError, match=message):
        capsroute.conv_em_routing(*tensors.values(), **options)
