"""The plain CNN baseline of Sabour et al. 2017, with one sigmoid per class."""

from typing import NamedTuple

from torch import Tensor, nn


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
