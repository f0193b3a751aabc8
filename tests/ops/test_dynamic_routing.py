"""dynamic_routing beyond the contract (tests/ops/test_op_contract.py): every option combination, the
detached coupling, NaN isolation, the coupling output, the CUDA row ranges, random shapes."""

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import capsroute
from helpers import CUDA, DEVICES, assert_rel_close, randn
from op_db import DYNAMIC_ROUTING

OPTIONS = list(
    itertools.product([1, 2, 3], [False, True], [False, True], [False, True])
)  # iters, leaky, detach, bias


def compare(votes, bias, iters, leaky, detach, generator=None):
    """(name, capsroute's, the float64 reference's) for v, c, grad_votes and grad_bias."""
    sample = DYNAMIC_ROUTING.sample((votes, bias), iters=iters, leaky=leaky, detach=detach)
    return DYNAMIC_ROUTING.compare(sample, generator)


@pytest.mark.parametrize("iters,leaky,detach,with_bias", OPTIONS)
def test_every_option_combination(device, iters, leaky, detach, with_bias):
    B, I, J, D = 3, 13, 6, 8
    votes = randn(B, I, J, D, device=device, requires_grad=True)
    bias = randn(J, D, device=device, scale=0.3, requires_grad=True) if with_bias else None
    for name, a, e in compare(votes, bias, iters, leaky, detach):
        assert_rel_close(a, e, 1e-10, name)


def test_detached_coupling_gradient(device):
    """With detach=True the coupling is a constant of the backward pass, which finite differences
    cannot see (the contract's gradcheck skips it): the gradients are the reference's instead."""
    votes = randn(2, 5, 3, 4, device=device, requires_grad=True)
    bias = randn(3, 4, device=device, scale=0.3, requires_grad=True)
    for name, a, e in compare(votes, bias, 3, False, True)[2:]:
        assert_rel_close(a, e, 1e-10, name)


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


# Options for the row-range tests: (iters, leaky, detach, bias).
SPLIT_OPTIONS = [
    (3, False, False, True),
    (3, True, True, False),
    (1, False, False, True),
    (2, True, False, True),
]


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("D", [16, 20], ids=["warp-rows", "block"])
@pytest.mark.parametrize("splits", ["2", "5", "300"])
@pytest.mark.parametrize("iters,leaky,detach,with_bias", SPLIT_OPTIONS)
def test_row_ranges_match_reference(
    device, monkeypatch, D, splits, iters, leaky, detach, with_bias
):
    """When the batch is too small to fill the GPU, each element's rows are routed in ranges, one
    block each (each range cut again among the block's warps where the warp rows fit, D = 16; the
    block kernels at D = 20), whose partial sums are added in order (CAPSROUTE_ROUTING_SPLITS forces
    how many): the results are the reference's for any number of ranges, more ranges than rows
    included."""
    monkeypatch.setenv("CAPSROUTE_ROUTING_CLUSTER", "0")  # the ranges' kernels, not the clusters
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", splits)
    B, I, J = 3, 133, 10
    votes = randn(B, I, J, D, device=device, scale=0.3, requires_grad=True)
    bias = randn(J, D, device=device, scale=0.3, requires_grad=True) if with_bias else None
    for name, a, e in compare(votes, bias, iters, leaky, detach):
        assert_rel_close(a, e, 1e-10, name)


def use_clusters(monkeypatch, cluster):
    """CAPSROUTE_ROUTING_CLUSTER=cluster; "force" (the cluster kernels whatever the batch, an error
    where they cannot run) needs sm_90 or later."""
    if cluster == "force" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread block clusters need sm_90")
    monkeypatch.setenv("CAPSROUTE_ROUTING_CLUSTER", cluster)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("cluster", ["force", "0"])
@pytest.mark.parametrize("iters,leaky,detach,with_bias", SPLIT_OPTIONS)
@pytest.mark.parametrize("I", [133, 8, 5])
def test_warp_rows_and_clusters_match_reference(
    device, monkeypatch, cluster, iters, leaky, detach, with_bias, I
):
    """The routing runs with a warp per part of an element's rows where the capsules fit a lane
    each (J <= 32, D <= 16: J = 10 and 16 two rows a warp, D = 12 read as 3 vectors; J = 20 and 32
    a row a warp, D = 5 read by scalars), with the block kernels beyond (D = 20); on sm_90 with
    CAPSROUTE_ROUTING_CLUSTER=force its forward runs an element per cluster of 8 blocks and its
    backward, vote gradient included, an element per cluster of 16 (I = 8 and 5: blocks without
    rows); with =0 the warp rows' vote gradient is written a tile of 8 rows per block: I a multiple
    of the tile, one short tile, and a last tile short (133 = 16 x 8 + 5)."""
    use_clusters(monkeypatch, cluster)
    for J, D in ((10, 16), (16, 12), (20, 16), (32, 5), (8, 20)):
        votes = randn(3, I, J, D, device=device, scale=0.3, requires_grad=True)
        bias = randn(J, D, device=device, scale=0.3, requires_grad=True) if with_bias else None
        for name, a, e in compare(votes, bias, iters, leaky, detach):
            assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize(
    "D,cluster", [(20, "1"), (16, "force"), (16, "0")], ids=["block", "clusters", "warp-rows"]
)
def test_row_ranges_deterministic_and_checked(device, monkeypatch, D, cluster):
    use_clusters(monkeypatch, cluster)
    votes = randn(2, 300, 10, D, dtype=torch.float32, device=device, requires_grad=True)
    grad = randn(2, 10, D, dtype=torch.float32, device=device)
    for splits in ("1", "4"):
        monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", splits)
        runs = []
        for _ in range(2):
            v = capsroute.dynamic_routing(votes)
            runs.append((v,) + torch.autograd.grad(v, votes, grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b)
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", "0")
    with pytest.raises(RuntimeError, match="CAPSROUTE_ROUTING_SPLITS must be an integer >= 1"):
        capsroute.dynamic_routing(votes)
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", "1")
    monkeypatch.setenv("CAPSROUTE_ROUTING_CLUSTER", "yes")
    if D <= 16:  # read only where the warp rows run, which could take the clusters
        with pytest.raises(
            RuntimeError, match="CAPSROUTE_ROUTING_CLUSTER must be 0, 1 or force, got 'yes'"
        ):
            capsroute.dynamic_routing(votes)


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    I=st.integers(1, 40),
    J=st.integers(1, 12),
    D=st.sampled_from([1, 3, 4, 8, 16]),
    iters=st.integers(1, 4),
    leaky=st.booleans(),
    scale=st.sampled_from([1e-3, 1.0, 10.0]),
    seed=st.integers(0, 2**31),
)
def test_property_matches_reference(B, I, J, D, iters, leaky, scale, seed):
    g = torch.Generator().manual_seed(seed)
    votes = randn(B, I, J, D, scale=scale, requires_grad=True, generator=g)
    for name, a, e in compare(votes, None, iters, leaky, False, generator=g):
        assert_rel_close(a, e, 1e-9, name)


@pytest.mark.parametrize("device", DEVICES)
def test_float16_backward_keeps_a_gradient_above_float16_range(device):
    """The backward takes the incoming gradient in the accumulation dtype: a float32 gradient of
    1e5 (float16 tops out at 65504) for float16 votes gives the float32 result, not inf. One
    iteration keeps every vote gradient c_ij gs_j (c = 1/J) well inside the float16 range."""
    B, I, J, D = 2, 6, 16, 8
    gen = torch.Generator().manual_seed(0)
    votes = torch.randn(B, I, J, D, generator=gen).to(device, torch.float16)
    grad_v = torch.randn(B, J, D, generator=gen).to(device)
    grad_v[0, 3, 2] = 1e5
    options = (False, False, 1e-8)  # leaky, detach, eps
    results = []
    for x in (votes, votes.float()):
        _, _, s_hist = torch.ops.capsroute.dynamic_routing(x, None, 1, *options)
        results.append(
            torch.ops.capsroute._dynamic_routing_backward(grad_v, x, s_hist, *options)[0]
        )
    grad_half, grad_float = results
    assert grad_float.abs().max() < 65504 and torch.isfinite(grad_half).all()
    assert_rel_close(grad_half.float(), grad_float, 1e-2, "grad_votes")
