"""capsroute.train.augment: the shift shared with batching.shift_augment, and the official Efficient-CapsNet
MNIST generator's augmentation, step by step and as drawn."""

import pytest
import torch

from capsroute.train import augment


def digits(n=64):
    """Blocky digit-like images: a bright rectangle of random size and place, zeros around."""
    g = torch.Generator().manual_seed(1)
    images = torch.zeros(n, 1, 28, 28)
    for k in range(n):
        top, left = torch.randint(3, 10, (2,), generator=g).tolist()
        height, width = torch.randint(8, 15, (2,), generator=g).tolist()
        images[k, 0, top : top + height, left : left + width] = 1
    return images


def test_translate_moves_and_zero_fills():
    images = torch.rand(2, 3, 5, 6)
    out = augment.translate(images, torch.tensor([1, -2]), torch.tensor([-1, 3]))
    assert torch.equal(out[0, :, 1:, :-1], images[0, :, :-1, 1:])
    assert not out[0, :, 0].any() and not out[0, :, :, -1].any()
    assert torch.equal(out[1, :, :-2, 3:], images[1, :, 2:, :-3])
    assert not out[1, :, -2:].any() and not out[1, :, :, :3].any()


def test_augmentation_is_a_function_of_the_generator():
    images = digits()
    a, b, c = (
        augment.efficient_capsnet(images, torch.Generator().manual_seed(seed)) for seed in (5, 5, 6)
    )
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == images.shape and a.dtype == images.dtype
    assert not torch.equal(a, images)


def test_rotation_turns_counterclockwise_about_the_centre_pixel():
    image = torch.zeros(2, 1, 28, 28)
    image[:, 0, 14, 20] = 1  # 6 pixels right of OpenCV's centre (14, 14)
    out = augment._rotate(image, torch.tensor([90.0, 90.0]), torch.tensor([True, False]))
    assert out[0, 0, 8, 14] == pytest.approx(1, abs=1e-4)  # now above the centre
    assert out[0].sum() == pytest.approx(1, abs=1e-4)
    assert torch.equal(out[1], image[1])  # not drawn for rotation: untouched


def test_shift_keeps_the_ink_inside():
    images = digits()
    amounts = torch.full((64, 2), 0.9999)
    for forward in (torch.zeros(64, 2, dtype=torch.bool), torch.ones(64, 2, dtype=torch.bool)):
        out = augment._shift_inside(images, amounts, forward)
        assert torch.equal(out.sum((1, 2, 3)), images.sum((1, 2, 3)))  # no ink lost
        ink_rows = out[:, 0].sum(2) > 0
        edge = -1 if forward[0, 0] else 0
        assert ink_rows[:, edge].all()  # the largest shift brings the ink to the edge


def test_squish_resamples_to_a_narrower_digit():
    images = digits()
    table = augment._squish_matrices(28)  # [narrowing, extra offset]: each output column sums to 1
    columns = 28 - torch.arange(1, 8, dtype=torch.float64)[:, None].expand(7, 2)
    torch.testing.assert_close(table[1:].sum((2, 3)), columns)
    # the narrowest squish (w = 7): 21 columns placed from column 3 (or 4)
    out = augment._squish(images, torch.full((64,), 0.9999), torch.zeros(64))
    assert not out[..., :3].any() and not out[..., 24:].any()
    ink = images.sum((1, 2, 3))
    torch.testing.assert_close(out.sum((1, 2, 3)), ink * 21 / 28, rtol=0.05, atol=0)
    # Lanczos-3 without scaling is the identity
    torch.testing.assert_close(
        augment._lanczos3_resize_matrix(9, 9), torch.eye(9, dtype=torch.float64)
    )


def test_erase_zeroes_one_4x4_patch():
    images = torch.ones(2, 1, 28, 28)
    out = augment._erase(images, torch.tensor([[4, 22], [10, 5]]))
    assert (out == 0).sum((1, 2, 3)).tolist() == [16, 16]
    assert not out[0, 0, 4:8, 22:26].any() and not out[1, 0, 10:14, 5:9].any()


def test_augmentation_amounts_follow_the_official_generator(monkeypatch):
    """The amounts drawn for 4,000 images: half of them rotate, by whole degrees within 30; the
    squish narrows by 1..7 columns and moves by 0 or 1 more; the patch starts in 4..22."""
    seen = {}

    def spy(name):
        step = getattr(augment, name)

        def recorded(images, *amounts):
            seen[name] = amounts
            return step(images, *amounts)

        monkeypatch.setattr(augment, name, recorded)

    for name in ("_rotate", "_squish", "_erase"):
        spy(name)
    augment.efficient_capsnet(torch.rand(4000, 1, 28, 28), torch.Generator().manual_seed(0))
    degrees, rotate = seen["_rotate"]
    assert 0.47 < rotate.float().mean() < 0.53
    assert torch.equal(degrees, degrees.trunc()) and degrees.abs().max() == 29
    width, offset = seen["_squish"]
    narrowing = (width * 7 + 1).floor()
    assert narrowing.min() == 1 and narrowing.max() == 7
    assert 0.05 < (offset * 2).floor().mean() < 0.2  # |N(0, 0.33)| >= 0.5: 13%
    (corner,) = seen["_erase"]
    assert corner.min() == 4 and corner.max() == 22
