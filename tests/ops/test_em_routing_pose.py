"""em_routing_pose (votes_ij = pose_i @ weight_ij, computed in the kernel) beyond the contract
(tests/ops/test_op_contract.py): flat poses, bad input messages, every iteration count, robustness,
the CUDA backward's batch chunks, and saved statistics shared by both backends."""

import pytest
import torch

import capsroute
from helpers import CUDA, assert_rel_close
from op_db import EM_ROUTING_POSE, em_pose_inputs


def compare(inputs, iters=3):
    """(name, capsroute's, the float64 reference's) for pose, a_out and the five gradients."""
    return EM_ROUTING_POSE.compare(EM_ROUTING_POSE.sample(inputs, iters=iters))


def test_takes_flat_poses(device):
    pose, *rest = em_pose_inputs((2, 6, 3), device=device)
    flat, square = (
        capsroute.em_routing_pose(pose.flatten(-2), *rest),
        capsroute.em_routing_pose(pose, *rest),
    )
    for a, b in zip(flat, square):
        assert torch.equal(a, b)


def test_bad_input(device):
    pose, weight, a_in, beta_u, beta_a = (
        t.detach() for t in em_pose_inputs((2, 5, 3), device=device)
    )
    with pytest.raises(RuntimeError, match=r"pose must have shape \(B, I, 4, 4\)"):
        capsroute.em_routing_pose(pose[..., :3], weight, a_in, beta_u, beta_a)
    with pytest.raises(RuntimeError, match=r"weight must have shape \(I, J, 4, 4\) with I = 5"):
        capsroute.em_routing_pose(pose, weight[:4], a_in, beta_u, beta_a)
    with pytest.raises(RuntimeError, match=r"a_in must have shape \(B, I\) = \(2, 5\)"):
        capsroute.em_routing_pose(pose, weight, a_in[:1], beta_u, beta_a)


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_every_iteration_count(device, iters):
    for name, a, e in compare(em_pose_inputs((3, 11, 5), device=device), iters):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("case", ["a_in_zeros", "all_a_in_zero", "large_pose"])
def test_robust(device, case):
    pose, weight, a_in, beta_u, beta_a = em_pose_inputs(
        (3, 24, 5), device=device, dtype=torch.float32
    )
    with torch.no_grad():
        if case == "a_in_zeros":
            a_in[:, ::3] = 0
        elif case == "all_a_in_zero":
            a_in.zero_()
        else:
            pose.mul_(1e3)
    for name, ours, _ in compare((pose, weight, a_in, beta_u, beta_a)):
        assert torch.isfinite(ours).all(), f"{case}: {name} has NaN or Inf"


@pytest.mark.parametrize("splits", ["1", "3"])
def test_deterministic_for_any_batch_chunking(device, monkeypatch, splits):
    """The CUDA backward runs the batch in chunks (CAPSROUTE_EM_POSE_BACKWARD_CHUNK overrides their
    size): the gradients are bitwise the same run after run and for any chunk size, with 1 or 3
    row ranges per element in every chunk."""
    monkeypatch.setenv("CAPSROUTE_EM_SPLITS", splits)
    inputs = em_pose_inputs((9, 21, 6), device=device, dtype=torch.float32)
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
        for name, a, b in zip(EM_ROUTING_POSE.input_names, runs[0], other):
            assert torch.equal(a, b), f"grad_{name}"


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", ["1", "3"])
def test_row_ranges_match_reference(device, monkeypatch, splits):
    """The row-range EM kernels with the votes computed inside them, the backward in chunks of 2
    elements (the last one short)."""
    monkeypatch.setenv("CAPSROUTE_EM_SPLITS", splits)
    monkeypatch.setenv("CAPSROUTE_EM_POSE_BACKWARD_CHUNK", "2")
    for name, a, e in compare(em_pose_inputs((3, 11, 5), device=device)):
        assert_rel_close(a, e, 1e-10, name)


def test_stats_work_with_either_backend(device):
    """The saved statistics have one layout: the backward of either backend reads either's."""
    inputs = [t.detach() for t in em_pose_inputs((3, 13, 4), device=device)]
    grad_pose, grad_a = (
        torch.randn(3, 4, 16, dtype=torch.float64),
        torch.randn(3, 4, dtype=torch.float64),
    )
    ops = torch.ops.capsroute
    stats_here = ops.em_routing_pose(*inputs, 3, 0.01, 1e-6)[2]
    stats_cpu = ops.em_routing_pose(*[t.cpu() for t in inputs], 3, 0.01, 1e-6)[2]
    assert_rel_close(stats_here, stats_cpu, 1e-10, "stats")
    want = ops._em_routing_pose_backward(
        grad_pose, grad_a, *[t.cpu() for t in inputs], stats_cpu, 0.01, 1e-6
    )
    got = ops._em_routing_pose_backward(
        grad_pose.to(device), grad_a.to(device), *inputs, stats_cpu.to(device), 0.01, 1e-6
    )
    for name, a, e in zip(EM_ROUTING_POSE.input_names, got, want):
        assert_rel_close(a, e, 1e-10, f"grad_{name}")
