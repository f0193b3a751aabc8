"""Segmentation capsules (SegCaps, LaLonde and Bagci 2018) on the fused convolutional routing op.

  DeconvCapsules   the up-sampling ("deconvolutional") capsule layer: transposed-convolution votes
                   routed by agreement at every output position, on capsroute.conv_dynamic_routing
  SegCapsNet       a small SegCaps-style U-Net of capsules: conv stem, primary capsules, a down path
                   of stride-2 ConvDynamicCapsules, an up path of DeconvCapsules with skip
                   connections, and segmentation capsules whose lengths are per-pixel probabilities
  segmentation_loss  binary cross-entropy of the lengths plus a soft Dice term
  segmentation_sums / segmentation_metrics  per-pixel accuracy, Dice and IoU over a test set

ConvDynamicCapsules (capsroute.nn) is SegCaps' locally-constrained routing; this module adds the
layer that goes back up and the network that uses both.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn import ConvDynamicCapsules, _CapsuleLayer

Upsampling = Literal["transpose", "nearest"]


class DeconvCapsules(_CapsuleLayer):
    """The up-sampling capsule layer of SegCaps ("deconvolutional capsules"): each input capsule
    type votes for every output type through a K x K transposed convolution of its capsules (one
    transform shared over the input types, as SegCaps has it), and the C_in votes at each output
    position are routed by `iters` iterations of dynamic routing (softmax over the output types).

        u_hat[y, x, c, o] = sum over (i, j, ky, kx) with y = i s + ky - p, x = j s + kx - p of
                            W[ky, kx, o] u[i, j, c]
        v[y, x, o] = squash(sum_c c_co u_hat[y, x, c, o] + bias_o)

    How: a transposed convolution of stride s is a stride-1 convolution of the input with s - 1
    zero capsules inserted between neighbours and K - 1 - p zero capsules around it (the kernel
    flipped, which a learned kernel absorbs). The layer builds that zero-inserted grid, (B, (H - 1)
    s + 1 + 2 (K - 1 - p) + output_padding, ..., C_in, Din), and hands it to
    capsroute.conv_dynamic_routing with stride 1 and no padding. A zero capsule adds nothing to
    a vote, and every position still routes exactly C_in children (child type c's vote sums its
    window, zeros included), so the result is exactly SegCaps' transposed-convolution votes routed
    by SegCaps' update_routing: the same function, not an approximation.

    Why not the two alternatives:
    - Materialising the votes with conv_transpose2d and routing them with
      capsroute.dynamic_routing: the same function, but the votes tensor (B, H', W', C_in, C_out,
      D) is stored for the backward pass, C_out * D / Din times the zero-inserted grid (8x in
      SegCaps' first up layer, 8 types of 32D in and out; 2x in SegCapsNet's default layers). On
      the fused op the votes are computed a chunk of positions at a time and never stored; what is
      kept is the zero-inserted grid, s^2 times the input (4x at stride 2). Measured at SegCaps' first up
      layer (32 x 32 -> 64 x 64, 8 types of 32D in and out, K = 4, forward and backward, one CPU
      thread): 44 MiB of peak memory per image against 101 MiB, in three quarters of the time.
    - upsampling="nearest" (SegCaps' "resize"): each child capsule copied into an s x s block,
      then the same routing with "same" padding. A different function: every output phase sees
      tied sums of one kernel's taps (a transposed convolution with constrained weights), no
      checkerboard pattern from the zeros (Odena et al. 2016), and no multiply-adds spent on zero
      capsules (with "transpose", 1 - 1/s^2 of the window taps are zeros: 3/4 at stride 2; the
      kernel does them all). Offered for users of SegCaps' resize option.

    Args:
        in_types: C_in, the capsule types per input position.
        in_dim: Din, values per input capsule.
        out_types: C_out, the capsule types per output position.
        out_dim: D, values per output capsule.
        kernel_size: K (SegCaps: 4 for "transpose", 5 for "nearest").
        stride: s, the up-sampling factor (SegCaps' scaling, 2).
        padding: p of the transposed convolution; "same" gives an output of s H (K - s even:
            p = (K - s) / 2; else output_padding adds the missing row and column).
        output_padding: zero rows and columns added at the bottom and right ("transpose") to reach
            an odd output size, as conv_transpose2d's.
        iters: routing iterations (>= 1).
        upsampling: "transpose" (the default, SegCaps' "deconv") or "nearest" (SegCaps' "resize").
        share_weights: one transform for every input type (SegCaps'); else one per input type.
        bias: learn a bias (C_out, D) added before the squash.
        backend: "fused" (capsroute.conv_dynamic_routing: the votes never stored) or "reference"
            (plain PyTorch, every vote materialised).

    Parameters: weight (K, K, C_in or 1, C_out, D, Din), N(0, s^2 / (K K Din)) ("transpose": a
    window holds about K K / s^2 real children); bias (C_out, D), zeros, or None.

    Shapes: u (N, H, W, C_in, Din) -> v (N, H', W', C_out, D): "transpose", H' = (H - 1) s - 2 p +
    K + output_padding; "nearest", H' = s H (W' likewise).
    """

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        kernel_size: int = 4,
        stride: int = 2,
        padding: int | Literal["same"] = "same",
        output_padding: int = 0,
        iters: int = 3,
        *,
        upsampling: Upsampling = "transpose",
        share_weights: bool = True,
        bias: bool = True,
        backend: str = "fused",
    ):
        super().__init__(backend)
        if upsampling not in ("transpose", "nearest"):
            raise ValueError(f"upsampling must be 'transpose' or 'nearest', got {upsampling!r}")
        if stride < 1 or kernel_size < 1:
            raise ValueError(f"stride and kernel_size must be >= 1, got {stride}, {kernel_size}")
        if padding == "same":
            # H' = s H: 2 p - output_padding = K - s
            padding = max((kernel_size - stride + 1) // 2, 0)
            output_padding = 2 * padding - (kernel_size - stride)
        if not isinstance(padding, int) or not 0 <= padding <= kernel_size - 1:
            raise ValueError(f"padding must be in 0..kernel_size - 1 or 'same', got {padding!r}")
        if not 0 <= output_padding < stride:
            raise ValueError(f"output_padding must be in 0..stride - 1, got {output_padding}")
        self.conv = ConvDynamicCapsules(
            in_types,
            in_dim,
            out_types,
            out_dim,
            kernel_size,
            stride=1,
            padding=0,
            iters=iters,
            share_weights=share_weights,
            bias=bias,
            backend=backend,
        )
        with torch.no_grad():
            self.conv.weight.mul_(stride if upsampling == "transpose" else 1)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.upsampling = upsampling

    @_CapsuleLayer.backend.setter
    def backend(self, value: str):
        _CapsuleLayer.backend.fset(self, value)
        if "conv" in self._modules:
            self.conv.backend = value

    @property
    def weight(self) -> Tensor:
        return self.conv.weight

    @property
    def bias(self) -> Tensor | None:
        return self.conv.bias

    def upsampled(self, u: Tensor) -> Tensor:
        """The grid the stride-1 routing reads: u with zeros inserted and padded ("transpose"),
        or each capsule repeated s x s times and padded "same" ("nearest")."""
        N, H, W, C, Din = u.shape
        s, K = self.stride, self.conv.weight.shape[0]
        if self.upsampling == "nearest":
            up = u.repeat_interleave(s, 1).repeat_interleave(s, 2)
            lo = (K - 1) // 2
            return F.pad(up, (0, 0, 0, 0, lo, K - 1 - lo, lo, K - 1 - lo))
        edge = K - 1 - self.padding
        side_h, side_w = (H - 1) * s + 1, (W - 1) * s + 1
        grid = u.new_zeros(
            N,
            side_h + 2 * edge + self.output_padding,
            side_w + 2 * edge + self.output_padding,
            C,
            Din,
        )
        grid[:, edge : edge + side_h : s, edge : edge + side_w : s] = u
        return grid

    def forward(self, u: Tensor) -> Tensor:
        if u.dim() != 5 or u.shape[3] != self.conv.in_types:
            raise ValueError(
                f"DeconvCapsules: u must be (N, H, W, {self.conv.in_types}, Din), got {tuple(u.shape)}"
            )
        return self.conv(self.upsampled(u))

    def extra_repr(self) -> str:
        K, _, types, C_out, D, Din = self.conv.weight.shape
        return (
            f"{self.conv.in_types}x{Din}D -> {C_out}x{D}D, kernel_size={K}, stride={self.stride}, "
            f"padding={self.padding}, output_padding={self.output_padding}, "
            f"upsampling={self.upsampling!r}, iters={self.conv.iters}, {super().extra_repr()}"
        )


class SegCapsNetOutput(NamedTuple):
    lengths: Tensor  # (N, classes, H, W): the probability that each pixel belongs to each class
    capsules: Tensor  # (N, H, W, classes, D): the segmentation capsules

    @property
    def scores(self) -> Tensor:
        return self.lengths


class SegCapsNet(nn.Module):
    """A small SegCaps (LaLonde and Bagci 2018, SegCaps R3) for square images: a U-Net whose layers
    are convolutional capsules routed by agreement (ConvDynamicCapsules, DeconvCapsules).

        conv stem S@5x5 (ReLU), read as 1 capsule type of S values per pixel          H x H
        primary capsules: 2 types x S, 5x5, stride 2, 1 routing iteration            H/2
        down: 4 x D2 (5x5) -> skip;  4 x D3 (5x5, stride 2);  8 x D3 (5x5)           H/2, H/4
        up: DeconvCapsules 4 x D2 (4x4, x2), with the skip: 8 x D2 -> 4 x D2 (5x5)   H/2
            DeconvCapsules 2 x S (4x4, x2), with the stem's capsules: 3 x S           H
        segmentation capsules: `classes` types of seg_dim values (1x1)                H

    Skip connections concatenate capsule types, as SegCaps does. The length of segmentation
    capsule c at a pixel is the probability that the pixel belongs to class c; SegCaps has one
    type (foreground); several types are independent per-class probabilities (a pixel may belong
    to several classes, or to none). SegCaps' three down-samplings become two here: the down path
    reaches H/4 (9 x 9 for 36 x 36 MultiMNIST, whose 5x5 windows then cover the whole image). The
    masked reconstruction of SegCaps is left out.

    Args:
        classes: segmentation capsule types (1: foreground).
        in_channels: channels of the input images.
        stem: S, channels of the stem (the values of the capsules at full resolution).
        dims: (D2, D3), capsule values at H/2 and H/4.
        seg_dim: values per segmentation capsule.
        iters: routing iterations of every capsule layer but the primary one.
        upsampling: DeconvCapsules' "transpose" (SegCaps' deconv) or "nearest" (its resize).
        backend: "fused" or "reference" (see capsroute.nn).

    forward(images, labels=None):
        images (N, in_channels, H, W); labels are accepted and unused. Returns SegCapsNetOutput:
        lengths (N, classes, H, W), capsules (N, H, W, classes, seg_dim).
    """

    def __init__(
        self,
        classes: int = 1,
        in_channels: int = 1,
        *,
        stem: int = 16,
        dims: tuple[int, int] = (16, 32),
        seg_dim: int = 16,
        iters: int = 3,
        upsampling: Upsampling = "transpose",
        backend: str = "fused",
    ):
        super().__init__()
        (d2, d3), S = dims, stem

        def conv(c_in, d_in, c_out, d_out, k=5, stride=1, routing=iters):
            return ConvDynamicCapsules(
                c_in, d_in, c_out, d_out, k, stride, "same", routing, backend=backend
            )

        def deconv(c_in, d_in, c_out, d_out):
            return DeconvCapsules(
                c_in, d_in, c_out, d_out, 4, 2, iters=iters, upsampling=upsampling, backend=backend
            )

        self.stem = nn.Conv2d(in_channels, S, 5, padding=2)
        self.primary = conv(1, S, 2, S, stride=2, routing=1)
        self.down2 = conv(2, S, 4, d2)
        self.down3 = conv(4, d2, 4, d3, stride=2)
        self.middle = conv(4, d3, 8, d3)
        self.up2 = deconv(8, d3, 4, d2)
        self.up2_merge = conv(8, d2, 4, d2)
        self.up1 = deconv(4, d2, 2, S)
        self.segment = conv(3, S, classes, seg_dim, k=1)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> SegCapsNetOutput:
        c1 = F.relu(self.stem(images)).permute(0, 2, 3, 1).unsqueeze(3)  # (N, H, W, 1, S)
        skip2 = self.down2(self.primary(c1))
        deep = self.middle(self.down3(skip2))
        up = _cat_cropped(self.up2(deep), skip2)
        up = _cat_cropped(self.up1(self.up2_merge(up)), c1)
        capsules = self.segment(up)
        lengths = capsules.float().norm(dim=-1).permute(0, 3, 1, 2)
        return SegCapsNetOutput(lengths, capsules)


def _cat_cropped(up: Tensor, skip: Tensor) -> Tensor:
    """The up-sampled capsules cropped to the skip connection's grid (odd sizes come back one
    larger), concatenated with it along the capsule types."""
    return torch.cat([up[:, : skip.shape[1], : skip.shape[2]], skip.to(up.dtype)], 3)


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


__all__ = [
    "DeconvCapsules",
    "SegCapsNet",
    "SegCapsNetOutput",
    "pixel_correct",
    "segmentation_loss",
    "segmentation_metrics",
    "segmentation_sums",
]
