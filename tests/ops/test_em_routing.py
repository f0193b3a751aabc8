"""em_routing beyond the contract (tests/ops/test_op_contract.py): every iteration count, robustness
where other implementations fail, bad input messages, random shapes and scales."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import capsroute
from helpers import CUDA, assert_rel_close
from op_db import EM_ROUTING, em_inputs


def compare(inputs, iters, generator=None, **options):
    """(name, capsroute's, the float64 reference's) for pose, a_out and the four gradients."""
    return EM_ROUTING.compare(EM_ROUTING.sample(inputs, iters=iters, **options), generator)


@pytest.mark.parametrize("iters", [1, 2, 3, 5])
@pytest.mark.parametrize("final_lambda", [0.01, 1.0])
def test_every_iteration_count(device, iters, final_lambda):
    for name, a, e in compare(
        em_inputs((2, 13, 5, 16), device=device), iters, final_lambda=final_lambda
    ):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", [None, "1", "3", "40"])
@pytest.mark.parametrize("iters", [1, 3])
def test_row_ranges_match_reference(device, monkeypatch, splits, iters):
    """CUDA cuts each element's rows into ranges, one block each, whose sums are added in order
    (CAPSROUTE_EM_SPLITS forces how many, None: as many as the GPU wants): the reference's results
    for one range, several, and more ranges than rows; J * H > 256."""
    if splits is None:
        monkeypatch.delenv("CAPSROUTE_EM_SPLITS", raising=False)
    else:
        monkeypatch.setenv("CAPSROUTE_EM_SPLITS", splits)
    for shape in ((3, 37, 5, 16), (2, 33, 20, 16)):
        for name, a, e in compare(em_inputs(shape, device=device), iters):
            assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
def test_row_ranges_deterministic_and_checked(device, monkeypatch):
    monkeypatch.setenv("CAPSROUTE_EM_SPLITS", "4")
    inputs = em_inputs((2, 300, 10, 16), device=device, dtype=torch.float32)
    runs = []
    for _ in range(2):
        pose, a_out = capsroute.em_routing(*inputs)
        runs.append((pose, a_out) + torch.autograd.grad(pose.square().sum() + a_out.sum(), inputs))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    monkeypatch.setenv("CAPSROUTE_EM_SPLITS", "0")
    with pytest.raises(RuntimeError, match="CAPSROUTE_EM_SPLITS must be an integer >= 1"):
        capsroute.em_routing(*inputs)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("lanes", ["auto", "capsule", "column"])
def test_warp_lanes_match_reference(device, monkeypatch, lanes):
    """The rows kernels' warps take a row a lane per (j, h) entry where H divides 32 and a lane per
    capsule elsewhere, or as CAPSROUTE_EM_LANES says: the reference's results either way, J * H
    not a multiple of 32 included, and the path they record."""
    monkeypatch.setenv("CAPSROUTE_EM_LANES", lanes)
    monkeypatch.setenv("CAPSROUTE_EM_SPLITS", "2")
    for shape in ((3, 37, 5, 16), (2, 33, 7, 4), (2, 9, 3, 32), (2, 20, 6, 5)):
        fits = 32 % shape[3] == 0
        if lanes == "column" and not fits:
            with pytest.raises(RuntimeError, match="CAPSROUTE_EM_LANES=column needs .* H = 5"):
                capsroute.em_routing(*em_inputs(shape, device=device))
            continue
        for name, a, e in compare(em_inputs(shape, device=device), 3):
            assert_rel_close(a, e, 1e-10, name)
        column = fits and lanes != "capsule"
        for direction in ("forward", "backward"):
            path = capsroute.last_kernel_path("em_routing", direction)
            assert path == ("em-column-lanes" if column else "em-row-ranges"), (shape, direction)
    monkeypatch.setenv("CAPSROUTE_EM_LANES", "columns")
    with pytest.raises(RuntimeError, match="CAPSROUTE_EM_LANES must be auto, capsule or column"):
        capsroute.em_routing(*em_inputs((2, 9, 3, 16), device=device))


@pytest.mark.parametrize(
    "case", ["a_in_zeros", "all_a_in_zero", "identical_votes", "large_votes", "no_mass"]
)
def test_robust_where_other_implementations_fail(device, case):
    """docs/ops.md, em_routing / issue 3: no NaN or Inf in outputs or gradients in the classic failure cases."""
    votes, a_in, beta_u, beta_a = em_inputs((3, 24, 5, 16), device=device, dtype=torch.float32)
    with torch.no_grad():
        if case == "a_in_zeros":
            a_in[:, ::3] = 0
        elif case == "all_a_in_zero":
            a_in.zero_()
        elif case == "identical_votes":
            votes[:] = votes[:, :1].clone()  # every input casts the same vote: zero variance
        elif case == "large_votes":
            votes.mul_(1e3)
        elif (
            case == "no_mass"
        ):  # capsule 0's votes are far from everything else: it ends up with no assignments
            votes[:, :, 0] = 1e4
            a_in[:, : a_in.shape[1] // 2] = 0
    for name, ours, _ in compare((votes, a_in, beta_u, beta_a), 3):
        assert torch.isfinite(ours).all(), f"{case}: {name} has NaN or Inf"


@pytest.mark.parametrize(
    "call,message",
    [
        (
            lambda v, a, u, b: capsroute.em_routing(v[0], a, u, b),
            r"votes must have shape \(B, I, J, H\)",
        ),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a[:, :-1], u, b),
            r"a_in must have shape \(B, I\) = \(2, 5\)",
        ),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a, u[:-1], b),
            r"beta_u must have shape \(J,\) = \(3,\)",
        ),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a, u, b.unsqueeze(0)),
            r"beta_a must have shape \(J,\)",
        ),
        (lambda v, a, u, b: capsroute.em_routing(v, a, u, b, 0), "iters must be >= 1, got 0"),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a, u, b, final_lambda=float("inf")),
            "final_lambda must be finite",
        ),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a, u, b, eps=0.0),
            "eps must be finite and > 0",
        ),
        (
            lambda v, a, u, b: capsroute.em_routing(v, a, u, b, eps=float("nan")),
            "eps must be finite and > 0",
        ),
    ],
)
def test_bad_input_raises_a_clear_error(device, call, message):
    inputs = [t.detach() for t in em_inputs((2, 5, 3, 4), device=device)]
    with pytest.raises(RuntimeError, match=message):
        call(*inputs)


def test_backward_names_saved_statistics_of_the_wrong_rank(device):
    votes, a_in, beta_u, beta_a = (t.detach() for t in em_inputs((2, 5, 3, 4), device=device))
    pose, a_out, stats = torch.ops.capsroute.em_routing(votes, a_in, beta_u, beta_a, 2, 0.01, 1e-6)
    with pytest.raises(RuntimeError, match=r"stats must have shape \(B, iters, J, 2H \+ 1\)"):
        torch.ops.capsroute._em_routing_backward(
            pose, a_out, votes, a_in, beta_u, beta_a, stats[0], 0.01, 1e-6
        )


@settings(max_examples=20, deadline=None)
@given(
    B=st.integers(1, 3),
    I=st.integers(1, 30),
    J=st.integers(1, 8),
    H=st.sampled_from([1, 4, 16]),
    iters=st.integers(1, 4),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
    seed=st.integers(0, 2**31),
)
def test_property_matches_reference(B, I, J, H, iters, scale, seed):
    g = torch.Generator().manual_seed(seed)
    for name, a, e in compare(
        em_inputs((B, I, J, H), generator=g, vote_scale=scale), iters, generator=g
    ):
        # An output with effectively one vote (I = 1, or one-hot assignments) has mu = V m / (m + eps)
        # and var ~ eps: V - mu cancels to |V| eps / m, so two float64 implementations of the same
        # formula differ in grad_votes by up to about 2^-52 m / eps ~ 1e-8 (7.7e-8 seen: B=2, I=1,
        # J=3, H=16, iters=3, scale 30, seed 0). Every other output agrees to ~1e-11.
        assert_rel_close(a, e, 1e-6 if name == "grad_votes" else 1e-8, name)
