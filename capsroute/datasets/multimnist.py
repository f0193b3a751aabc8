"""MultiMNIST (Sabour et al. 2017, section 6): pairs of overlapping MNIST digits of different classes.

Each digit is shifted by up to SHIFT = 4 pixels in each direction into a 36x36 canvas and
overlaid on a digit of a different class from the same split (pixel-wise maximum). The network
sees the composite image, is trained to find both labels and to reconstruct each digit
separately, so a pair carries its two labels and its two shifted digits as well.

  MultiMNIST(images, labels, pairs_per_digit, seed)  the pairs of one split, generated on demand
    .pairs(index)                          -> PairBatch of the pairs with these indices (uint8)
    .float_pairs(index)                    -> (images, labels, digits), pixels float32 in [0, 1]
  test_pairs(images, labels)               the fixed test set: one pair per test digit, seed TEST_SEED
  checksum(pairs)                          SHA256 of every pair's bytes, to compare test sets across runs
  bounding_box_overlap(digits)             overlap of the two digits' ink bounding boxes
  class_masks(labels, digits)              per-class segmentation masks: each digit's pixels under its class

A pair is a pure function of (seed, index): its random numbers come from a counter-based hash
(splitmix64) of the seed and the index, so any subset of pairs is generated directly, in any order,
vectorised over the batch, with nothing stored; an epoch resumes exactly from its step count.
Pair i takes digit i mod N as its first digit, so P pairs per digit (N * P pairs) use every digit
P times, and the second digit uniformly among the digits of the other classes.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

SHIFT = 4  # pixels, in each direction
DIGIT_SIZE = 28
SIZE = DIGIT_SIZE + 2 * SHIFT  # 36
MAX_PAIRS_PER_DIGIT = 1000  # the paper's training set: 1,000 pairs per training digit
TEST_SEED = 2017
# checksum(test_pairs(*load_dataset("mnist", ..., "test"))): the 10,000 test pairs of the full
# MNIST test files. A run records the checksum of its test set; equal checksums, same test pairs.
MNIST_TEST_CHECKSUM = "7c7fe914c6df948691d669370ddfc06a8b437d2522e6cc2b5c9cecd9e41ae439"

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a bijection of uint64 that mixes every input bit into every output bit."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def random_words(seed: int, index: np.ndarray, count: int) -> np.ndarray:
    """count independent uniform uint64 words per index, (len(index), count): a hash of (seed, index, word)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2**64 by design
        key = _splitmix64(
            np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) * _GOLDEN + _GOLDEN
        )
        counter = _splitmix64(key ^ (index.astype(np.uint64) * _GOLDEN))
        words = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN
        return _splitmix64(counter[:, None] + words[None, :])


class PairBatch(NamedTuple):
    images: Tensor  # (B, 1, 36, 36): the composite, pixel-wise max of the two digits
    labels: Tensor  # (B, 2) int64: the two classes, always different
    digits: Tensor  # (B, 2, 36, 36): each shifted digit alone, the reconstruction targets
    shifts: Tensor  # (B, 2, 2) int64: (dy, dx) of each digit, in [-SHIFT, SHIFT]


class MultiMNIST:
    """The MultiMNIST pairs of one split: images uint8 (N, 1, 28, 28) or (N, 28, 28), labels (N,).

    len() = N * pairs_per_digit. pairs(index) renders the given pairs (an epoch of them:
    capsroute.train.batching.pair_batches).
    """

    def __init__(self, images: Tensor, labels: Tensor, pairs_per_digit: int = 1, seed: int = 0):
        if images.dtype != torch.uint8 or images.shape[-2:] != (DIGIT_SIZE, DIGIT_SIZE):
            raise ValueError(
                f"MultiMNIST: images must be uint8 (N, [1,] 28, 28), got {images.dtype} "
                f"{tuple(images.shape)}"
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise ValueError(
                f"MultiMNIST: labels must be (N,) for {len(images)} images, got {tuple(labels.shape)}"
            )
        if not 1 <= pairs_per_digit <= MAX_PAIRS_PER_DIGIT:
            raise ValueError(
                f"MultiMNIST: pairs_per_digit must be in 1..{MAX_PAIRS_PER_DIGIT}, got {pairs_per_digit}"
            )
        self.digit_images = images.reshape(-1, DIGIT_SIZE, DIGIT_SIZE)
        self.digit_labels = labels.long()
        self.pairs_per_digit, self.seed = pairs_per_digit, seed
        counts = torch.bincount(self.digit_labels, minlength=10)
        if (counts > 0).sum() < 2:
            raise ValueError("MultiMNIST: the digits must span at least two classes")
        # The digits sorted by class: class c occupies positions start[c] .. start[c] + count[c] - 1.
        self._by_class = torch.argsort(self.digit_labels, stable=True).numpy()
        self._count = counts.numpy().astype(np.uint64)
        self._start = np.concatenate([[0], np.cumsum(self._count)[:-1]]).astype(np.uint64)

    def __len__(self) -> int:
        return len(self.digit_labels) * self.pairs_per_digit

    def pairs(self, index: Tensor | np.ndarray) -> PairBatch:
        """The pairs with these indices (each in 0 .. len - 1), rendered in uint8."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(index) and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"MultiMNIST: pair indices must be in 0..{len(self) - 1}")
        n = len(self.digit_labels)
        first = index % n
        words = random_words(self.seed, index, 2)
        # The second digit: uniform among the n - count[c] digits of other classes, by skipping
        # class c's block in the class-sorted order.
        cls = self.digit_labels.numpy()[first]
        r = words[:, 0] % (np.uint64(n) - self._count[cls])
        position = np.where(r < self._start[cls], r, r + self._count[cls]).astype(np.int64)
        second = self._by_class[position]
        # Four shifts in 0..8 from one word: its base-9 digits (bias of order 9**4 / 2**64).
        w = words[:, 1]
        shifts = np.stack([(w // np.uint64(9**k)) % np.uint64(9) for k in range(4)], 1).astype(
            np.int64
        )
        shifts = torch.from_numpy(shifts).view(-1, 2, 2) - SHIFT
        pair = torch.from_numpy(np.stack([first, second], 1))
        digits = _place(self.digit_images[pair], shifts)
        return PairBatch(digits.amax(1, keepdim=True), self.digit_labels[pair], digits, shifts)

    def float_pairs(self, index: Tensor | np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
        """(images, labels, digits) of these pairs as the networks take them: pixels float32 in [0, 1]."""
        pair = self.pairs(index)
        return pair.images.float().div_(255), pair.labels, pair.digits.float().div_(255)


def _place(digits: Tensor, shifts: Tensor) -> Tensor:
    """digits (B, 2, 28, 28) into zero canvases (B, 2, 36, 36), digit k of pair b at rows
    SHIFT + dy + 0..27 and columns SHIFT + dx + 0..27, (dy, dx) = shifts[b, k]: one scatter."""
    b, k = digits.shape[:2]
    offsets = torch.arange(DIGIT_SIZE)
    rows = (SHIFT + shifts[..., 0, None] + offsets)[..., :, None]  # (B, 2, 28, 1)
    cols = (SHIFT + shifts[..., 1, None] + offsets)[..., None, :]  # (B, 2, 1, 28)
    canvas = digits.new_zeros(b, k, SIZE, SIZE)
    canvas[
        torch.arange(b)[:, None, None, None], torch.arange(k)[None, :, None, None], rows, cols
    ] = digits
    return canvas


def test_pairs(images: Tensor, labels: Tensor) -> MultiMNIST:
    """The fixed MultiMNIST test set of a test split: one pair per test digit (10,000 pairs for
    MNIST: a CapsNet scores them in about 5 CPU-minutes), seed TEST_SEED."""
    return MultiMNIST(images, labels, pairs_per_digit=1, seed=TEST_SEED)


def checksum(pairs: MultiMNIST, count: int | None = None, chunk: int = 4096) -> str:
    """SHA256 of the first `count` (default all) pairs' composites, labels and digits (uint8 / int64
    bytes), in index order."""
    count = len(pairs) if count is None else count
    h = hashlib.sha256()
    for start in range(0, count, chunk):
        pair = pairs.pairs(np.arange(start, min(start + chunk, count)))
        for t in (pair.images, pair.labels, pair.digits):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def bounding_box_overlap(digits: Tensor) -> Tensor:
    """(B,) for digits (B, 2, H, W): the area shared by the two digits' ink bounding boxes over the
    area of the smaller box (1: one box inside the other, 0: disjoint)."""
    ink = digits > 0
    boxes = []
    for axis in (-1, -2):  # rows (any ink across columns), then columns
        line = ink.any(axis)
        first = line.float().argmax(-1)
        last = line.shape[-1] - 1 - line.flip(-1).float().argmax(-1)
        boxes.append((first, last))
    (top, bottom), (left, right) = boxes
    height = (
        torch.minimum(bottom[:, 0], bottom[:, 1]) - torch.maximum(top[:, 0], top[:, 1]) + 1
    ).clamp(min=0)
    width = (
        torch.minimum(right[:, 0], right[:, 1]) - torch.maximum(left[:, 0], left[:, 1]) + 1
    ).clamp(min=0)
    areas = (bottom - top + 1) * (right - left + 1)
    return (height * width).float() / areas.min(1).values.float()


# Segmentation masks (the multimnist-seg task): a digit's pixels are those of at least half
# intensity in its shifted image, 128..255 of uint8 (> 0.5 as float_pairs gives them).
MASK_THRESHOLD = 0.5


def class_masks(labels: Tensor, digits: Tensor, classes: int = 10) -> Tensor:
    """(B, classes, H, W) float masks of pairs (labels (B, 2), digits (B, 2, H, W) in [0, 1]):
    mask c is 1 on the pixels of the pair's digit of class c (digit > MASK_THRESHOLD), 0
    elsewhere and for the classes not in the pair. Where the two digits overlap a pixel is in
    both classes' masks, though the composite shows only the brighter digit there."""
    B, k, H, W = digits.shape
    masks = digits.new_zeros(B, classes, H, W)
    masks[torch.arange(B)[:, None], labels] = (digits > MASK_THRESHOLD).to(digits.dtype)
    return masks


__all__ = [
    "MASK_THRESHOLD",
    "MAX_PAIRS_PER_DIGIT",
    "MNIST_TEST_CHECKSUM",
    "MultiMNIST",
    "PairBatch",
    "SHIFT",
    "SIZE",
    "TEST_SEED",
    "bounding_box_overlap",
    "checksum",
    "class_masks",
    "random_words",
    "test_pairs",
]
