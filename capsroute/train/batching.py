"""An epoch's minibatches: shuffled, resumable (a pure function of the generator's state and the
batches already done) and sharded over ranks, of images and labels or of MultiMNIST pairs; and the
CapsNet paper's random shift.

  batch_indices(n, batch_size, ...)        shuffled, resumable, rank-sharded minibatch indices
  batches(images, labels, batch_size, ...) those minibatches of images and labels
  pair_batches(pairs, batch_size, ...)     those minibatches of MultiMNIST pairs
  num_batches(n, batch_size, ...)          how many batches `batches` yields per epoch and rank
  shift_augment(images, max_shift=2)       the CapsNet paper's random shift of up to 2 pixels
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import Tensor

from ..datasets.multimnist import MultiMNIST
from .augment import translate


def shift_augment(
    images: torch.Tensor, max_shift: int = 2, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Shifts each image by a random whole number of pixels, zero filling (Sabour et al. 2017).

    images: (N, C, H, W), any dtype and device. Each image gets its own shifts dy and dx, drawn
    independently and uniformly from [-max_shift, max_shift]; all its channels move together:
    out[n, :, i, j] = images[n, :, i - dy, j - dx], 0 where that falls outside the image. This is
    "pad by max_shift, then crop a random H x W window" (augment.translate). The shifts are drawn
    on the generator's device (CPU without one), so the result is a function of the generator's
    state whatever the images' device.
    """
    if images.dim() != 4:
        raise ValueError(
            f"shift_augment: images must be (N, C, H, W), got shape {tuple(images.shape)}"
        )
    if max_shift < 0:
        raise ValueError(f"shift_augment: max_shift must be >= 0, got {max_shift}")
    dy, dx = torch.randint(
        -max_shift,
        max_shift + 1,
        (2, len(images)),
        generator=generator,
        device=generator.device if generator is not None else "cpu",
    ).to(images.device)
    return translate(images, dy, dx)


def num_batches(n: int, batch_size: int, *, drop_last: bool = False, world_size: int = 1) -> int:
    """How many batches `batches` yields per rank for one epoch of n samples (before `skip`)."""
    per_rank = math.ceil(n / world_size)
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def batch_indices(
    n: int,
    batch_size: int,
    *,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    skip: int = 0,
) -> Iterator[torch.Tensor]:
    """The sample indices (int64, CPU) of each of this rank's minibatches of one epoch of n samples.

    The order is drawn when `batch_indices` is called (not lazily on first use): a random permutation
    from `generator` (a CPU torch.Generator) if shuffle, else 0..n-1. So the epoch is a pure
    function of the generator's state: seed a fresh generator per epoch (e.g. with seed + epoch)
    and training can resume mid-epoch by passing the same seed and skip = batches already done.

    Sharding as torch's DistributedSampler does: the order is padded by wrapping around to a
    multiple of world_size, and rank r takes every world_size-th sample from position r. Every
    rank thus gets the same number of samples (and batches); the shards are disjoint apart from
    the fewer than world_size padded repeats. drop_last drops this rank's last incomplete batch.
    """
    if batch_size < 1:
        raise ValueError(f"batches: batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"batches: need 0 <= rank < world_size, got rank {rank}, world_size {world_size}"
        )
    if skip < 0:
        raise ValueError(f"batches: skip must be >= 0, got {skip}")
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    if n:
        total = math.ceil(n / world_size) * world_size
        order = order.repeat(math.ceil(total / n))[:total]
    shard = order[rank::world_size]
    count = num_batches(n, batch_size, drop_last=drop_last, world_size=world_size)
    return (shard[b * batch_size : (b + 1) * batch_size] for b in range(skip, count))


def batches(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    *,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    skip: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of minibatches (images, labels) for this rank; uint8 images come out as float32 / 255.

    Order, sharding, drop_last and skip as `batch_indices` (the order is drawn at the call).
    Images and labels stay on their device; the index tensors follow them there.
    """
    n = len(images)
    if len(labels) != n:
        raise ValueError(f"batches: {n} images but {len(labels)} labels")
    indices = batch_indices(
        n,
        batch_size,
        shuffle=shuffle,
        generator=generator,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        skip=skip,
    )
    return (_batch(images, labels, index.to(images.device)) for index in indices)


def _batch(
    images: torch.Tensor, labels: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x = images[index]
    if x.dtype == torch.uint8:
        x = x.float().div_(255)
    return x, labels[index.to(labels.device)]


def pair_batches(
    pairs: MultiMNIST,
    batch_size: int,
    *,
    shuffle: bool = True,
    generator: torch.Generator | None = None,
    rank: int = 0,
    world_size: int = 1,
    skip: int = 0,
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """One epoch of (images float (B, 1, 36, 36), labels (B, 2), digits float (B, 2, 36, 36)),
    pixels in [0, 1]; order, sharding and skip exactly as `batches`."""
    for index in batch_indices(
        len(pairs),
        batch_size,
        shuffle=shuffle,
        generator=generator,
        rank=rank,
        world_size=world_size,
        skip=skip,
    ):
        yield pairs.float_pairs(index)
