"""Matrix capsules with EM routing (Hinton et al. 2018)."""

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import ClassCapsules, ConvCapsules, ConvRouting, PrimaryMatrixCapsules


class MatrixCapsNetOutput(NamedTuple):
    activations: Tensor  # (N, classes)
    poses: Tensor  # (N, classes, 16)

    @property
    def scores(self) -> Tensor:
        return self.activations


class MatrixCapsNet(nn.Module):
    """Matrix capsules with EM routing (Hinton et al. 2018): conv A@5x5 stride 2 (ReLU), B primary
    matrix capsule types, ConvCaps1 (C types, 3x3, stride 2), ConvCaps2 (D types, 3x3, stride 1)
    and class capsules with coordinate addition, each capsule layer routed by `iters` iterations
    of EM routing. The default is the paper's small network, A=64, B=8, C=D=16, with 2 iterations
    as the public re-implementations have it: with 3, the assignments are near one-hot by the last
    E-step and the network learns far more slowly (docs/matrixcapsnet.md).

    Args:
        classes: class capsules.
        in_channels: channels of the input images.
        A, B, C, D: the layer widths above.
        iters: EM iterations in every capsule layer.
        final_lambda, normalize_cost, min_var, weight_std, pose_norm: the routing options of
            ConvCapsules and ClassCapsules, for every EM layer.
        conv_routing: the convolutional capsule layers' routing, "window" or "cross-window"
            (ConvCapsules' routing).
        conv_norm: batch norm after the first convolution.
        backend: "fused" or "reference" (see capsroute.nn).

    forward(images, labels=None):
        images (N, in_channels, H, W); labels are accepted and unused. Returns
        MatrixCapsNetOutput: activations (N, classes), poses (N, classes, 16).
    """

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 1,
        *,
        A: int = 64,
        B: int = 8,
        C: int = 16,
        D: int = 16,
        iters: int = 2,
        final_lambda: float = 0.01,
        normalize_cost: bool = False,
        min_var: float = 1e-6,
        weight_std: float = 0.5,
        pose_norm: bool = False,
        conv_routing: ConvRouting = "window",
        conv_norm: bool = False,
        backend: str = "fused",
    ):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, A, 5, stride=2)
        self.conv_norm = nn.BatchNorm2d(A) if conv_norm else nn.Identity()
        self.primary = PrimaryMatrixCapsules(A, B)
        em_options = dict(
            iters=iters,
            final_lambda=final_lambda,
            normalize_cost=normalize_cost,
            min_var=min_var,
            weight_std=weight_std,
            pose_norm=pose_norm,
            backend=backend,
        )
        self.conv_caps1 = ConvCapsules(B, C, 3, stride=2, routing=conv_routing, **em_options)
        self.conv_caps2 = ConvCapsules(C, D, 3, stride=1, routing=conv_routing, **em_options)
        self.classes = ClassCapsules(D, classes, **em_options)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> MatrixCapsNetOutput:
        pose, activation = self.primary(F.relu(self.conv_norm(self.conv(images))))
        pose, activation = self.conv_caps1(pose, activation)
        pose, activation = self.conv_caps2(pose, activation)
        poses, activations = self.classes(pose, activation)
        return MatrixCapsNetOutput(activations, poses)
