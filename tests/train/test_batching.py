"""capsroute.train.batching: the CapsNet paper's random shift, and an epoch's batches (order,
resumption, shards, refusals)."""

import pytest
import torch

from capsroute.train import batching

# ---------------------------------------------------------------------------------------------
# shift_augment
# ---------------------------------------------------------------------------------------------


def shifted(image: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """Reference: image (C, H, W) moved by (dy, dx), zero filled."""
    out = torch.zeros_like(image)
    h, w = image.shape[-2:]
    out[:, max(dy, 0) : h + min(dy, 0), max(dx, 0) : w + min(dx, 0)] = image[
        :, max(-dy, 0) : h + min(-dy, 0), max(-dx, 0) : w + min(-dx, 0)
    ]
    return out


def test_shift_augment_matches_reference(device):
    n, h, w, m = 400, 11, 9, 2
    gen = torch.Generator().manual_seed(3)
    images = torch.zeros(n, 2, h, w, device=device)
    images[:, 0] = torch.rand(n, h, w, generator=gen).to(device)
    images[:, 1, h // 2, w // 2] = 1.0  # a marker pixel, far enough from the border to stay inside
    out = batching.shift_augment(images, m, generator=gen)
    assert out.shape == images.shape and out.device == images.device and out.dtype == images.dtype
    marker = out[:, 1].reshape(n, -1)
    assert torch.equal(marker.sum(1), torch.ones(n, device=device))  # the mass is kept
    pos = marker.argmax(1).cpu()
    dy, dx = (pos // w - h // 2).tolist(), (pos % w - w // 2).tolist()
    assert max(map(abs, dy)) <= m and max(map(abs, dx)) <= m
    assert len(set(zip(dy, dx))) == (2 * m + 1) ** 2  # every shift occurs
    for i in range(n):
        assert torch.equal(out[i], shifted(images[i], dy[i], dx[i]))


def test_shift_augment_deterministic_and_dtypes(device):
    x = torch.randint(
        0, 256, (64, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    x = x.to(device)
    a = batching.shift_augment(x, generator=torch.Generator().manual_seed(7))
    b = batching.shift_augment(x, generator=torch.Generator().manual_seed(7))
    c = batching.shift_augment(x, generator=torch.Generator().manual_seed(8))
    assert a.dtype == torch.uint8 and torch.equal(a, b) and not torch.equal(a, c)
    f = batching.shift_augment(x.double() / 255, generator=torch.Generator().manual_seed(7))
    assert f.dtype == torch.float64 and torch.equal(
        f, a.double() / 255
    )  # the same shifts whatever the dtype
    ones = batching.shift_augment(
        torch.ones(64, 1, 28, 28, device=device), 2, torch.Generator().manual_seed(1)
    )
    assert ones.sum((1, 2, 3)).min() >= 26 * 26  # zero filled: at most 2 rows and 2 columns lost
    assert torch.equal(batching.shift_augment(x, 0, torch.Generator().manual_seed(7)), x)


def test_shift_augment_bad_inputs():
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        batching.shift_augment(torch.zeros(2, 28, 28))
    with pytest.raises(ValueError, match="max_shift must be >= 0"):
        batching.shift_augment(torch.zeros(2, 1, 28, 28), -1)


# ---------------------------------------------------------------------------------------------
# batches
# ---------------------------------------------------------------------------------------------


def epoch(n=103, batch_size=10, seed=0, **kwargs):
    """[(images, labels)] of one epoch over images[i] = i-dependent pixels, labels[i] = i."""
    images = (torch.arange(n)[:, None, None, None] % 256).to(torch.uint8).expand(n, 1, 2, 2)
    gen = torch.Generator().manual_seed(seed)
    return list(batching.batches(images, torch.arange(n), batch_size, generator=gen, **kwargs))


def order(batches):
    return [i for _, labels in batches for i in labels.tolist()]


def test_batches_cover_every_sample_once():
    batches = epoch(shuffle=True)
    assert [len(labels) for _, labels in batches] == [10] * 10 + [3]
    assert len(batches) == batching.num_batches(103, 10)
    assert sorted(order(batches)) == list(range(103)) and order(batches) != list(range(103))
    for images, labels in batches:
        assert images.dtype == torch.float32 and images.shape == (len(labels), 1, 2, 2)
        assert torch.equal(
            images, (labels % 256).float().div(255)[:, None, None, None].expand_as(images)
        )
    assert order(epoch(shuffle=False)) == list(range(103))
    dropped = epoch(shuffle=True, drop_last=True)
    assert (
        [len(labels) for _, labels in dropped]
        == [10] * 10
        == [10] * batching.num_batches(103, 10, drop_last=True)
    )


def test_batches_order_is_a_function_of_the_generator():
    assert order(epoch(seed=1)) == order(epoch(seed=1)) != order(epoch(seed=2))
    # The order is drawn when `batches` is called, not when iteration starts.
    gen = torch.Generator().manual_seed(1)
    it = batching.batches(torch.zeros(103, 1, 2, 2), torch.arange(103), 10, generator=gen)
    torch.rand(5, generator=gen)
    assert order(it) == order(epoch(seed=1))
    float_images = torch.rand(8, 1, 2, 2)
    ((images, _),) = batching.batches(float_images, torch.arange(8), 8, shuffle=False)
    assert torch.equal(images, float_images)  # float images pass through unchanged


def test_batches_skip_resumes_mid_epoch():
    full = epoch(seed=5)
    for skip in (0, 4, 10, 11, 20):
        resumed = epoch(seed=5, skip=skip)
        assert order(resumed) == order(full[skip:])


@pytest.mark.parametrize("n", [100, 103])
def test_batches_distributed_shards(n):
    shards = [order(epoch(n, seed=3, rank=r, world_size=2)) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == -(-n // 2)
    assert len(epoch(n, seed=3, rank=0, world_size=2)) == len(
        epoch(n, seed=3, rank=1, world_size=2)
    )
    assert set(shards[0]) | set(shards[1]) == set(range(n))
    assert len(set(shards[0]) & set(shards[1])) == (
        n % 2
    )  # disjoint but for the wrap-around padding
    assert shards[0] + shards[1] != order(epoch(n, seed=3))  # interleaved, not split in halves
    merged = [i for pair in zip(*shards) for i in pair]
    assert merged[:n] == order(epoch(n, seed=3))  # the ranks share one permutation
    tiny = [order(epoch(2, rank=r, world_size=3)) for r in range(3)]
    assert all(len(s) == 1 for s in tiny) and {s[0] for s in tiny} == {0, 1}


def test_batches_bad_arguments():
    x, y = torch.zeros(4, 1, 2, 2), torch.arange(4)
    for kwargs, message in [
        ({"batch_size": 0}, "batch_size"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"skip": -1}, "skip"),
    ]:
        with pytest.raises(ValueError, match=message):
            batching.batches(x, y, **{"batch_size": 2, **kwargs})
    with pytest.raises(ValueError, match="4 images but 3 labels"):
        batching.batches(x, y[:3], 2)
