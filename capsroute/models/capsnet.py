"""CapsNet (Sabour et al. 2017): a convolution, primary capsules, digit capsules routed by
agreement, and a decoder that reconstructs the image from the masked digit capsules."""

from typing import NamedTuple

import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import DenseCapsules, PrimaryCapsules


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
