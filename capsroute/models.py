"""The two capsule networks of the papers, built from capsroute.nn layers, and a plain CNN baseline.

Both take `backend="fused" | "reference"` (see capsroute.nn) and return a named tuple whose
`scores` (N, classes) rank the classes.
"""

import ast
from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from . import multimnist
from .nn import (
    ClassCapsules,
    ConvCapsules,
    ConvRouting,
    DenseCapsules,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
)
from .segcaps import SegCapsNet


class CapsNetOutput(NamedTuple):
    lengths: Tensor  # (N, classes): the probability that each class is present
    capsules: Tensor  # (N, classes, dim): the class capsules
    reconstructions: Tensor  # (N, pixels): the decoder's image, from the masked capsules

    @property
    def scores(self) -> Tensor:
        return self.lengths


class CapsNet(nn.Module):
    """CapsNet (Sabour et al. 2017): conv 256@9x9 (ReLU), 32 types of 8D primary capsules (9x9,
    stride 2), 10 class capsules of 16D by 3 iterations of dynamic routing (DenseCapsules), and a
    512-1024-pixels decoder that sees only the label's capsule when labels are given (training) and
    the longest capsule otherwise.

        lengths_j = |v_j|;  reconstruction = decoder(v masked to the shown class)

    Args:
        classes: class capsules.
        in_channels, image_size: the input images (square).
        conv_channels: channels of the first convolution.
        primary_types, primary_dim: primary capsule types and their size.
        class_dim: values per class capsule.
        iters: routing iterations.
        decoder: hidden widths of the decoder.
        backend: "fused" or "reference" (see capsroute.nn).

    forward(images, labels=None):
        images (N, in_channels, image_size, image_size); labels None, (N,) or (N, k) class
        indices (MultiMNIST: k = 2). Returns CapsNetOutput: lengths (N, classes), capsules
        (N, classes, class_dim), reconstructions (N, pixels), or (N, k, pixels) for labels (N, k),
        one from each label's capsule.
    """

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        *,
        conv_channels: int = 256,
        primary_types: int = 32,
        primary_dim: int = 8,
        class_dim: int = 16,
        iters: int = 3,
        decoder: tuple[int, ...] = (512, 1024),
        backend: str = "fused",
    ):
        super().__init__()
        self.image_shape = (in_channels, image_size, image_size)
        self.conv = nn.Conv2d(in_channels, conv_channels, 9)
        self.primary = PrimaryCapsules(
            conv_channels, primary_types, primary_dim, kernel_size=9, stride=2, backend=backend
        )
        grid = (image_size - 8 - 9) // 2 + 1
        if grid < 1:
            raise ValueError(
                f"image_size must be at least 17 for two 9x9 convolutions (the second of stride 2), got {image_size}"
            )
        self.classes = DenseCapsules(
            primary_types * grid * grid, primary_dim, classes, class_dim, iters, backend=backend
        )
        widths = (classes * class_dim, *decoder)
        layers = [
            m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU(inplace=True))
        ]
        self.decoder = nn.Sequential(
            *layers, nn.Linear(widths[-1], in_channels * image_size * image_size), nn.Sigmoid()
        )

    def forward(self, images: Tensor, labels: Tensor | None = None) -> CapsNetOutput:
        capsules = self.classes(self.primary(F.relu(self.conv(images))))
        lengths = capsules.float().norm(dim=-1)
        shown = labels if labels is not None else lengths.argmax(-1)
        return CapsNetOutput(lengths, capsules, self.reconstruct(capsules, shown))

    def reconstruct(self, capsules: Tensor, classes: Tensor) -> Tensor:
        """The decoder's image from the capsule of `classes`, the others masked out: (N, pixels)
        for classes (N,), (N, k, pixels) for classes (N, k), one image per class."""
        mask = F.one_hot(classes, capsules.shape[1]).to(capsules.dtype)[
            ..., None
        ]  # (N, [k,] classes, 1)
        if classes.dim() == 2:
            capsules = capsules[:, None]
        return self.decoder((capsules * mask).flatten(-2))


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


class CNNOutput(NamedTuple):
    logits: Tensor  # (N, classes): one independent logit per class (sigmoid: present or not)

    @property
    def scores(self) -> Tensor:
        return self.logits


class CNN(nn.Module):
    """The plain convolutional baseline of the MultiMNIST experiment: conv 64@5x5, max-pool 2,
    conv 128@5x5, max-pool 2, conv 128@3x3 (all ReLU, "same" padding), a hidden layer of `hidden`
    units and one logit per class, trained with a sigmoid per class (several digits may be
    present). At 36x36 and the default width it has 11.0M parameters, about CapsNet's 11.4M, at a
    sixth of CapsNet's multiply-adds.

    Args:
        classes: logits out.
        in_channels, image_size: the input images (square).
        channels: widths of the three convolutions.
        hidden: units of the hidden layer.
        backend: accepted so that every model takes the trainer's arguments; a CNN has no
            routing to run.

    forward(images, labels=None):
        images (N, in_channels, image_size, image_size); labels are accepted and unused.
        Returns CNNOutput: logits (N, classes).
    """

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        *,
        channels: tuple[int, int, int] = (64, 128, 128),
        hidden: int = 1024,
        backend: str = "fused",
    ):
        super().__init__()
        c1, c2, c3 = channels
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c2, c3, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Flatten(),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Linear(c3 * side * side, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, classes)
        )

    def forward(self, images: Tensor, labels: Tensor | None = None) -> CNNOutput:
        return CNNOutput(self.classifier(self.features(images)))


MODELS = {"capsnet": CapsNet, "matrixcapsnet": MatrixCapsNet, "cnn": CNN}
MODELS["segcapsnet"] = SegCapsNet  # capsroute.segcaps: segments MultiMNIST pairs (multimnist-seg)


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


def model_for_run(args: dict) -> nn.Module:
    """The network of a run's arguments (vars of `capsroute train`'s, or a checkpoint's "args"): --model
    with --model-config, sized for the dataset's images (36x36 MultiMNIST pairs, else 28x28)."""
    config = parse_model_config(args["model_config"])
    if args["model"] in ("capsnet", "cnn"):
        pairs = args["dataset"] == "multimnist"
        config.setdefault("image_size", multimnist.SIZE if pairs else multimnist.DIGIT_SIZE)
    if args["model"] == "segcapsnet":
        config.setdefault("classes", 10)  # one segmentation capsule type per digit class
    return build_model(args["model"], args["backend"], config)


__all__ = [
    "CNN",
    "CNNOutput",
    "MODELS",
    "CapsNet",
    "CapsNetOutput",
    "MatrixCapsNet",
    "MatrixCapsNetOutput",
    "build_model",
    "model_for_run",
    "parse_model_config",
]
