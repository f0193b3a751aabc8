"""Efficient-CapsNet (Mazzia et al. 2021): depthwise primary capsules routed by self-attention."""

import math

import torch
from torch import Tensor, nn

from ..nn import SelfAttentionCapsules, keras_truncated_normal_
from ..ops.reference import squash_exp
from .capsnet import CapsNetOutput, DecoderCapsNet


class EfficientCapsNetOutput(CapsNetOutput):
    """CapsNetOutput of EfficientCapsNet, which trains with its paper's reconstruction weight
    (capsroute.train.metrics.training_loss)."""

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
