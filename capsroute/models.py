"""The two capsule networks of the papers, built from capsroute.nn layers.

Both take `backend="fused" | "reference"` (see capsroute.nn) and return a named tuple whose
`scores` (N, classes) rank the classes.
"""
import ast
from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from .nn import ClassCapsules, ConvCapsules, DenseCapsules, PrimaryCapsules, PrimaryMatrixCapsules


class CapsNetOutput(NamedTuple):
    lengths: Tensor          # (N, classes): the probability that each class is present
    capsules: Tensor         # (N, classes, dim): the class capsules
    reconstructions: Tensor  # (N, pixels): the decoder's image, from the masked capsules

    @property
    def scores(self) -> Tensor:
        return self.lengths


class CapsNet(nn.Module):
    """Sabour et al. 2017: conv 256@9x9 (ReLU), 32 types of 8D primary capsules (9x9, stride 2),
    10 class capsules of 16D by 3 iterations of dynamic routing, and a 512-1024-pixels decoder that
    sees only the label's capsule in training and the longest capsule in evaluation."""

    def __init__(self, classes: int = 10, in_channels: int = 1, image_size: int = 28, *, conv_channels: int = 256,
                 primary_types: int = 32, primary_dim: int = 8, class_dim: int = 16, iters: int = 3,
                 decoder: tuple[int, ...] = (512, 1024), backend: str = "fused"):
        super().__init__()
        self.image_shape = (in_channels, image_size, image_size)
        self.conv = nn.Conv2d(in_channels, conv_channels, 9)
        self.primary = PrimaryCapsules(conv_channels, primary_types, primary_dim, kernel_size=9, stride=2,
                                       backend=backend)
        grid = (image_size - 8 - 9) // 2 + 1
        if grid < 1:
            raise ValueError(f"image_size must be at least 25 for two 9x9 convolutions, got {image_size}")
        self.classes = DenseCapsules(primary_types * grid * grid, primary_dim, classes, class_dim, iters,
                                     backend=backend)
        widths = (classes * class_dim, *decoder)
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU(inplace=True))]
        self.decoder = nn.Sequential(*layers, nn.Linear(widths[-1], in_channels * image_size * image_size),
                                     nn.Sigmoid())

    def forward(self, images: Tensor, labels: Tensor | None = None) -> CapsNetOutput:
        capsules = self.classes(self.primary(F.relu(self.conv(images))))
        lengths = capsules.float().norm(dim=-1)
        shown = labels if self.training and labels is not None else lengths.argmax(-1)
        return CapsNetOutput(lengths, capsules, self.reconstruct(capsules, shown))

    def reconstruct(self, capsules: Tensor, classes: Tensor) -> Tensor:
        """The decoder's image from the capsule of `classes` (N,), the others masked out."""
        mask = F.one_hot(classes, capsules.shape[1]).to(capsules.dtype)
        return self.decoder((capsules * mask[..., None]).flatten(1))


class MatrixCapsNetOutput(NamedTuple):
    activations: Tensor  # (N, classes)
    poses: Tensor        # (N, classes, 16)

    @property
    def scores(self) -> Tensor:
        return self.activations


class MatrixCapsNet(nn.Module):
    """Hinton et al. 2018: conv A@5x5 stride 2 (ReLU), B primary matrix capsule types, ConvCaps1
    (C types, 3x3, stride 2), ConvCaps2 (D types, 3x3, stride 1) and class capsules with coordinate
    addition, each capsule layer routed by `iters` iterations of EM routing. The default is the
    paper's small network, A=64, B=8, C=D=16, with 2 iterations as the public re-implementations
    have it: with 3, the assignments are near one-hot by the last E-step and the network learns
    far more slowly (docs/matrixcapsnet.md). The routing options (final_lambda, normalize_cost,
    min_var, weight_std, pose_norm) are those of ConvCapsules and ClassCapsules, for every EM layer;
    conv_norm puts batch norm after the first convolution."""

    def __init__(self, classes: int = 10, in_channels: int = 1, *, A: int = 64, B: int = 8, C: int = 16, D: int = 16,
                 iters: int = 2, final_lambda: float = 0.01, normalize_cost: bool = False, min_var: float = 1e-6,
                 weight_std: float = 0.5, pose_norm: bool = False, conv_norm: bool = False, backend: str = "fused"):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, A, 5, stride=2)
        self.conv_norm = nn.BatchNorm2d(A) if conv_norm else nn.Identity()
        self.primary = PrimaryMatrixCapsules(A, B)
        routing = dict(iters=iters, final_lambda=final_lambda, normalize_cost=normalize_cost, min_var=min_var,
                       weight_std=weight_std, pose_norm=pose_norm, backend=backend)
        self.conv_caps1 = ConvCapsules(B, C, 3, stride=2, **routing)
        self.conv_caps2 = ConvCapsules(C, D, 3, stride=1, **routing)
        self.classes = ClassCapsules(D, classes, **routing)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> MatrixCapsNetOutput:
        pose, activation = self.primary(F.relu(self.conv_norm(self.conv(images))))
        pose, activation = self.conv_caps1(pose, activation)
        pose, activation = self.conv_caps2(pose, activation)
        poses, activations = self.classes(pose, activation)
        return MatrixCapsNetOutput(activations, poses)


MODELS = {"capsnet": CapsNet, "matrixcapsnet": MatrixCapsNet}


def parse_model_config(items: list[str]) -> dict:
    """Constructor arguments from KEY=VALUE strings (`capsroute train --model-config`): each value
    as a Python literal (64, 0.5, (64, 128)) where it is one, else as the string."""
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            config[key] = value
    return config


def build_model(name: str, backend: str = "fused", config: dict | None = None) -> nn.Module:
    """The network MODELS[name] with the given routing backend and constructor arguments."""
    return MODELS[name](backend=backend, **(config or {}))


__all__ = ["MODELS", "CapsNet", "CapsNetOutput", "MatrixCapsNet", "MatrixCapsNetOutput", "build_model",
           "parse_model_config"]
