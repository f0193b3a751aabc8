"""What training minimises and what it scores: each model's objective from its output, and the
accuracy of classes, MultiMNIST pairs and segmentation masks."""

from __future__ import annotations

import torch
from torch import Tensor

from ..losses import (
    margin_loss,
    mean_reconstruction_loss,
    reconstruction_loss,
    segmentation_loss,
    sigmoid_loss,
    spread_loss,
)
from ..models import (
    CapsNetOutput,
    CNNOutput,
    EfficientCapsNetOutput,
    MatrixCapsNetOutput,
    SegCapsNetOutput,
)


def training_loss(out, images: Tensor, labels: Tensor, margin: float = 0.2) -> Tensor:
    """The objective of each model of capsroute.models, from its output: CapsNet, margin loss plus
    the scaled reconstruction loss (images: the reconstruction targets, (N, k, H, W) for k
    objects); EfficientCapsNet, margin loss plus mean_reconstruction_loss; MatrixCapsNet, spread
    loss with `margin` (see spread_margin); CNN, sigmoid loss; SegCapsNet,
    capsroute.losses.segmentation_loss against the masks (images)."""
    if isinstance(out, EfficientCapsNetOutput):
        return margin_loss(out.lengths.float(), labels) + mean_reconstruction_loss(
            out.reconstructions, images
        )
    if isinstance(out, CapsNetOutput):
        return margin_loss(out.lengths.float(), labels) + reconstruction_loss(
            out.reconstructions, images
        )
    if isinstance(out, MatrixCapsNetOutput):
        return spread_loss(out.activations.float(), labels, margin)
    if isinstance(out, CNNOutput):
        return sigmoid_loss(out.logits.float(), labels)
    if isinstance(out, SegCapsNetOutput):  # images: the masks (N, classes, H, W)
        return segmentation_loss(out.lengths, images)
    raise TypeError(f"no training loss for {type(out).__name__}")


def pair_correct(scores: Tensor, labels: Tensor) -> Tensor:
    """(N,) bool: the k highest scores are exactly the k labels, labels (N, k) of distinct classes,
    or (N,) for one label (then: the highest score is the label)."""
    if labels.dim() == 1:
        return scores.argmax(-1) == labels
    top = scores.topk(labels.shape[1], dim=-1).indices
    return (top.sort(-1).values == labels.sort(-1).values).all(-1)


def pixel_correct(lengths: Tensor, masks: Tensor, threshold: float = 0.5) -> Tensor:
    """(N,): each image's fraction of pixels whose predicted classes (length > threshold) are
    exactly its true classes (none: background)."""
    right = ((lengths > threshold) == (masks > 0.5)).all(1)
    return right.flatten(1).float().mean(1)


def segmentation_sums(lengths: Tensor, masks: Tensor, threshold: float = 0.5) -> Tensor:
    """What segmentation_metrics needs from a batch, to be summed over the test set (float64):
    pixels, right pixels, ink pixels (in some class), right ink pixels, then per class the true
    positives, false positives and false negatives (3 * classes values), then those of the
    foreground (any class)."""
    predicted, true = lengths > threshold, masks > 0.5
    right = (predicted == true).all(1)
    ink = true.any(1)

    def counts(p, t, dims):
        return [(p & t).sum(dims), (p & ~t).sum(dims), (~p & t).sum(dims)]

    fg = counts(predicted.any(1), ink, (0, 1, 2))
    values = [
        torch.tensor(float(right.numel()), device=lengths.device),
        right.sum(),
        ink.sum(),
        (right & ink).sum(),
        *counts(predicted, true, (0, 2, 3)),
        *fg,
    ]
    return torch.cat([v.double().reshape(-1) for v in values])


def segmentation_metrics(sums, prefix: str = "test_") -> dict:
    """From segmentation_sums summed over a set: pixel_accuracy (every class right), ink_accuracy
    (the same over the pixels of some class), dice and iou (per class over the whole set, averaged
    over the classes that occur or are predicted), foreground_dice (any class against any class)."""
    sums = torch.as_tensor(sums, dtype=torch.float64)
    pixels, right, ink, ink_right = sums[:4].tolist()
    classes = (len(sums) - 7) // 3
    tp, fp, fn = sums[4 : 4 + 3 * classes].view(3, classes)
    seen = (tp + fp + fn) > 0
    dice = (2 * tp / (2 * tp + fp + fn).clamp(min=1))[seen]
    iou = (tp / (tp + fp + fn).clamp(min=1))[seen]
    fg_tp, fg_fp, fg_fn = sums[-3:].tolist()
    return {
        f"{prefix}pixel_accuracy": right / max(pixels, 1),
        f"{prefix}ink_accuracy": ink_right / max(ink, 1),
        f"{prefix}dice": dice.mean().item() if len(dice) else 1.0,
        f"{prefix}iou": iou.mean().item() if len(iou) else 1.0,
        f"{prefix}foreground_dice": 2 * fg_tp / max(2 * fg_tp + fg_fp + fg_fn, 1),
    }
