"""Capsule layers routed by attention: Efficient-CapsNet's self-attention routing (Mazzia et al.
2021) and inverted dot-product attention routing (Tsai et al. 2020).

Like the layers of capsroute.nn, each takes `backend="fused"` (the capsroute kernels) or
`backend="reference"` (capsroute.reference), and capsroute.nn.set_backend switches them too. Both
route the votes u_ij = W_ij u_i with the dense_ op of their routing, which computes the votes on
the fly and never stores them (the reference: one einsum, then the routing).

Shapes: vector capsules, (N, capsules, dim).
"""

import math

import torch
from torch import Tensor, nn

from ..ops.reference import SQUASHES
from ._base import CapsuleLayer, check_counts


class SelfAttentionCapsules(CapsuleLayer):
    """Fully connected capsules routed by self-attention (Efficient-CapsNet's FCCaps, Mazzia et al.
    2021, capsroute.dense_self_attention_routing): one pass, no iterations. Each vote's coupling is its
    agreement with the sum of all votes for the same output, a softmax over the outputs, plus a
    learned bias.

        u_ij = W_ij u_i;  c_ij = softmax_j(<u_ij, sum_k u_kj> / sqrt(D)) + coupling_bias_ij;
        v_j = squash(sum_i c_ij u_ij)

    Args:
        in_capsules: I, the input capsules.
        in_dim: Din, values per input capsule.
        out_capsules: J, the output capsules.
        out_dim: D, values per output capsule.
        coupling_bias: learn the bias (I, J) added to the couplings.
        squash: "efficient", Efficient-CapsNet's (1 - exp(-|s|)) s / |s|, or "sabour", the
            squash of Sabour et al. 2017.
        backend: "fused" (capsroute ops) or "reference" (plain PyTorch).

    Parameters: weight (I, J, D, Din), initialised as the official code's Keras he_normal does for
    its (J, I, Din, D) kernel: a truncated normal of standard deviation sqrt(2 / (I J Din))
    (keras_truncated_normal_); coupling_bias (I, J), zeros, or None.

    Shapes: u (N, I, Din) -> v (N, J, D).
    """

    def __init__(
        self,
        in_capsules: int,
        in_dim: int,
        out_capsules: int,
        out_dim: int,
        *,
        coupling_bias: bool = True,
        squash: str = "efficient",
        backend: str = "fused",
    ):
        super().__init__(backend)
        check_counts(
            in_capsules=in_capsules, in_dim=in_dim, out_capsules=out_capsules, out_dim=out_dim
        )
        if squash not in SQUASHES:
            raise ValueError(f"squash must be one of {', '.join(SQUASHES)}, got {squash!r}")
        self.squash = squash
        self.weight = nn.Parameter(torch.empty(in_capsules, out_capsules, out_dim, in_dim))
        keras_truncated_normal_(self.weight, math.sqrt(2 / (in_capsules * out_capsules * in_dim)))
        self.coupling_bias = (
            nn.Parameter(torch.zeros(in_capsules, out_capsules)) if coupling_bias else None
        )

    def forward(self, u: Tensor) -> Tensor:
        return self.ops.dense_self_attention_routing(
            u, self.weight, coupling_bias=self.coupling_bias, squash=self.squash
        )

    def extra_repr(self) -> str:
        I, J, D, Din = self.weight.shape
        return (
            f"{I}x{Din}D -> {J}x{D}D, coupling_bias={self.coupling_bias is not None}, "
            f"squash={self.squash!r}, {super().extra_repr()}"
        )


class InvertedAttentionCapsules(CapsuleLayer):
    """Fully connected capsules routed by inverted dot-product attention (Tsai et al. 2020,
    capsroute.dense_inverted_attention_routing): the outputs compete for each input. The first pass
    couples every vote uniformly; each later pass couples by the softmax over the outputs of the
    vote's agreement with the previous pass's output (replacing the couplings, not adding to
    them), and every pass's output is the LayerNorm of its weighted sum of votes.

        u_ij = W_ij u_i;  c^0_ij = 1 / J;  c^r_ij = softmax_j(<u_ij, v^(r-1)_j> / sqrt(D));
        v^r_j = LayerNorm(sum_i c^r_ij u_ij) * norm_weight + norm_bias;  v = v^(iters - 1)

    Args:
        in_capsules: I, the input capsules.
        in_dim: Din, values per input capsule.
        out_capsules: J, the output capsules.
        out_dim: D, values per output capsule.
        iters: routing passes (>= 1).
        affine: learn LayerNorm's elementwise weight and bias, as torch.nn.LayerNorm's
            elementwise_affine.
        backend: "fused" (capsroute ops) or "reference" (plain PyTorch).

    Parameters: weight (I, J, D, Din), initialised N(0, J / (I Din)) as in Tsai et al.'s code;
    norm_weight (D,), ones, and norm_bias (D,), zeros, or both None.

    Shapes: u (N, I, Din) -> v (N, J, D).
    """

    def __init__(
        self,
        in_capsules: int,
        in_dim: int,
        out_capsules: int,
        out_dim: int,
        iters: int = 3,
        *,
        affine: bool = True,
        backend: str = "fused",
    ):
        super().__init__(backend)
        check_counts(
            in_capsules=in_capsules, in_dim=in_dim, out_capsules=out_capsules, out_dim=out_dim
        )
        self.iters = iters
        std = math.sqrt(out_capsules / (in_capsules * in_dim))
        self.weight = nn.Parameter(std * torch.randn(in_capsules, out_capsules, out_dim, in_dim))
        self.norm_weight = nn.Parameter(torch.ones(out_dim)) if affine else None
        self.norm_bias = nn.Parameter(torch.zeros(out_dim)) if affine else None

    def forward(self, u: Tensor) -> Tensor:
        return self.ops.dense_inverted_attention_routing(
            u,
            self.weight,
            self.iters,
            norm_weight=self.norm_weight,
            norm_bias=self.norm_bias,
        )

    def extra_repr(self) -> str:
        I, J, D, Din = self.weight.shape
        return (
            f"{I}x{Din}D -> {J}x{D}D, iters={self.iters}, affine={self.norm_weight is not None}, "
            f"{super().extra_repr()}"
        )


@torch.no_grad()
def keras_truncated_normal_(tensor: Tensor, std: float) -> Tensor:
    """Fills `tensor` as Keras' truncated-normal initialisers do (he_normal: std = sqrt(2 /
    fan_in), glorot_normal: sqrt(2 / (fan_in + fan_out))): a normal cut at two of its standard
    deviations, widened so that what is left has the standard deviation `std`."""
    wide = std / 0.87962566103423978  # the standard deviation of N(0, 1) cut at +-2
    return nn.init.trunc_normal_(tensor, std=wide, a=-2 * wide, b=2 * wide)


__all__ = ["InvertedAttentionCapsules", "SelfAttentionCapsules", "keras_truncated_normal_"]
