"""SegCapsNet: a small SegCaps-style U-Net of capsules (LaLonde and Bagci 2018) on the fused
convolutional routing op: a conv stem, primary capsules, a down path of stride-2
ConvDynamicCapsules, an up path of DeconvCapsules with skip connections, and segmentation capsules
whose lengths are per-pixel probabilities (capsroute.losses.segmentation_loss trains them)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import ConvDynamicCapsules, DeconvCapsules
from ..nn.vector import Upsampling


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
