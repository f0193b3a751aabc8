"""The attention routings: Efficient-CapsNet's self-attention and Tsai et al.'s inverted
attention, on votes and on votes made on the fly (dense, pose)."""

import torch
from torch import Tensor

from . import _autocast, reference
from ._dispatch import fused_ops, reference_computes


def self_attention_routing(
    votes: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> Tensor:
    """Efficient-CapsNet's self-attention routing (Mazzia et al. 2021), one step, no iterations:
    each vote's coupling comes from its agreement with the sum of all the votes for its output,

        a_ij = <u_ij, sum_k u_kj> / sqrt(D),  c_ij = softmax_j(a_ij) + coupling_bias_ij,
        s_j = sum_i c_ij u_ij,  v_j = squash(s_j)

    Args:
        votes: (B, I, J, D), float32, float64, float16 or bfloat16.
        coupling_bias: optional (I, J), added to the softmax (Efficient-CapsNet's learned prior,
            its "b"); the couplings then need not sum to 1.
        squash: "efficient", Efficient-CapsNet's (1 - exp(-n)) s / n with n = sqrt(|s|^2 + eps)
            (0 at s = 0), or "sabour", capsroute.squash.
        eps: the squash's eps (>= 0).

    Returns:
        v: (B, J, D), differentiable w.r.t. votes and coupling_bias.
    """
    if reference_computes("self_attention_routing", votes, coupling_bias, squash, eps):
        return reference.self_attention_routing(
            votes, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
    return fused_ops.self_attention_routing(votes, coupling_bias, squash, eps, couplings=False)[0]


def self_attention_routing_coupling(
    votes: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """self_attention_routing that also returns the couplings c (B, I, J) (softmax plus
    coupling_bias), for inspection.

    Takes the arguments of self_attention_routing. Returns (v (B, J, D), c (B, I, J)); c is not
    differentiable (v is).
    """
    if reference_computes("self_attention_routing", votes, coupling_bias, squash, eps):
        v, c = reference.self_attention_routing_coupling(
            votes, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
        return v, c.detach()
    v, c, _ = fused_ops.self_attention_routing(votes, coupling_bias, squash, eps)
    return v, c


def inverted_attention_routing(
    votes: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Inverted dot-product attention routing (Tsai et al. 2020): the outputs' agreement with each
    vote replaces the couplings at every iteration, and a LayerNorm makes the outputs,

        c_ij = 1/J;  repeat iters times:  s_j = sum_i c_ij u_ij,
        v_j = layer_norm(s_j) * norm_weight + norm_bias,
        c_ij = softmax_j(<u_ij, v_j> / sqrt(D))   (not after the last iteration)

    with layer_norm over each capsule's D values (biased variance, eps inside the square root, as
    torch.nn.functional.layer_norm).

    Args:
        votes: (B, I, J, D), float32, float64, float16 or bfloat16.
        iters: routing iterations (>= 1); the agreement replaces the couplings iters - 1 times.
        norm_weight: optional (D,), the LayerNorm's weight (absent: 1).
        norm_bias: optional (D,), the LayerNorm's bias (absent: 0).
        eps: the LayerNorm's eps (> 0).

    Returns:
        v: (B, J, D), differentiable w.r.t. votes, norm_weight and norm_bias (exactly, through
        every iteration).
    """
    if reference_computes("inverted_attention_routing", votes, norm_weight, norm_bias, iters, eps):
        return reference.inverted_attention_routing(
            votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    return fused_ops.inverted_attention_routing(
        votes, norm_weight, norm_bias, iters, eps, couplings=False
    )[0]


def inverted_attention_routing_coupling(
    votes: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """inverted_attention_routing that also returns the final couplings c (B, I, J), for
    inspection.

    Takes the arguments of inverted_attention_routing. Returns (v (B, J, D), c (B, I, J)); c is
    not differentiable (v is).
    """
    if reference_computes("inverted_attention_routing", votes, norm_weight, norm_bias, iters, eps):
        v, c = reference.inverted_attention_routing_coupling(
            votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
        return v, c.detach()
    v, c, _ = fused_ops.inverted_attention_routing(votes, norm_weight, norm_bias, iters, eps)
    return v, c


def dense_self_attention_routing(
    u: Tensor,
    weight: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> Tensor:
    """self_attention_routing over the votes u_ij = weight_ij @ u_i, computed on the fly as
    dense_capsules computes them and never stored.

    Args:
        u: (B, I, Din), the input capsules.
        weight: (I, J, D, Din), a transform per input and output capsule.
        coupling_bias, squash, eps: as self_attention_routing's.

    Returns:
        v: (B, J, D), differentiable w.r.t. u, weight and coupling_bias.
    """
    if reference_computes("dense_self_attention_routing", u, weight, coupling_bias, squash, eps):
        return reference.dense_self_attention_routing(
            u, weight, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
    return fused_ops.dense_self_attention_routing(
        u, weight, coupling_bias, squash, eps, couplings=False
    )[0]


def dense_inverted_attention_routing(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """inverted_attention_routing over the votes u_ij = weight_ij @ u_i, computed on the fly as
    dense_capsules computes them and never stored.

    Args:
        u: (B, I, Din), the input capsules.
        weight: (I, J, D, Din), a transform per input and output capsule.
        iters, norm_weight, norm_bias, eps: as inverted_attention_routing's.

    Returns:
        v: (B, J, D), differentiable w.r.t. u, weight, norm_weight and norm_bias.
    """
    tensors = (u, weight, norm_weight, norm_bias)
    if reference_computes("dense_inverted_attention_routing", *tensors, iters, eps):
        return reference.dense_inverted_attention_routing(
            u, weight, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    return fused_ops.dense_inverted_attention_routing(*tensors, iters, eps, couplings=False)[0]


def pose_block_weight(weight: Tensor) -> Tensor:
    """The (I, J, 16, 16) weight whose vector votes are the 4x4 pose votes of weight (I, J, 4, 4):
    block @ pose_i.flatten() == (pose_i @ weight_ij).flatten(), block = kron(eye(4), weight_ij^T)."""
    eye = torch.eye(4, dtype=weight.dtype, device=weight.device)
    return torch.einsum("xy,ijbc->ijxcyb", eye, weight).flatten(4).flatten(2, 3)


def dense_inverted_attention_routing_pose(
    pose: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """inverted_attention_routing over 4x4 pose votes V_ij = pose_i @ weight_ij (Tsai et al.'s
    matrix capsules): dense_inverted_attention_routing with pose_block_weight(weight), so each vote
    costs 256 multiply-adds instead of 64.

    Args:
        pose: (B, I, 4, 4); weight: (I, J, 4, 4).
        iters, norm_weight, norm_bias (16,), eps: as inverted_attention_routing's (D = 16).

    Returns:
        v: (B, J, 16), the output poses flattened as em_routing_pose returns them, differentiable
        w.r.t. pose, weight, norm_weight and norm_bias.
    """
    # Checked before flattening, which would name pose u in the op's messages.
    if pose.dim() != 4 or pose.shape[2:] != (4, 4):
        raise ValueError(f"pose must have shape (B, I, 4, 4), got {tuple(pose.shape)}")
    if weight.dim() != 4 or weight.shape[2:] != (4, 4) or weight.shape[0] != pose.shape[1]:
        raise ValueError(
            f"weight must have shape (I, J, 4, 4) with I = {pose.shape[1]} to match pose of shape "
            f"{tuple(pose.shape)}, got {tuple(weight.shape)}"
        )
    if not pose.is_floating_point():
        raise RuntimeError(
            f"capsroute: pose must be float32, float64, float16 or bfloat16, got {pose.dtype}"
        )
    pose_in, weight_in = _autocast.cast_arguments(
        "dense_inverted_attention_routing", (pose, weight)
    )
    if (weight_in.dtype, weight_in.device) != (pose_in.dtype, pose_in.device):
        raise RuntimeError(
            f"capsroute: weight is {weight.dtype} on {weight.device} but pose is {pose.dtype} on "
            f"{pose.device}"
        )
    return dense_inverted_attention_routing(
        pose.flatten(2),
        pose_block_weight(weight),
        iters,
        norm_weight=norm_weight,
        norm_bias=norm_bias,
        eps=eps,
    )
