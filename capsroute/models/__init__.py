"""The capsule networks of the papers, built from capsroute.nn layers, and a plain CNN baseline.

Each takes `backend="fused" | "reference"` (see capsroute.nn) and returns a named tuple whose
`scores` (N, classes) rank the classes (SegCapsNet: per-pixel lengths).
"""

from torch import nn

from .capsnet import CapsNet, CapsNetOutput, DecoderCapsNet
from .cnn import CNN, CNNOutput
from .efficientcapsnet import EFFICIENT_GRAPHS, EfficientCapsNet, EfficientCapsNetOutput
from .matrixcapsnet import MatrixCapsNet, MatrixCapsNetOutput
from .segcapsnet import SegCapsNet, SegCapsNetOutput

MODELS = {
    "capsnet": CapsNet,
    "efficientcapsnet": EfficientCapsNet,
    "matrixcapsnet": MatrixCapsNet,
    "cnn": CNN,
    "segcapsnet": SegCapsNet,  # segments MultiMNIST pairs (multimnist-seg)
}


def build_model(name: str, backend: str = "fused", config: dict | None = None) -> nn.Module:
    """The network MODELS[name] with the given routing backend and constructor arguments."""
    return MODELS[name](backend=backend, **(config or {}))


__all__ = [
    "CNN",
    "CNNOutput",
    "EFFICIENT_GRAPHS",
    "MODELS",
    "CapsNet",
    "CapsNetOutput",
    "DecoderCapsNet",
    "EfficientCapsNet",
    "EfficientCapsNetOutput",
    "MatrixCapsNet",
    "MatrixCapsNetOutput",
    "SegCapsNet",
    "SegCapsNetOutput",
    "build_model",
]
