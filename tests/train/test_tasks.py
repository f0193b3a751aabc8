"""capsroute.train.tasks: the image task and the MultiMNIST pair task give the trainer the same things
(batches of images, labels and reconstruction targets, test batches, the network's test labels,
reconstruction metrics, figure inputs, run-record fields), each in its own way."""

import argparse
from pathlib import Path

import pytest
import torch

from capsroute._utils.command import CommandError
from capsroute.datasets import affine_mnist, mnist, multimnist
from capsroute.models import CNN, CapsNet
from capsroute.train import tasks

DATA = Path(__file__).resolve().parents[1] / "data" / "mnist-small"


@pytest.fixture(scope="module")
def splits():
    return {split: mnist.load_dataset("mnist", DATA, split) for split in mnist.SPLITS}


def options(dataset: str, **changes) -> argparse.Namespace:
    given = dict(train_subset=20, test_subset=10, pairs_per_digit=1, seed=0, val_split=None)
    return argparse.Namespace(dataset=dataset, data_dir=DATA, **{**given, **changes})


def epoch(task, augment):
    return list(task.training_batches(8, augment, generator=torch.Generator().manual_seed(0)))


def test_image_task(splits):
    task = tasks.ImageTask(options("mnist"), splits["train"], splits["test"])
    assert (task.train_size, task.test_size, task.samples) == (20, 10, "images")
    batches = epoch(task, augment=lambda images: images + 1)
    assert [len(labels) for _, labels, _ in batches] == [8, 8, 4]
    images, labels, targets = batches[0]
    assert targets is images and images.min() >= 1  # augmented; the targets are the images
    images, labels, targets = task.test_batch(torch.arange(3))
    assert images.shape == (3, 1, 28, 28) and 0 <= images.min() and images.max() <= 1
    assert targets is images and torch.equal(labels, splits["test"][1][:3])
    assert task.test_labels_for(labels) is None and task.run_info() == {}
    assert (
        task.squared_error(None, None, targets) == 0
        and task.reconstruction_metrics(None, 0, 3) == {}
    )
    assert torch.equal(task.figure_inputs()["images"], splits["test"][0][:10])


def test_validation_part(splits):
    """--val-split holds out the last training images: never in a training batch, scored as the
    test images are; mnist40 places them once, the same whatever --seed."""
    train_images, train_labels = splits["train"]
    task = tasks.ImageTask(options("mnist", val_split=5), splits["train"], splits["test"])
    assert (task.train_size, task.val_size, task.test_size) == (15, 5, 10)
    seen = torch.cat([labels for _, labels, _ in epoch(task, augment=lambda images: images)])
    assert torch.equal(seen.sort().values, train_labels[:15].sort().values)
    images, labels, targets = task.val_batch(torch.arange(5))
    assert torch.equal(images, train_images[15:20].float() / 255) and targets is images
    assert torch.equal(labels, train_labels[15:20]) and task.run_info() == {"val_images": 5}
    placed = [
        tasks.FortyTask(options("mnist40", val_split=5, seed=seed), splits["train"], splits["test"])
        for seed in (0, 1)
    ]
    assert torch.equal(placed[0].val_images, placed[1].val_images)
    assert placed[0].val_images.shape == (5, 1, 40, 40)
    # every digit whole on its canvas, and not all in the middle
    sums = train_images[15:20].flatten(1).sum(1)
    assert torch.equal(placed[0].val_images.flatten(1).sum(1), sums)
    assert not torch.equal(placed[0].val_images, affine_mnist.centred(train_images[15:20]))
    assert placed[0].run_info() == {"val_images": 5, "val_placement_seed": tasks.VAL_PLACEMENT_SEED}
    with pytest.raises(
        CommandError, match="--val-split 20: must leave training images; there are 20"
    ):
        tasks.ImageTask(options("mnist", val_split=20), splits["train"], splits["test"])


def test_pair_task(splits):
    task = tasks.PairTask(options("multimnist"), splits["train"], splits["test"])
    assert (task.train_size, task.test_size, task.samples) == (20, 10, "pairs")
    batches = epoch(task, augment=lambda images: pytest.fail("pairs come shifted already"))
    images, labels, targets = batches[0]
    assert (images.shape, labels.shape, targets.shape) == ((8, 1, 36, 36), (8, 2), (8, 2, 36, 36))
    images, labels, targets = task.test_batch(torch.arange(3))
    assert task.test_labels_for(labels) is labels
    assert task.run_info() == {
        "train_pairs": 20,
        "test_pairs": 10,
        "test_checksum": multimnist.checksum(task.test_pairs, count=10),
    }
    assert len(task.test_pairs) == len(splits["test"][1])  # second digits from the whole test split
    assert task.figure_inputs() == {"pairs": task.test_pairs}
    cnn = CNN(image_size=multimnist.SIZE, channels=(4, 4, 4), hidden=8)
    assert task.squared_error(cnn, cnn(images), targets) == 0
    assert task.reconstruction_metrics(cnn, 0, 3) == {}
    capsnet = CapsNet(
        image_size=multimnist.SIZE, conv_channels=8, primary_types=2, decoder=(16, 16)
    )
    error = task.squared_error(capsnet, capsnet(images, labels), targets)
    assert error > 0
    metrics = task.reconstruction_metrics(capsnet, error.item(), 3)
    assert metrics == {"test_recon_error": pytest.approx(error.item() / (2 * 3 * 36 * 36))}


def test_source_dataset():
    assert [tasks.source_dataset(d) for d in ("mnist", "fashion-mnist", "multimnist")] == [
        "mnist",
        "fashion-mnist",
        "mnist",
    ]
