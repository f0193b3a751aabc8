"""MultiMNIST (capsroute.datasets.multimnist): the pair generator, its losses and evaluation, and
`capsroute train --dataset multimnist` end to end on the committed MNIST subset."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from capsroute import losses, train
from capsroute.cli import main as cli_main
from capsroute.datasets import mnist, multimnist
from capsroute.datasets.multimnist import SHIFT, SIZE, MultiMNIST
from capsroute.models import CNN, CapsNet
from capsroute.train.args import resolve_run_dir
from capsroute.train.batching import pair_batches
from capsroute.train.distributed import Distributed
from capsroute.train.metrics import pair_correct
from helpers import SMALL_CAPSNET

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"
# checksum(test_pairs(mnist-small test split)): its 1000 test pairs. A change means the generator
# no longer draws the same pairs, which breaks the comparison of runs (see README: MultiMNIST).
SMALL_TEST_CHECKSUM = "337f96a65f70c4872aa82a58d54f711ad6534c48689963112fef44f989ab1614"
PAIR_BAR = 0.2


@pytest.fixture(scope="module")
def train_split():
    return mnist.load_dataset("mnist", DATA, "train")


@pytest.fixture(scope="module")
def pairs(train_split):
    return MultiMNIST(*train_split, pairs_per_digit=3, seed=5)


def crop(canvas: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    return canvas[SHIFT + dy : SHIFT + dy + 28, SHIFT + dx : SHIFT + dx + 28]


def test_a_pair_is_a_function_of_seed_and_index(train_split, pairs):
    index = np.array([7, 8999, 0, 4242, 7])
    a = pairs.pairs(index)
    again = MultiMNIST(*train_split, pairs_per_digit=3, seed=5).pairs(index[::-1].copy())
    for x, y in zip(a, again):
        assert torch.equal(x, y.flip(0))
    assert torch.equal(a.images[0], a.images[4])  # the same index twice
    # pairs_per_digit only sets how many indices there are, not what a pair is
    assert torch.equal(
        MultiMNIST(*train_split, pairs_per_digit=1, seed=5).pairs(index[[0, 2]]).images,
        a.images[[0, 2]],
    )
    other = MultiMNIST(*train_split, pairs_per_digit=3, seed=6).pairs(index)
    assert not torch.equal(other.images, a.images)


def test_shapes_and_composition(train_split, pairs):
    images, labels = train_split
    n = len(labels)
    assert len(pairs) == 3 * n
    index = np.arange(2 * n - 50, 2 * n + 50)
    pair = pairs.pairs(index)
    assert pair.images.shape == (100, 1, SIZE, SIZE) and pair.images.dtype == torch.uint8
    assert pair.digits.shape == (100, 2, SIZE, SIZE) and pair.labels.shape == (100, 2)
    assert pair.shifts.shape == (100, 2, 2) and pair.shifts.abs().max() <= SHIFT
    assert torch.equal(pair.images[:, 0], pair.digits.amax(1))  # overlaid: pixel-wise maximum
    for b, i in enumerate(index):
        (dy0, dx0), (dy1, dx1) = pair.shifts[b].tolist()
        # the first digit is training digit i mod n, moved by its shift, nothing cut off
        assert torch.equal(crop(pair.digits[b, 0], dy0, dx0), images[i % n, 0])
        assert pair.digits[b, 0].sum() == images[i % n].sum()
        assert pair.labels[b, 0] == labels[i % n]
        # the second is a training digit of its label
        second = crop(pair.digits[b, 1], dy1, dx1)
        candidates = images[labels == pair.labels[b, 1], 0]
        assert (candidates == second).flatten(1).all(1).any()


def test_the_two_classes_differ_and_partners_are_uniform(train_split, pairs):
    _, labels = train_split
    pair = pairs.pairs(np.arange(len(pairs)))
    assert (pair.labels[:, 0] != pair.labels[:, 1]).all()
    # The second digit is uniform over the digits of the other classes: given first class c, class
    # d != c comes up with probability count[d] / (n - count[c]).
    counts = torch.bincount(labels, minlength=10).double()
    for c in range(10):
        second = pair.labels[pair.labels[:, 0] == c, 1]
        expected = counts / (len(labels) - counts[c])
        expected[c] = 0
        observed = torch.bincount(second, minlength=10).double() / len(second)
        assert (observed - expected).abs().max() < 0.04, (c, observed, expected)


def test_shift_and_overlap_statistics(pairs):
    """Each digit moves by up to 4 pixels each way, every shift equally likely (Sabour et al.: "shifted
    up to 4 pixels in each direction"). The paper puts a digit in a 20x20 box and the two boxes'
    overlap at 80% on average; with independent uniform shifts the boxes share on average
    (1 - E|d| / 20)^2 = 0.726 of their area, d the difference of two shifts (E|d| = 80/27), and the
    digits' actual ink boxes about as much (0.73 of the smaller box on 10,000 pairs)."""
    pair = pairs.pairs(np.arange(9000))
    shifts = pair.shifts.flatten()
    frequency = torch.bincount(shifts + SHIFT, minlength=2 * SHIFT + 1).double() / len(shifts)
    assert len(frequency) == 9 and (frequency - 1 / 9).abs().max() < 0.01
    d = (pair.shifts[:, 0] - pair.shifts[:, 1]).abs().double()
    box_overlap = ((20 - d[:, 0]) * (20 - d[:, 1]) / 400).mean().item()
    assert box_overlap == pytest.approx((1 - 80 / 27 / 20) ** 2, abs=0.01)
    ink_overlap = multimnist.bounding_box_overlap(pair.digits)
    assert 0.65 < ink_overlap.mean().item() < 0.85
    assert ink_overlap.min() >= 0 and ink_overlap.max() <= 1


def test_batches_resume_and_shard(pairs):
    def epoch(**kwargs):
        generator = torch.Generator().manual_seed(3)
        return list(pair_batches(pairs, 1000, generator=generator, **kwargs))

    full = epoch()
    assert sum(len(labels) for _, labels, _ in full) == len(pairs)
    images, labels, digits = full[0]
    assert images.dtype == torch.float32 and 0 <= images.min() and images.max() <= 1
    assert digits.shape == (1000, 2, SIZE, SIZE)
    for a, b in zip(full[4:], epoch(skip=4)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    ranks = [epoch(rank=r, world_size=2) for r in range(2)]  # len(pairs) is even: no padding
    assert len(ranks[0]) == len(ranks[1]) == 5
    total = sum(images.sum() for images, _, _ in full)
    assert torch.isclose(sum(images.sum() for shard in ranks for images, _, _ in shard), total)


def test_fixed_test_set_checksum():
    test = multimnist.test_pairs(*mnist.load_dataset("mnist", DATA, "test"))
    assert len(test) == 1000
    assert multimnist.checksum(test) == SMALL_TEST_CHECKSUM
    assert multimnist.checksum(test, count=10) != SMALL_TEST_CHECKSUM


def test_bad_arguments_are_named(train_split):
    images, labels = train_split
    with pytest.raises(ValueError, match="pairs_per_digit"):
        MultiMNIST(images, labels, pairs_per_digit=1001)
    with pytest.raises(ValueError, match="uint8"):
        MultiMNIST(images.float(), labels)
    with pytest.raises(ValueError, match="two classes"):
        MultiMNIST(images[:5], torch.zeros(5, dtype=torch.long))
    with pytest.raises(IndexError, match="pair indices"):
        MultiMNIST(images, labels).pairs([len(labels)])


def test_pair_correct_by_hand():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.9, 0.1, 0.8, 0.0], [0.2, 0.1, 0.8, 0.9]])
    labels = torch.tensor([[1, 0], [0, 1], [3, 2]])  # order of the labels does not matter
    assert pair_correct(scores, labels).tolist() == [True, False, True]
    assert pair_correct(scores, torch.tensor([0, 2, 3])).tolist() == [True, False, True]


def test_two_label_losses_by_hand():
    lengths = torch.tensor([[0.95, 0.5, 0.05], [0.2, 0.8, 0.3]])
    labels = torch.tensor([[0, 1], [2, 0]])
    # row 0: present 0 (0.95) + (0.9 - 0.5)^2; absent class 2 below 0.1.
    # row 1: present (0.9 - 0.3)^2 + (0.9 - 0.2)^2; absent 0.5 * (0.8 - 0.1)^2.
    expected = (0.16 + 0.36 + 0.49 + 0.5 * 0.49) / 2
    torch.testing.assert_close(losses.margin_loss(lengths, labels), torch.tensor(expected))
    targets = torch.zeros(2, 2, 2, 2)
    targets[0, 1, 0, 0] = 1  # the second digit of the first pair: one pixel
    recon = torch.zeros(2, 2, 4)
    recon[0, 0, 0] = 1  # drawn where its own digit is not: error 1
    recon[1, 1, 3] = 0.5  # error 0.25
    # pair 0: 1 (digit 0) + 1 (digit 1 missing its pixel); pair 1: 0.25
    torch.testing.assert_close(
        losses.reconstruction_loss(recon, targets), torch.tensor(0.0005 * 2.25 / 2)
    )
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    torch.testing.assert_close(
        losses.sigmoid_loss(logits, torch.tensor([[0, 1]])),
        torch.tensor(3 * np.log(2.0)),
        check_dtype=False,
    )


def test_capsnet_reconstructs_each_label_from_its_own_capsule():
    model = CapsNet(image_size=SIZE, conv_channels=16, primary_types=4, decoder=(32, 64)).eval()
    images = torch.rand(3, 1, SIZE, SIZE)
    labels = torch.tensor([[1, 2], [0, 9], [5, 3]])
    with torch.no_grad():
        out = model(images, labels)
        assert out.reconstructions.shape == (3, 2, SIZE * SIZE)
        for k in range(2):
            torch.testing.assert_close(
                out.reconstructions[:, k], model.reconstruct(out.capsules, labels[:, k])
            )
        assert model(images).reconstructions.shape == (
            3,
            SIZE * SIZE,
        )  # no labels: the longest capsule
    assert CNN(image_size=SIZE)(images).logits.shape == (3, 10)


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        "--dataset",
        "multimnist",
        "--data-dir",
        str(DATA),
        "--out",
        str(out),
        "--no-progress",
        "--batch-size",
        "32",
        *extra,
    ]


def trainer(argv: list[str]) -> train.Trainer:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(argv)
    resolve_run_dir(args)
    args.out.mkdir(parents=True, exist_ok=True)
    return train.Trainer(args, Distributed(), torch.device("cpu"))


@pytest.mark.slow
def test_capsnet_learns_pairs(tmp_path, capsys):
    """A small CapsNet (1.4M parameters) trained on 3 pairs per digit of 3000 training digits (282
    steps of 32): on 500 fixed test pairs, pair accuracy (the two longest capsules are the two
    labels) goes from the untrained network's 0.02 (chance is 1/45) to 0.32, measured; the bar is
    PAIR_BAR. The figures come out of `capsroute plot`."""
    run = trainer(
        run_args(
            tmp_path,
            *SMALL_CAPSNET,
            "--train-subset",
            "3000",
            "--test-subset",
            "500",
            "--pairs-per-digit",
            "3",
            "--epochs",
            "1",
            "--lr",
            "3e-3",
            "--no-plots",
        )
    )
    untrained = run.evaluate()
    result = run.fit()
    assert untrained["test_accuracy"] < 0.05, untrained
    assert result["test_accuracy"] > PAIR_BAR, result
    assert (
        result["dataset"] == "multimnist"
        and result["train_pairs"] == 9000
        and result["test_pairs"] == 500
    )
    assert result["test_checksum"] == multimnist.checksum(run.task.test_pairs, count=500)
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert 0 < history[-1]["test_recon_error"] < untrained["test_recon_error"]
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].endswith(",test_recon_error")
    capsys.readouterr()
    assert cli_main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for name in ("curves.png", "pairs.png", "perturbations.png"):
        assert f"wrote {tmp_path / name}" in printed
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_multimnist_resume_is_bit_identical(tmp_path):
    """The CNN baseline this time: stopping at step 7 and resuming to step 12 gives the parameters
    of 12 steps straight (the pairs of a step depend on the seed and step alone)."""
    common = [
        "--model",
        "cnn",
        "--model-config",
        "channels=(8,8,8)",
        "hidden=32",
        "--train-subset",
        "100",
        "--test-subset",
        "50",
        "--epochs",
        "3",
        "--no-plots",
    ]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main(run_args(straight, *common, "--max-steps", "12")) == 0
    assert train.main(run_args(resumed, *common, "--max-steps", "7")) == 0
    assert train.main(["--resume", str(resumed), "--max-steps", "12", "--no-progress"]) == 0
    a, b = (torch.load(run / "checkpoint.pt", weights_only=False) for run in (straight, resumed))
    assert a["step"] == b["step"] == 12
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_matrixcapsnet_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="capsnet or cnn"):
        train.main(run_args(tmp_path, "--model", "matrixcapsnet"))
