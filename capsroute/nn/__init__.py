"""Capsule layers on the fused routing ops.

Every layer but PrimaryMatrixCapsules (convolutions only) takes `backend="fused"` (the capsroute
kernels) or `backend="reference"` (the plain PyTorch versions in capsroute.reference); both compute
the same function with the same parameters, so one model can be A/B-compared by switching the
attribute (set_backend switches every layer of a model).

  vector      PrimaryCapsules, DenseCapsules, ConvDynamicCapsules, DeconvCapsules (agreement)
  matrix      PrimaryMatrixCapsules, ConvCapsules, ClassCapsules (EM)
  attention   SelfAttentionCapsules, InvertedAttentionCapsules

Shapes: vector capsules are (N, capsules, dim); matrix capsules keep the grid,
poses (N, H, W, types, 16) and activations (N, H, W, types).
"""

from ._base import BACKENDS, check_counts, set_backend
from .attention import InvertedAttentionCapsules, SelfAttentionCapsules, keras_truncated_normal_
from .matrix import CONV_ROUTINGS, ClassCapsules, ConvCapsules, ConvRouting, PrimaryMatrixCapsules
from .vector import ConvDynamicCapsules, DeconvCapsules, DenseCapsules, PrimaryCapsules

__all__ = [
    "BACKENDS",
    "CONV_ROUTINGS",
    "ClassCapsules",
    "ConvCapsules",
    "ConvDynamicCapsules",
    "ConvRouting",
    "DeconvCapsules",
    "DenseCapsules",
    "InvertedAttentionCapsules",
    "PrimaryCapsules",
    "PrimaryMatrixCapsules",
    "SelfAttentionCapsules",
    "check_counts",
    "keras_truncated_normal_",
    "set_backend",
]
