"""dense_capsules beyond the contract (tests/ops/test_op_contract.py): every option combination, the
CUDA row ranges, the CPU vote tiles, and agreement with dynamic_routing on the same votes."""

import itertools

import pytest
import torch

import capsroute
from capsroute import reference
from helpers import CUDA, DEVICES, TOLERANCE, assert_rel_close
from op_db import DENSE_CAPSULES, dense_inputs


def compare(u, weight, bias, iters, leaky, detach):
    """(name, capsroute's, the float64 reference's) for v, grad_u, grad_weight and grad_bias."""
    return DENSE_CAPSULES.compare(
        DENSE_CAPSULES.sample((u, weight, bias), iters=iters, leaky=leaky, detach=detach)
    )


@pytest.mark.parametrize(
    "iters,leaky,detach,with_bias",
    list(itertools.product([1, 3], [False, True], [False, True], [False, True])),
)
def test_every_option_combination(device, iters, leaky, detach, with_bias):
    u, weight, bias = dense_inputs((3, 11, 5, 8, 4), device=device, bias=with_bias)
    for name, a, e in compare(u, weight, bias, iters, leaky, detach):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("splits", ["3", "300"])
@pytest.mark.parametrize("detach", [False, True])
def test_row_ranges_match_reference(device, monkeypatch, splits, detach):
    """The row-range path of the CUDA routing kernels (see test_dynamic_routing) over the votes
    made from the weight: the reference's results for any number of ranges."""
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", splits)
    u, weight, bias = dense_inputs((2, 133, 10, 16, 8), device=device)
    for name, a, e in compare(u, weight, bias, 3, True, detach):
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("chunk", [None, "1", "2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("detach", [False, True])
def test_gemm_chunks_match_reference(device, monkeypatch, chunk, dtype, detach):
    """On CUDA the votes of a chunk of the batch as one batched GEMM, the routing kernels over
    them, the backward's contractions as batched GEMMs; the whole batch in one chunk, and
    (CAPSROUTE_DENSE_CHUNK) chunks of 1 and 2 elements, the last one short. With 3 split row ranges
    the chunks also take the row-range path."""
    monkeypatch.setenv("CAPSROUTE_ROUTING_SPLITS", "3")
    if chunk is None:
        monkeypatch.delenv("CAPSROUTE_DENSE_CHUNK", raising=False)
    else:
        monkeypatch.setenv("CAPSROUTE_DENSE_CHUNK", chunk)
    u, weight, bias = dense_inputs((5, 133, 10, 16, 8), device=device, dtype=dtype)
    for name, a, e in compare(u, weight, bias, 3, True, detach):
        assert_rel_close(a, e, 1e-10 if dtype == torch.float64 else 1e-5, name)


@pytest.mark.parametrize("device", [CUDA])
def test_rejects_a_bad_chunk(device, monkeypatch):
    monkeypatch.setenv("CAPSROUTE_DENSE_CHUNK", "0")
    u, weight, bias = dense_inputs((2, 5, 3, 4, 2), device=device)
    with pytest.raises(RuntimeError, match="CAPSROUTE_DENSE_CHUNK must be an integer >= 1"):
        capsroute.dense_capsules(u, weight, bias=bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(7, 1300, 10, 16, 11), (40, 45, 16, 16, 3)])
def test_vote_groups_and_contraction_blocks_cpu(threads, shape):
    """The CPU backend computes votes a group of elements at a time (a slab of at most 3 MB per
    thread, at least an element per thread, the group's input capsules split over the threads)
    and contracts the vote gradients input capsule by input capsule, 8 rows of weight_i at a time,
    then one, their rows built a block of input capsules at a time (at most 256 KB of rows per
    thread, at most a tile of kTileRows capsules). At the first shape (1.66 MB of float64 votes
    per element): groups of 1 element on one thread, of 3, 3 and 1 elements on two; Din = 11 is a
    block of 8 rows and 3 single rows; blocks of a whole tile, starting inside one on two threads
    (650 capsules each). At the second: blocks of 3 capsules (80 KB of rows each), less than a
    tile of AVX2 or AVX-512 doubles, and on two threads ranges of 23 and 22 capsules, whose last
    blocks are 2 and 1 and the second of which starts inside a tile."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = compare(*dense_inputs(shape), 3, False, False)
    finally:
        torch.set_num_threads(saved)
    for name, a, e in results:
        assert_rel_close(a, e, 1e-10, name)


@pytest.mark.parametrize("shape", [(3, 37, 7, 16, 8), (3, 21, 5, 12, 19)])
@pytest.mark.parametrize("detach", [False, True])
def test_float32_weight_transposes_cpu(shape, detach):
    """In float32 the CPU backend transposes weight_i and writes the weight gradient through
    register transposes of a vector's width (8 floats with AVX2, 16 with AVX-512) x 8 input
    values: whole blocks at J*D = 112 and Din = 8; at J*D = 60 and Din = 19 partial blocks on
    both sides, and blocks that start at input value 8. D = 12 also leaves the vote-gradient rows
    a partial vector per output capsule."""
    for name, a, e in compare(*dense_inputs(shape, dtype=torch.float32), 3, False, detach):
        assert_rel_close(a, e, TOLERANCE[torch.float32], name)


def test_matches_dynamic_routing_on_the_same_votes(device):
    u, weight, bias = dense_inputs((3, 17, 6, 8, 5), device=device, dtype=torch.float32)
    votes = reference.dense_votes(u, weight)
    assert_rel_close(
        capsroute.dense_capsules(u, weight, bias=bias),
        capsroute.dynamic_routing(votes, bias=bias),
        1e-5,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_float16_backward_keeps_a_gradient_above_float16_range(device):
    """The backward takes the incoming gradient in the accumulation dtype: a float32 gradient of
    1e5 (float16 tops out at 65504) for float16 inputs gives the float32 result, not inf. One
    iteration keeps the vote gradients c_ij gs_j (c = 1/J) well inside the float16 range."""
    B, I, J, D, Din = 2, 6, 16, 8, 4
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(B, I, Din, generator=gen).to(device, torch.float16)
    weight = (0.5 * torch.randn(I, J, D, Din, generator=gen)).to(device, torch.float16)
    grad_v = torch.randn(B, J, D, generator=gen).to(device)
    grad_v[0, 3, 2] = 1e5
    options = (False, False, 1e-8)  # leaky, detach, eps
    results = []
    for x, w in ((u, weight), (u.float(), weight.float())):
        _, _, s_hist = torch.ops.capsroute.dense_capsules(x, w, None, 1, *options)
        results.append(
            torch.ops.capsroute._dense_capsules_backward(grad_v, x, w, s_hist, *options)[:2]
        )
    (grad_u_half, grad_w_half), (grad_u_float, grad_w_float) = results
    for name, half, full in (
        ("grad_u", grad_u_half, grad_u_float),
        ("grad_weight", grad_w_half, grad_w_float),
    ):
        assert full.abs().max() < 65504 and torch.isfinite(half).all(), name
        assert_rel_close(half.float(), full, 1e-2, name)
