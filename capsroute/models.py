"""The capsule networks of the papers, built from capsroute.nn layers, and a plain CNN baseline.

Each takes `backend="fused" | "reference"` (see capsroute.nn) and returns a named tuple whose
`scores` (N, classes) rank the classes.
"""

import ast
import math
from typing import NamedTuple

import torch
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
from .nn_attention import SelfAttentionCapsules, keras_truncated_normal_
from .reference import squash_exp
from .segcaps import SegCapsNet


class CapsNetOutput(NamedTuple):
    lengths: Tensor  # (N, classes): the probability that each class is present
    capsules: Tensor  # (N, classes, dim): the class capsules
    reconstructions: Tensor  # (N, pixels): the decoder's image, from the masked capsules

    @property
    def scores(self) -> Tensor:
        return self.lengths


class DecoderCapsNet(nn.Module):
    """A capsule network with the masked decoder of Sabour et al. 2017: its class capsules'
    lengths score the classes, and a decoder of `decoder` hidden widths (ReLU) and a sigmoid
    output redraws the image from the capsules masked to the label's (training) or, without
    labels, the longest one. Subclasses compute the class capsules, add the decoder after their
    other layers (add_decoder) and return `classify(capsules, labels)`."""

    Output = CapsNetOutput

    def add_decoder(self, classes: int, class_dim: int, image_shape: tuple, decoder: tuple):
        """The decoder from classes x class_dim capsules through the hidden widths `decoder` to
        the pixels of image_shape (channels, height, width)."""
        self.image_shape = image_shape
        widths = (classes * class_dim, *decoder)
        layers = [
            m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.ReLU(inplace=True))
        ]
        pixels = image_shape[0] * image_shape[1] * image_shape[2]
        self.decoder = nn.Sequential(*layers, nn.Linear(widths[-1], pixels), nn.Sigmoid())

    def classify(self, capsules: Tensor, labels: Tensor | None):
        """The output for the class capsules (N, classes, class_dim) and the labels."""
        lengths = capsules.float().norm(dim=-1)
        shown = labels if labels is not None else lengths.argmax(-1)
        return self.Output(lengths, capsules, self.reconstruct(capsules, shown))

    def reconstruct(self, capsules: Tensor, classes: Tensor) -> Tensor:
        """The decoder's image from the capsule of `classes`, the others masked out: (N, pixels)
        for classes (N,), (N, k, pixels) for classes (N, k), one image per class."""
        mask = F.one_hot(classes, capsules.shape[1]).to(capsules.dtype)[
            ..., None
        ]  # (N, [k,] classes, 1)
        if classes.dim() == 2:
            capsules = capsules[:, None]
        return self.decoder((capsules * mask).flatten(-2))


class CapsNet(DecoderCapsNet):
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
        self.add_decoder(classes, class_dim, (in_channels, image_size, image_size), decoder)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> CapsNetOutput:
        return self.classify(self.classes(self.primary(F.relu(self.conv(images)))), labels)


class EfficientCapsNetOutput(CapsNetOutput):
    """CapsNetOutput of EfficientCapsNet, which trains with its paper's reconstruction weight
    (capsroute.losses.training_loss)."""

    __slots__ = ()


# Efficient-CapsNet's two graphs in the official code, by image size: the stride of the third
# convolution and the depthwise primary convolution's kernel and stride, which bring the last
# feature map to 1x1 (MNIST, 28x28: 9x9 -> 1x1; MultiMNIST, 36x36: 6x6 -> 1x1).
EFFICIENT_GRAPHS = {28: (1, 9, 1), 36: (2, 5, 2)}


class EfficientCapsNet(DecoderCapsNet):
    """Efficient-CapsNet (Mazzia et al. 2021), as its official code builds it: four valid
    convolutions, each followed by ReLU and batch norm (5x5 32, 3x3 64, 3x3 64, 3x3 128 of stride
    2), primary capsules from a depthwise convolution of the whole 9x9 map (one 9x9 filter per
    channel: 128 values, 16 capsules of 8D, squashed by Efficient-CapsNet's squash), 10 class
    capsules of 16D by self-attention routing (SelfAttentionCapsules), and CapsNet's masked
    512-1024-pixels decoder. On 36x36 MultiMNIST pairs the third convolution has stride 2 and the
    primary convolution is 5x5 of stride 2, as in the official MultiMNIST graph.

    161,824 trainable parameters without the decoder, the paper's "161K" (the decoder is the
    training's regulariser; batch norm's running means and variances are buffers, not counted);
    1,573,168 with it. Initialised as the official Keras layers: he_normal convolutions and
    hidden decoder layers, glorot_uniform depthwise and glorot_normal decoder output, zero biases;
    batch norm with Keras' momentum (0.01 in torch's convention) and eps 1e-3.

    Args:
        classes: class capsules.
        in_channels: channels of the input images.
        image_size: 28 (MNIST, Fashion-MNIST) or 36 (MultiMNIST).
        channels: widths of the four convolutions; the last is split into capsules.
        primary_dim: values per primary capsule (channels[3] / primary_dim capsules).
        class_dim: values per class capsule.
        decoder: hidden widths of the decoder.
        backend: "fused" or "reference" (see capsroute.nn).

    forward(images, labels=None): as CapsNet's; returns EfficientCapsNetOutput.
    """

    Output = EfficientCapsNetOutput

    def __init__(
        self,
        classes: int = 10,
        in_channels: int = 1,
        image_size: int = 28,
        *,
        channels: tuple[int, int, int, int] = (32, 64, 64, 128),
        primary_dim: int = 8,
        class_dim: int = 16,
        decoder: tuple[int, ...] = (512, 1024),
        backend: str = "fused",
    ):
        super().__init__()
        if image_size not in EFFICIENT_GRAPHS:
            raise ValueError(
                f"image_size must be one of {', '.join(map(str, EFFICIENT_GRAPHS))} (the official "
                f"graphs), got {image_size}"
            )
        if channels[3] % primary_dim:
            raise ValueError(
                f"primary_dim must divide the last convolution's {channels[3]} channels, "
                f"got {primary_dim}"
            )
        third_stride, primary_kernel, primary_stride = EFFICIENT_GRAPHS[image_size]
        layers = []
        for (cin, cout), kernel, stride in zip(
            zip((in_channels, *channels), channels), (5, 3, 3, 3), (1, 1, third_stride, 2)
        ):
            conv = nn.Conv2d(cin, cout, kernel, stride)
            keras_truncated_normal_(conv.weight, math.sqrt(2 / (cin * kernel * kernel)))
            nn.init.zeros_(conv.bias)
            layers += [conv, nn.ReLU(inplace=True), nn.BatchNorm2d(cout, eps=1e-3, momentum=0.01)]
        self.features = nn.Sequential(*layers)
        self.primary = nn.Conv2d(
            channels[3], channels[3], primary_kernel, primary_stride, groups=channels[3]
        )
        nn.init.xavier_uniform_(self.primary.weight)
        nn.init.zeros_(self.primary.bias)
        # Channels-last convolutions, weights and images (made so in forward): faster on the CPU,
        # where the images alone gain nothing (docs/training.md).
        self.features.to(memory_format=torch.channels_last)
        self.primary.to(memory_format=torch.channels_last)
        self.primary_dim = primary_dim
        self.classes = SelfAttentionCapsules(
            channels[3] // primary_dim, primary_dim, classes, class_dim, backend=backend
        )
        self.add_decoder(classes, class_dim, (in_channels, image_size, image_size), decoder)
        *hidden, output = (m for m in self.decoder if isinstance(m, nn.Linear))
        for linear in hidden:
            keras_truncated_normal_(linear.weight, math.sqrt(2 / linear.in_features))
        keras_truncated_normal_(  # glorot_normal
            output.weight, math.sqrt(2 / (output.in_features + output.out_features))
        )
        for linear in (*hidden, output):
            nn.init.zeros_(linear.bias)

    def forward(self, images: Tensor, labels: Tensor | None = None) -> EfficientCapsNetOutput:
        images = images.contiguous(memory_format=torch.channels_last)
        primary = self.primary(self.features(images))  # (N, channels[3], 1, 1)
        # 16 capsules: the plain PyTorch squash in either backend (capsroute fuses only Sabour's)
        u = squash_exp(primary.reshape(len(primary), -1, self.primary_dim))
        return self.classify(self.classes(u), labels)


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


MODELS = {
    "capsnet": CapsNet,
    "efficientcapsnet": EfficientCapsNet,
    "matrixcapsnet": MatrixCapsNet,
    "cnn": CNN,
    "segcapsnet": SegCapsNet,  # capsroute.segcaps: segments MultiMNIST pairs (multimnist-seg)
}
# The networks sized for the dataset's images: 36x36 MultiMNIST pairs, else 28x28.
PAIR_MODELS = ("capsnet", "efficientcapsnet", "cnn")


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
    if args["model"] in PAIR_MODELS:
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
    "DecoderCapsNet",
    "EfficientCapsNet",
    "EfficientCapsNetOutput",
    "MatrixCapsNet",
    "MatrixCapsNetOutput",
    "build_model",
    "model_for_run",
    "parse_model_config",
]
