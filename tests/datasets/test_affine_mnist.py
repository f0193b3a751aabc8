"""affine-mnist (capsroute.datasets.affine_mnist): the generated affine test set is a function of
its seed, stays in its stated ranges, keeps every digit's ink inside the canvas and its label;
and the 40x40 MNIST of `--dataset mnist40` (centred, and placed at random for training)."""

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from capsroute.datasets import affine_mnist as am, mnist
from capsroute.datasets.affine_mnist import AffineMNIST

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"
# checksum(AffineMNIST(mnist-small test split), 500): a change means the generator no longer
# draws the same samples, so records made before and after it score different sets.
SMALL_CHECKSUM = "e85bf0e222cd104c51866e877cc51b9d742e8ffdc3f75d37be78191ea67c6589"


@pytest.fixture(scope="module")
def test_split():
    return mnist.load_dataset("mnist", DATA, "test")


@pytest.fixture(scope="module")
def dataset(test_split):
    return AffineMNIST(*test_split, seed=3)


def test_a_sample_is_a_function_of_seed_and_index(test_split, dataset):
    index = np.array([5, 31999, 0, 1005, 5])
    a = dataset.samples(index)
    again = AffineMNIST(*test_split, seed=3).samples(index[::-1].copy())
    for x, y in zip(a, again):
        assert torch.equal(x, y.flip(0))
    assert torch.equal(a.images[0], a.images[4])
    # transforms_per_digit only sets how many indices there are, not what a sample is
    fewer = AffineMNIST(*test_split, transforms_per_digit=2, seed=3).samples(index[[0, 2, 3]])
    assert torch.equal(fewer.images, a.images[[0, 2, 3]])
    other = AffineMNIST(*test_split, seed=4).samples(index)
    assert not torch.equal(other.images, a.images)
    assert not torch.equal(other.params, a.params)


def test_the_checksum_of_the_small_set_is_fixed(dataset, test_split):
    assert len(dataset) == 32 * len(test_split[1])
    assert am.checksum(AffineMNIST(*test_split), 500) == SMALL_CHECKSUM


def test_every_transformation_is_within_the_stated_ranges(dataset):
    index = np.arange(len(dataset))  # all 32,000, parameters only
    params = am.draw_params(dataset.seed, index, dataset._boxes[index % 1000])
    rotation, shear, sx, sy, tx, ty = params.T
    assert np.abs(rotation).max() <= am.ROTATION_DEGREES
    assert np.abs(shear).max() <= am.SHEAR
    for scale in (sx, sy):
        assert am.SCALE[0] <= scale.min() and scale.max() <= am.SCALE[1]
    # uniform: every range is covered to its ends, and not only the middle
    assert np.abs(rotation).max() > 19.9 and np.abs(shear).max() > 0.199
    assert np.histogram(rotation, 4, (-20, 20))[0].min() > 0.2 * len(index)
    # translation: "significant", every direction
    assert tx.min() < -10 and tx.max() > 10 and ty.min() < -10 and ty.max() > 10
    assert np.abs(np.corrcoef(sx, sy)[0, 1]) < 0.05  # scale x and y drawn apart


def test_every_digit_stays_inside_the_canvas(dataset):
    index = np.arange(0, len(dataset), 37)
    batch = dataset.samples(index)
    digits = dataset.digit_images[batch.digits.numpy()]
    # The same transformation on a canvas 20 pixels wider on every side: nothing falls outside
    # the 40x40 window, and inside it the same pixels.
    big = am.render(digits, batch.params.numpy(), size=80, origin=20)
    window = big[:, 20:60, 20:60]
    assert np.array_equal(window, batch.images[:, 0].numpy())
    assert big.astype(np.int64).sum() == window.astype(np.int64).sum()
    # and the ink is there: its mass scales with the area, det of the linear part
    area = np.abs(np.linalg.det(am.linear_part(batch.params.numpy())))
    ratio = window.reshape(len(index), -1).sum(1) / digits.reshape(len(index), -1).sum(1)
    assert np.allclose(ratio, area, rtol=0.1)


def test_labels_and_digits_are_kept(dataset, test_split):
    images, labels = test_split
    index = np.array([0, 999, 1000, 31999, 4321])
    batch = dataset.samples(index)
    assert batch.digits.tolist() == [0, 999, 0, 999, 321]
    assert torch.equal(batch.labels, labels[batch.digits])
    # Identity parameters draw the centred digit; a whole-pixel translation moves it.
    identity = np.array([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, -6.0, 5.0]])
    drawn = am.render(images[:2, 0].numpy(), identity)
    assert np.array_equal(drawn[0], am.centred(images[:1])[0, 0].numpy())
    dy, dx = torch.tensor([11]), torch.tensor([0])
    assert np.array_equal(drawn[1], am.place(images[1:2], dy, dx)[0, 0].numpy())
    floats, float_labels = dataset.float_samples(index)
    assert floats.dtype == torch.float32 and floats.shape == (5, 1, 40, 40)
    assert torch.equal(floats, batch.images.float() / 255) and torch.equal(
        float_labels, batch.labels
    )


def test_the_forty_pixel_mnist(test_split):
    images = test_split[0][:50]
    assert torch.equal(am.centred(images), F.pad(images, (6, 6, 6, 6)))
    shifted = am.pad_shifted(images, torch.Generator().manual_seed(1))
    assert shifted.shape == (50, 1, 40, 40) and shifted.dtype == torch.uint8
    places = set()
    for image, canvas in zip(images, shifted):
        found = [
            (dy, dx)
            for dy in range(13)
            for dx in range(13)
            if torch.equal(canvas[:, dy : dy + 28, dx : dx + 28], image)
            and canvas.sum() == image.sum()
        ]
        assert found
        places.update(found)
    assert len(places) > 25  # spread over the canvas, not a handful of places
    again = am.pad_shifted(images, torch.Generator().manual_seed(1))
    assert torch.equal(again, shifted)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda x, y: AffineMNIST(x.float(), y), "images must be uint8"),
        (lambda x, y: AffineMNIST(x, y[:-1]), "labels must be (N,)"),
        (lambda x, y: AffineMNIST(x, y, transforms_per_digit=0), "must be >= 1"),
        (lambda x, y: AffineMNIST(x, y).samples([32000]), "must be in 0..31999"),
        (lambda x, y: AffineMNIST(x, y).samples([-1]), "must be in 0..31999"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(test_split, call, message):
    with pytest.raises((ValueError, IndexError)) as e:
        call(*test_split)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_digit_too_big_for_the_canvas_is_refused():
    # ink 50 pixels across: no draw of the ranges fits it in 40 (a 28x28 image has at most 30)
    boxes = np.array([[-25.0, -25.0, 25.0, 25.0]])
    with pytest.raises(ValueError, match="sample 7's digit does not fit a 40x40 canvas"):
        am.draw_params(0, np.array([7]), boxes)


def test_the_samples_figure(dataset, tmp_path):
    from capsroute.train.plot import plot_affine_samples

    fig = plot_affine_samples(dataset, tmp_path / "samples.png", digits=3, versions=4)
    assert (tmp_path / "samples.png").stat().st_size > 1000
    assert len(fig.axes) == 3 * 5
    assert fig.axes[0].get_title() == f"label {dataset.digit_labels[0].item()}"
