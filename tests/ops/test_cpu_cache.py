"""The CPU output cache: freed output blocks come back to the next call, nothing stale leaks from a
reused block, the limit holds, and torch's profiler still counts the outputs."""

import pytest
import torch

import capsroute
from capsroute.bench.timing import cpu_peak_bytes
from capsroute.ops import reference

MiB = 1 << 20
SHAPE = (4, 1152, 10, 16)  # each vote gradient 2.9 MiB: cached


@pytest.fixture
def cache():
    """The cache emptied, at its default limit, before and after the test."""
    limit = capsroute.cpu_cache_stats()["limit_bytes"]
    capsroute.empty_cpu_cache()
    yield
    capsroute.set_cpu_cache_limit(limit)
    capsroute.empty_cpu_cache()


def vote_gradient(votes: torch.Tensor, grad_v: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(capsroute.dynamic_routing(votes, iters=3), votes, grad_v)
    return grad


def test_a_freed_output_block_serves_the_next_call(cache):
    votes = torch.randn(SHAPE, requires_grad=True)
    grad_v = torch.randn(SHAPE[0], SHAPE[2], SHAPE[3])
    first = vote_gradient(votes, grad_v)
    address = first.data_ptr()
    del first
    stats = capsroute.cpu_cache_stats()
    assert stats["cached_bytes"] >= votes.numel() * 4 and stats["cached_blocks"] >= 1
    hits = stats["hits"]
    second = vote_gradient(votes, grad_v)
    assert second.data_ptr() == address
    assert capsroute.cpu_cache_stats()["hits"] > hits


def test_a_reused_block_holds_nothing_of_its_last_tensor(cache):
    """The block the next gradient gets is poisoned with NaN first: every value must be written."""
    torch.manual_seed(0)
    votes = (0.05 * torch.randn(SHAPE, dtype=torch.float64)).float().requires_grad_()
    grad_v = torch.randn(SHAPE[0], SHAPE[2], SHAPE[3])
    poisoned = vote_gradient(votes, grad_v)
    poisoned.fill_(float("nan"))
    del poisoned
    grad = vote_gradient(votes, grad_v)
    votes64 = votes.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(
        reference.dynamic_routing(votes64, iters=3), votes64, grad_v.double()
    )
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-6)


def test_the_limit_bounds_what_is_kept(cache):
    votes = torch.randn(SHAPE, requires_grad=True)
    grad_v = torch.randn(SHAPE[0], SHAPE[2], SHAPE[3])
    capsroute.set_cpu_cache_limit(0)
    freed = vote_gradient(votes, grad_v)
    del freed
    assert capsroute.cpu_cache_stats()["cached_bytes"] == 0
    capsroute.set_cpu_cache_limit(64 * MiB)
    kept = vote_gradient(votes, grad_v)
    del kept
    assert 0 < capsroute.cpu_cache_stats()["cached_bytes"] <= 64 * MiB
    capsroute.set_cpu_cache_limit(MiB)  # lowered: the blocks beyond it freed at once
    assert capsroute.cpu_cache_stats()["cached_bytes"] <= MiB
    capsroute.set_cpu_cache_limit(64 * MiB)
    kept = vote_gradient(votes, grad_v)
    del kept
    capsroute.empty_cpu_cache()
    assert capsroute.cpu_cache_stats() | {"hits": 0, "misses": 0} == {
        "limit_bytes": 64 * MiB,
        "cached_bytes": 0,
        "cached_blocks": 0,
        "hits": 0,
        "misses": 0,
    }


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_the_limit_must_be_a_whole_number_of_bytes(bad):
    with pytest.raises(ValueError, match="nbytes"):
        capsroute.set_cpu_cache_limit(bad)


def test_the_profiler_counts_cached_outputs(cache):
    """The benchmark's CPU peak memory replays torch.profiler's allocation events: an output from
    a reused block must appear there as torch's own allocations do."""
    votes = torch.randn(SHAPE, requires_grad=True)
    grad_v = torch.randn(SHAPE[0], SHAPE[2], SHAPE[3])
    freed = vote_gradient(votes, grad_v)  # a block to reuse
    del freed
    peak = cpu_peak_bytes(lambda: vote_gradient(votes, grad_v))
    assert peak >= votes.numel() * votes.element_size()


def test_strided_votes_get_their_gradient_in_their_layout(cache):
    """Votes in the einsum layout (input-capsule major) get the gradient in that layout, as
    torch.empty_like would give it, from the cache too."""
    votes = torch.randn(SHAPE[1], SHAPE[0], SHAPE[2], SHAPE[3]).transpose(0, 1).requires_grad_()
    grad = vote_gradient(votes, torch.randn(SHAPE[0], SHAPE[2], SHAPE[3]))
    assert grad.stride() == votes.stride()
