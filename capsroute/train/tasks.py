"""What `capsroute train` learns, as one object the trainer asks for its samples and specifics:

  ImageTask   MNIST or Fashion-MNIST: an image, its label; the image is its reconstruction target
  FortyTask   mnist40: MNIST on a 40x40 canvas, placed at random in training, centred in test
  PairTask    MultiMNIST: two overlapping digits, both labels, each digit alone as its target
  SegmentationTask  MultiMNIST pairs with per-class pixel masks as targets (multimnist-seg)

Each gives the training batches (images, labels, reconstruction targets), the test batches (the
image tasks also those of a validation part held out of the training images, --val-split), the
network's labels at test time, the test metrics of their own, the figures' inputs and their fields
of the run record. `load_task(args)` reads and checks the data and builds the task of --dataset.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import Tensor

from .._utils.command import CommandError
from ..datasets import affine_mnist, mnist, multimnist
from ..models import DecoderCapsNet
from . import batching
from .metrics import pair_correct, pixel_correct, segmentation_metrics, segmentation_sums


class _Task:
    """What the trainer asks every task, as classification tasks answer it."""

    test_sums_length = 1  # values of test_sums
    val_size = 0  # training samples held out (--val-split)

    def correct(self, out, labels: Tensor, targets: Tensor) -> Tensor:
        """(N,): 1 for each sample the network got right (MultiMNIST: both labels), or the
        fraction of it (segmentation: of its pixels); the accuracy is their mean."""
        return pair_correct(out.scores, labels)

    def test_sums(self, model, out, targets: Tensor, labels: Tensor) -> Tensor:
        """(k,) float64 sums over a test batch that test_metrics turns into metrics."""
        return torch.as_tensor(
            self.squared_error(model, out, targets), dtype=torch.float64, device=labels.device
        ).reshape(1)

    def test_metrics(self, model, sums: list[float], seen: int) -> dict:
        return self.reconstruction_metrics(model, sums[0], seen)

    def squared_error(self, model, out, targets: Tensor) -> Tensor | float:
        """The reconstructions' summed squared error that the test scores (0: none scored)."""
        return 0.0

    def reconstruction_metrics(self, model, squared_error: float, seen: int) -> dict:
        return {}

    def result_metrics(self, last: dict) -> dict:
        """The last epoch's metrics that result.json adds to test_error and test_accuracy."""
        return {}


class ImageTask(_Task):
    """One image per sample: the first --train-subset / --test-subset images of the dataset, the
    last --val-split of those training images held out for validation."""

    samples = "images"
    source = None  # the dataset of --dataset itself

    def __init__(
        self, args: argparse.Namespace, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]
    ):
        images, labels = (t[: args.train_subset] for t in train)
        self.val_size = args.val_split or 0
        kept = len(labels) - self.val_size
        if kept < 1:
            raise CommandError(
                f"--val-split {self.val_size}: must leave training images; there are {len(labels)}"
            )
        self.train_images, self.train_labels = images[:kept], labels[:kept]
        self.val_images, self.val_labels = images[kept:], labels[kept:]
        self.test_images, self.test_labels = (t[: args.test_subset] for t in test)
        self.train_size, self.test_size = len(self.train_labels), len(self.test_labels)

    def training_batches(self, batch_size: int, augment, **shard):
        """This epoch's batches of this rank (batching.batches' shard arguments), augmented when
        taken."""
        for images, labels in batching.batches(
            self.train_images, self.train_labels, batch_size, **shard
        ):
            images = augment(images)
            yield images, labels, images

    def test_batch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        images = self.test_images[index].float().div_(255)
        return images, self.test_labels[index], images

    def val_batch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """test_batch's batch of the validation part."""
        images = self.val_images[index].float().div_(255)
        return images, self.val_labels[index], images

    def test_labels_for(self, labels: Tensor) -> Tensor | None:
        """What the network is given at test time: nothing (it reconstructs its longest capsule)."""
        return None

    def figure_inputs(self) -> dict:
        return self.figure_inputs_of(self.test_images, self.test_labels)

    @staticmethod
    def figure_inputs_of(test_images: Tensor, test_labels: Tensor) -> dict:
        """plot.plot_run's inputs from a test split."""
        return {"images": test_images[:64]}

    def run_info(self) -> dict:
        return {"val_images": self.val_size} if self.val_size else {}


# The seed of the validation digits' places on the 40x40 canvas, whatever --seed: every run of a
# comparison scores the same images.
VAL_PLACEMENT_SEED = 40


class FortyTask(ImageTask):
    """mnist40 (Sabour et al. 2017, section 5): the training digits placed at random on a 40x40
    canvas as each batch is taken (the trainer's augmentation, affine_mnist.pad_shifted), the
    test digits centred on it (affine_mnist.centred), the validation digits placed at random once
    (VAL_PLACEMENT_SEED). The 28x28 test digits stay at hand for the affine test sets made from
    them (`capsroute train --evaluate --eval-dataset`)."""

    source = "mnist"

    def __init__(
        self, args: argparse.Namespace, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]
    ):
        super().__init__(args, train, test)
        self.test_digits = self.test_images
        self.test_images = affine_mnist.centred(self.test_digits)
        if self.val_size:
            placement = torch.Generator().manual_seed(VAL_PLACEMENT_SEED)
            self.val_images = affine_mnist.pad_shifted(self.val_images, placement)

    def run_info(self) -> dict:
        info = super().run_info()
        return {**info, "val_placement_seed": VAL_PLACEMENT_SEED} if info else info

    def figure_inputs(self) -> dict:
        return {"images": self.test_images[:64]}

    @staticmethod
    def figure_inputs_of(test_images: Tensor, test_labels: Tensor) -> dict:
        return {"images": affine_mnist.centred(test_images[:64])}


class PairTask(_Task):
    """MultiMNIST pairs of MNIST digits (capsroute.datasets.multimnist): --pairs-per-digit training pairs per
    training digit and the fixed test pairs, the first --test-subset of them."""

    samples = "pairs"
    source = "mnist"

    def __init__(
        self, args: argparse.Namespace, train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor]
    ):
        train_images, train_labels = (t[: args.train_subset] for t in train)
        self.train_pairs = multimnist.MultiMNIST(
            train_images, train_labels, args.pairs_per_digit, seed=args.seed
        )
        # The test pairs take their second digits from the whole test split.
        self.test_pairs = multimnist.test_pairs(*test)
        self.train_size = len(self.train_pairs)
        self.test_size = min(len(self.test_pairs), args.test_subset or len(self.test_pairs))
        self.test_checksum = multimnist.checksum(self.test_pairs, count=self.test_size)
        if (
            len(self.test_pairs) == self.test_size == 10_000
            and self.test_checksum != multimnist.MNIST_TEST_CHECKSUM
        ):
            print(
                f"warning: these 10,000 test pairs are not the standard ones (checksum {self.test_checksum}, "
                f"expected {multimnist.MNIST_TEST_CHECKSUM}): are {args.data_dir}'s files MNIST's?",
                file=sys.stderr,
            )

    def training_batches(self, batch_size: int, augment, **shard):
        """This epoch's batches of this rank; the pairs come shifted (`augment` is for images)."""
        yield from batching.pair_batches(self.train_pairs, batch_size, **shard)

    def test_batch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.test_pairs.float_pairs(index)

    def test_labels_for(self, labels: Tensor) -> Tensor:
        """The labels: each digit is reconstructed from its label's capsule, as in training."""
        return labels

    def squared_error(self, model, out, targets: Tensor) -> Tensor | float:
        if not isinstance(model, DecoderCapsNet):
            return 0.0
        return (out.reconstructions.float() - targets.flatten(2)).square().sum()

    def reconstruction_metrics(self, model, squared_error: float, seen: int) -> dict:
        """test_recon_error (the networks with a decoder): the mean squared pixel error of each
        digit's reconstruction from its own label's capsule against the digit alone."""
        if not isinstance(model, DecoderCapsNet):
            return {}
        return {"test_recon_error": squared_error / max(2 * seen * multimnist.SIZE**2, 1)}

    def figure_inputs(self) -> dict:
        return {"pairs": self.test_pairs}

    @staticmethod
    def figure_inputs_of(test_images: Tensor, test_labels: Tensor) -> dict:
        return {"pairs": multimnist.test_pairs(test_images, test_labels)}

    def run_info(self) -> dict:
        """Equal checksums: the same test pairs (README: MultiMNIST)."""
        return {
            "train_pairs": self.train_size,
            "test_pairs": self.test_size,
            "test_checksum": self.test_checksum,
        }


class SegmentationTask(PairTask):
    """multimnist-seg: the MultiMNIST pairs of PairTask, the targets their per-class pixel masks
    (multimnist.class_masks, (N, 10, 36, 36)): which pixels belong to the digit of each class.
    Scored per pixel (right when its predicted classes are exactly its true ones), and by Dice
    and IoU per class over the test set (metrics.segmentation_metrics)."""

    test_sums_length = 7 + 3 * 10  # segmentation_sums of 10 classes

    def training_batches(self, batch_size: int, augment, **shard):
        for images, labels, digits in super().training_batches(batch_size, augment, **shard):
            yield images, labels, multimnist.class_masks(labels, digits)

    def test_batch(self, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        images, labels, digits = super().test_batch(index)
        return images, labels, multimnist.class_masks(labels, digits)

    def test_labels_for(self, labels: Tensor) -> None:
        return None

    def correct(self, out, labels: Tensor, targets: Tensor) -> Tensor:
        return pixel_correct(out.lengths, targets)

    def test_sums(self, model, out, targets: Tensor, labels: Tensor) -> Tensor:
        return segmentation_sums(out.lengths, targets)

    def test_metrics(self, model, sums: list[float], seen: int) -> dict:
        return segmentation_metrics(sums)

    def result_metrics(self, last: dict) -> dict:
        return {k: v for k, v in last.items() if k in segmentation_metrics([0.0] * 10)}


TASKS = {"mnist40": FortyTask, "multimnist": PairTask, "multimnist-seg": SegmentationTask}


def task_class(dataset: str) -> type[ImageTask] | type[PairTask]:
    """The task of a --dataset."""
    return TASKS.get(dataset, ImageTask)


def source_dataset(dataset: str) -> str:
    """The dataset whose IDX files a --dataset reads."""
    return task_class(dataset).source or dataset


def load_task(args: argparse.Namespace) -> tuple[ImageTask | PairTask, str | None]:
    """The task of --dataset on the files in --data-dir, checked (mnist.load_checked), and a warning
    where they are not the published files (None where they are). Raises CommandError for missing,
    damaged or wrong files and for too few digits to pair."""
    try:
        splits, warning = mnist.load_checked(source_dataset(args.dataset), args.data_dir)
    except (FileNotFoundError, mnist.WrongDatasetError) as e:
        raise CommandError(str(e)) from e
    except ValueError as e:  # a damaged file: the message names it
        raise CommandError(f"{e}; delete the file and fetch a good copy (--download)") from e
    try:
        return task_class(args.dataset)(args, splits["train"], splits["test"]), warning
    except ValueError as e:  # MultiMNIST pairs digits of two classes at least
        raise CommandError(
            f"--dataset {args.dataset} --train-subset {args.train_subset}: {e}"
        ) from e
