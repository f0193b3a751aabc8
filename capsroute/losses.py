"""Losses of the capsule papers, SegCaps' segmentation loss, and the sigmoid loss of the CNN
baseline.

Labels are (N,) for one object per image or (N, k) for k objects of different classes (MultiMNIST, k = 2).
"""

import torch.nn.functional as F
from torch import Tensor

# Efficient-CapsNet's weight of the mean squared pixel error (the official code's lmd_gen): on
# 28x28 images 0.392 / 784 = 0.0005 of the summed error, CapsNet's weight.
EFFICIENT_RECONSTRUCTION_WEIGHT = 0.392


def margin_loss(
    lengths: Tensor,
    labels: Tensor,
    m_pos: float = 0.9,
    m_neg: float = 0.1,
    down_weight: float = 0.5,
) -> Tensor:
    """Sabour et al. 2017, eq. 4: sum_k T_k max(0, m+ - |v_k|)^2 + lambda (1 - T_k) max(0, |v_k| - m-)^2,
    averaged over the batch. lengths (N, classes), labels (N,) or (N, k): T_k = 1 for every label."""
    target = present_classes(labels, lengths.shape[-1]).to(lengths.dtype)
    present = target * F.relu(m_pos - lengths) ** 2
    absent = down_weight * (1 - target) * F.relu(lengths - m_neg) ** 2
    return (present + absent).sum(-1).mean()


def reconstruction_loss(reconstructions: Tensor, images: Tensor, scale: float = 0.0005) -> Tensor:
    """Sum of squared pixel errors per image, scaled down (0.0005 in the paper) so it does not
    dominate the margin loss; averaged over the batch. reconstructions (N, [k,] pixels) against
    images (N, [k,] H, W): with k digits per image, each reconstruction against its own digit."""
    diff = reconstructions.float().flatten(1) - images.flatten(1).float()
    return scale * (diff * diff).sum(-1).mean()


def mean_reconstruction_loss(
    reconstructions: Tensor, images: Tensor, weight: float = EFFICIENT_RECONSTRUCTION_WEIGHT
) -> Tensor:
    """Efficient-CapsNet's reconstruction loss: `weight` times the mean squared pixel error over
    every pixel of the k digits (Keras' mse; the official MultiMNIST code weighs each of its two
    digits' errors by weight / 2), averaged over the batch. Shapes as reconstruction_loss."""
    return reconstruction_loss(reconstructions, images, scale=weight / reconstructions[0].numel())


def spread_loss(activations: Tensor, labels: Tensor, margin: float) -> Tensor:
    """Hinton et al. 2018: sum over wrong classes i of max(0, margin - (a_t - a_i))^2, averaged over the batch."""
    a_target = activations.gather(1, labels[:, None])
    gaps = F.relu(margin - (a_target - activations)) ** 2
    wrong = 1 - F.one_hot(labels, activations.shape[-1]).to(gaps.dtype)
    return (gaps * wrong).sum(-1).mean()


def spread_margin(step: int, ramp_steps: int, start: float = 0.2, end: float = 0.9) -> float:
    """The spread-loss margin schedule: linear from `start` to `end` over `ramp_steps`, then held."""
    if ramp_steps <= 0:
        return end
    return start + (end - start) * min(1.0, step / ramp_steps)


def present_classes(labels: Tensor, classes: int) -> Tensor:
    """(N, classes) int64, 1 for the classes in labels (N,) or (N, k), 0 elsewhere."""
    target = F.one_hot(labels, classes)
    return target.amax(1) if labels.dim() == 2 else target


def sigmoid_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Binary cross-entropy of one sigmoid per class against "present" (labels (N,) or (N, k)),
    summed over the classes, averaged over the batch: the multi-label loss of the CNN baseline."""
    target = present_classes(labels, logits.shape[-1]).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1).mean()


def segmentation_loss(lengths: Tensor, masks: Tensor, smooth: float = 1.0) -> Tensor:
    """Binary cross-entropy of every (pixel, class) length against the mask, averaged, plus one
    minus the soft Dice coefficient of each class over the batch, averaged over the classes
    (SegCaps' "bce_dice"; the Dice term keeps the rare foreground pixels from being ignored).
    lengths and masks (N, classes, H, W), lengths in [0, 1)."""
    p = lengths.float().clamp(1e-6, 1 - 1e-6)
    m = masks.float()
    bce = -(m * p.log() + (1 - m) * (1 - p).log()).mean()
    overlap = (p * m).sum((0, 2, 3))
    dice = (2 * overlap + smooth) / (p.sum((0, 2, 3)) + m.sum((0, 2, 3)) + smooth)
    return bce + (1 - dice.mean())


__all__ = [
    "EFFICIENT_RECONSTRUCTION_WEIGHT",
    "margin_loss",
    "mean_reconstruction_loss",
    "present_classes",
    "reconstruction_loss",
    "sigmoid_loss",
    "spread_loss",
    "spread_margin",
    "segmentation_loss",
]
