"""affine-mnist: MNIST test digits under random affine transformations on a 40x40 canvas, generated
as a stand-in for affNIST (its published files: capsroute.datasets.affnist). Numbers measured on
this set are not affNIST's, nor the CapsNet paper's.

  AffineMNIST(images, labels, transforms_per_digit, seed)  the set, generated on demand
    .samples(index)                     -> AffineBatch: images uint8, labels, parameters, digits
    .float_samples(index)               -> (images float32 in [0, 1], labels)
  render(digits, params, size, origin)  draws 28x28 digits under given parameters (bilinear)
  checksum(dataset, count)              SHA256 of the first `count` samples' bytes
  centred(images)                       MNIST 28x28 -> 40x40, the digit in the middle (6 pixels around)
  pad_shifted(images, generator)        MNIST 28x28 -> 40x40 at a random place: the training data

What affNIST is (https://www.cs.toronto.edu/~tijmen/affNIST/, Tieleman 2013): each MNIST image
under "various reasonable affine transformations", 32 randomly chosen transformed versions of each
original, 40x40 pixels "with significant translations involved"; the test set transforms the
10,000 MNIST test digits; its untransformed version centres each digit "by adding an edge of 6
background pixels". Its list of the transformations' ranges, as this module takes them:

  rotation     at most 20 degrees either way              ROTATION_DEGREES
  shearing     at most 0.2 either way                     SHEAR
  scaling      0.8 to 1.2, vertically and horizontally    SCALE
  translation  random, the digit kept inside the canvas

Where these come from: the stored copy of the page that could be read when this was written held
only its opening (quoted above), so the list is the page's as remembered, not as read. A second
source agrees on two of them: TensorFlow Federated's infinite EMNIST, which says it follows the
affNIST distribution "approximately", draws rotations uniform within 20 degrees and shears within
0.2, but one log-uniform scale in 0.8..1.25 for both axes and translations of at most 5 pixels.
Check the ranges against the page before reading results on this set as affNIST-like.

The choices the page leaves open, as made here:

- Distribution: each parameter uniform in its range, independently; scale x and y apart.
- Composition, in pixel coordinates (x right, y down) about the centre of the 28x28 image:
  scale (x by scale_x, y by scale_y), then shear (x += shear * y), then rotation (counterclockwise
  as seen for positive degrees), then translation: the image's centre lands at the canvas centre
  plus (translate_x, translate_y) pixels.
- Translation: uniform, continuous, over every position that keeps the digit's ink footprint (each
  inked pixel's neighbourhood that bilinear sampling spreads it over) inside the canvas, so no ink
  is lost. Where a transformed digit is too big for the canvas, its parameters are drawn again
  (at most ATTEMPTS times), which would favour smaller transformations; on the MNIST test digits
  it never happens (the first draw fits for all 320,000 samples of seed 0: the widest transformed
  digit spans 36.6 pixels).
- Interpolation: bilinear, zeros outside the digit, rounded to uint8.

Sample i is a pure function of (seed, i): test digit i mod N under its (i // N)-th transformation
(the first N samples transform each digit once), its random numbers a counter-based hash of the
seed and index (multimnist.random_words), so any subset is generated directly, in any order.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .multimnist import DIGIT_SIZE, random_words

SIZE = 40  # the canvas, as affNIST's
PAD = (SIZE - DIGIT_SIZE) // 2  # 6: a centred digit's edge
TRANSFORMS_PER_DIGIT = 32  # affNIST's
ROTATION_DEGREES = 20.0
SHEAR = 0.2
SCALE = (0.8, 1.2)
ATTEMPTS = 8  # parameter draws per sample until one fits the canvas
DEFAULT_SEED = 0
# The columns of AffineBatch.params.
PARAMS = ("rotation", "shear", "scale_x", "scale_y", "translate_x", "translate_y")

_DIGIT_CENTRE = (DIGIT_SIZE - 1) / 2  # pixel centres are at whole coordinates
_CANVAS_CENTRE = (SIZE - 1) / 2


class AffineBatch(NamedTuple):
    images: Tensor  # (B, 1, 40, 40) uint8
    labels: Tensor  # (B,) int64: the digits' labels
    params: Tensor  # (B, 6) float64: the columns of PARAMS (degrees, factors, pixels)
    digits: Tensor  # (B,) int64: the index of each sample's original digit


def _uniform(words: np.ndarray, low: float, high: float) -> np.ndarray:
    """Uniform floats in [low, high) from uint64 words (their top 53 bits)."""
    return low + (high - low) * (words >> np.uint64(11)).astype(np.float64) * 2.0**-53


def linear_part(params: np.ndarray) -> np.ndarray:
    """(B, 2, 2): rotation @ shear @ scale of params (B, >= 4) in PARAMS' order, acting on (x, y)
    pixel offsets with y down (a positive angle turns the digit counterclockwise as seen)."""
    theta = np.deg2rad(params[:, 0])
    cos, sin = np.cos(theta), np.sin(theta)
    rotation = np.stack([np.stack([cos, sin], -1), np.stack([-sin, cos], -1)], -2)
    shear = np.zeros_like(rotation)
    shear[:, 0, 0] = shear[:, 1, 1] = 1
    shear[:, 0, 1] = params[:, 1]
    scale = np.zeros_like(rotation)
    scale[:, 0, 0], scale[:, 1, 1] = params[:, 2], params[:, 3]
    return rotation @ shear @ scale


def ink_boxes(digits: np.ndarray) -> np.ndarray:
    """(B, 4) float: (x0, y0, x1, y1) of the region around each digit's inked pixels where bilinear
    sampling reads ink (one pixel beyond the outermost ones), as offsets from the image's centre."""
    ink = digits > 0
    boxes = np.zeros((len(digits), 4))
    for k, axis in enumerate((1, 2)):  # columns (x) over rows, then rows (y)
        line = ink.any(axis)
        first = line.argmax(1)
        last = line.shape[1] - 1 - line[:, ::-1].argmax(1)
        boxes[:, k], boxes[:, k + 2] = first - 1, last + 1
    boxes -= _DIGIT_CENTRE
    boxes[~ink.any((1, 2))] = 0  # a blank image fits anywhere
    return boxes


def _extent(linear: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(B, 2, 2): the [min, max] along x and y of each box's corners under its linear part."""
    x0, y0, x1, y1 = boxes.T
    corners = np.stack([np.stack([x, y], -1) for x in (x0, x1) for y in (y0, y1)], 1)  # (B, 4, 2)
    moved = corners @ linear.transpose(0, 2, 1)
    return np.stack([moved.min(1), moved.max(1)], -1)


def draw_params(seed: int, index: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(B, 6) parameters of the samples `index` for digits with these ink boxes (ink_boxes): the
    first of ATTEMPTS draws whose transformed digit fits the canvas. Raises ValueError where none
    does."""
    words = random_words(seed, index, 6 * ATTEMPTS).reshape(len(index), ATTEMPTS, 6)
    draws = np.stack(
        [
            _uniform(words[..., 0], -ROTATION_DEGREES, ROTATION_DEGREES),
            _uniform(words[..., 1], -SHEAR, SHEAR),
            _uniform(words[..., 2], *SCALE),
            _uniform(words[..., 3], *SCALE),
        ],
        -1,
    )  # (B, ATTEMPTS, 4)
    flat = draws.reshape(-1, 4)
    extent = _extent(linear_part(flat), np.repeat(boxes, ATTEMPTS, 0))  # (B * A, 2, 2)
    # The footprint must lie within the canvas's pixels, -0.5 .. SIZE - 0.5 about its centre.
    low = -SIZE / 2 - extent[..., 0]
    high = SIZE / 2 - extent[..., 1]
    fits = (low <= high).all(-1).reshape(len(index), ATTEMPTS)
    if not fits.any(1).all():
        bad = index[~fits.any(1)][0]
        raise ValueError(f"affine-mnist: sample {bad}'s digit does not fit a {SIZE}x{SIZE} canvas")
    chosen = fits.argmax(1)
    rows = np.arange(len(index))
    at = rows * ATTEMPTS + chosen
    translate = _uniform(words[rows, chosen, 4:6], 0.0, 1.0) * (high[at] - low[at]) + low[at]
    return np.concatenate([draws[rows, chosen], translate], -1)


def render(digits: np.ndarray, params: np.ndarray, size: int = SIZE, origin: float = 0.0):
    """digits (B, 28, 28) uint8 under params (B, 6) (PARAMS) on zero canvases (B, size, size)
    uint8, by bilinear sampling of the inverse map. The canvas's pixel (row, col) sits at
    (col, row) - origin in the coordinates of the 40x40 canvas, so a larger canvas with origin > 0
    shows whatever would fall outside the 40x40 one."""
    inverse = np.linalg.inv(linear_part(params))  # (B, 2, 2)
    grid = np.arange(size, dtype=np.float64) - origin - _CANVAS_CENTRE
    x, y = np.meshgrid(grid, grid, indexing="xy")
    offsets = np.stack([x.ravel(), y.ravel()], -1)[None] - params[:, None, 4:6]  # (B, P, 2)
    source = offsets @ inverse.transpose(0, 2, 1) + _DIGIT_CENTRE
    floor = np.floor(source)
    frac = source - floor
    col, row = floor[..., 0].astype(np.int64), floor[..., 1].astype(np.int64)
    values = np.zeros(source.shape[:2])
    batch = np.arange(len(digits))[:, None]
    pixels = digits.astype(np.float64)
    for dr, dc in ((0, 0), (0, 1), (1, 0), (1, 1)):
        r, c = row + dr, col + dc
        inside = (r >= 0) & (r < DIGIT_SIZE) & (c >= 0) & (c < DIGIT_SIZE)
        weight = (frac[..., 1] if dr else 1 - frac[..., 1]) * (
            frac[..., 0] if dc else 1 - frac[..., 0]
        )
        read = pixels[batch, r.clip(0, DIGIT_SIZE - 1), c.clip(0, DIGIT_SIZE - 1)]
        values += np.where(inside, weight * read, 0.0)
    return np.rint(values).clip(0, 255).astype(np.uint8).reshape(-1, size, size)


class AffineMNIST:
    """affine-mnist of a split: images uint8 (N, [1,] 28, 28), labels (N,), each digit under
    transforms_per_digit random affine transformations (the module's docstring says which).

    len() = N * transforms_per_digit; sample i is digit i mod N under its (i // N)-th draw.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        transforms_per_digit: int = TRANSFORMS_PER_DIGIT,
        seed: int = DEFAULT_SEED,
    ):
        if images.dtype != torch.uint8 or images.shape[-2:] != (DIGIT_SIZE, DIGIT_SIZE):
            raise ValueError(
                f"AffineMNIST: images must be uint8 (N, [1,] 28, 28), got {images.dtype} "
                f"{tuple(images.shape)}"
            )
        if labels.dim() != 1 or len(labels) != len(images):
            raise ValueError(
                f"AffineMNIST: labels must be (N,) for {len(images)} images, got "
                f"{tuple(labels.shape)}"
            )
        if transforms_per_digit < 1:
            raise ValueError(
                f"AffineMNIST: transforms_per_digit must be >= 1, got {transforms_per_digit}"
            )
        self.digit_images = images.reshape(-1, DIGIT_SIZE, DIGIT_SIZE).numpy()
        self.digit_labels = labels.long()
        self.transforms_per_digit, self.seed = transforms_per_digit, seed
        self._boxes = ink_boxes(self.digit_images)

    def __len__(self) -> int:
        return len(self.digit_labels) * self.transforms_per_digit

    def samples(self, index: Tensor | np.ndarray) -> AffineBatch:
        """The samples with these indices (each in 0 .. len - 1)."""
        index = np.asarray(index, dtype=np.int64).reshape(-1)
        if len(index) and (index.min() < 0 or index.max() >= len(self)):
            raise IndexError(f"AffineMNIST: sample indices must be in 0..{len(self) - 1}")
        digit = index % len(self.digit_labels)
        params = draw_params(self.seed, index, self._boxes[digit])
        images = render(self.digit_images[digit], params)
        return AffineBatch(
            torch.from_numpy(images).unsqueeze(1),
            self.digit_labels[digit],
            torch.from_numpy(params),
            torch.from_numpy(digit),
        )

    def float_samples(self, index: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
        """(images, labels) as the networks take them: pixels float32 in [0, 1]."""
        batch = self.samples(index)
        return batch.images.float().div_(255), batch.labels


def checksum(dataset: AffineMNIST, count: int | None = None, chunk: int = 4096) -> str:
    """SHA256 of the first `count` (default all) samples' images, labels and parameters, in index
    order: equal checksums, the same samples."""
    count = len(dataset) if count is None else count
    h = hashlib.sha256()
    for start in range(0, count, chunk):
        batch = dataset.samples(np.arange(start, min(start + chunk, count)))
        for t in (batch.images, batch.labels, batch.params):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def place(images: Tensor, dy: Tensor, dx: Tensor) -> Tensor:
    """images (N, C, 28, 28) on zero canvases (N, C, 40, 40), image n's top-left pixel at row
    dy[n] and column dx[n] (each in 0 .. 12)."""
    n, c = images.shape[:2]
    offsets = torch.arange(DIGIT_SIZE, device=images.device)
    rows = (dy[:, None] + offsets)[:, None, :, None]  # (N, 1, 28, 1)
    cols = (dx[:, None] + offsets)[:, None, None, :]
    canvas = images.new_zeros(n, c, SIZE, SIZE)
    canvas[
        torch.arange(n, device=images.device)[:, None, None, None],
        torch.arange(c, device=images.device)[None, :, None, None],
        rows,
        cols,
    ] = images
    return canvas


def centred(images: Tensor) -> Tensor:
    """MNIST images (N, C, 28, 28) in the middle of 40x40 canvases: affNIST's untransformed
    version, and the 40x40 test set of `capsroute train --dataset mnist40`."""
    offset = torch.full((len(images),), PAD, dtype=torch.long, device=images.device)
    return place(images, offset, offset)


def pad_shifted(images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """MNIST images (N, C, 28, 28) each at a random place on a 40x40 canvas: the training data of
    Sabour et al. 2017, section 5 ("trained on MNIST digits placed randomly on a black background
    of 40x40 pixels"). The paper says neither how the place is drawn nor whether it changes
    between epochs; here the 28x28 image's corner is uniform over the 13 x 13 whole-pixel places
    that keep it inside (offsets 0 .. 12 in each axis), drawn afresh every time (the trainer
    seeds the generator by seed and step, so a resumed run draws the same places). The offsets
    are drawn on the CPU from `generator`, whatever the images' device."""
    dy, dx = torch.randint(0, SIZE - DIGIT_SIZE + 1, (2, len(images)), generator=generator)
    return place(images, dy.to(images.device), dx.to(images.device))


__all__ = [
    "ATTEMPTS",
    "AffineBatch",
    "AffineMNIST",
    "DEFAULT_SEED",
    "PAD",
    "PARAMS",
    "ROTATION_DEGREES",
    "SCALE",
    "SHEAR",
    "SIZE",
    "TRANSFORMS_PER_DIGIT",
    "centred",
    "checksum",
    "draw_params",
    "ink_boxes",
    "linear_part",
    "pad_shifted",
    "place",
    "render",
]
