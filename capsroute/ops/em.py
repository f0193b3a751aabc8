"""EM routing (Hinton et al. 2018): on votes, on poses and a weight, in a convolutional layer."""

from torch import Tensor

from . import reference
from ._dispatch import fused_ops, reference_computes, with_args

_EM_ARGS = """
        a_in: (B, I), the input activations, in [0, 1].
        beta_u, beta_a: (J,), the learned costs of the M-step.
        iters: EM iterations (>= 1).
        final_lambda: the inverse temperature of the last iteration; iteration t uses
            final_lambda * (1 - 0.95 ** (t + 1)).
        eps: floors the variances and is added to each output's mass m_j (> 0), so an output
            that receives no mass stays finite.

    Returns:
        (pose (B, J, H), a_out (B, J)): the M-step's means and activations, differentiable
        w.r.t. every tensor argument (exactly, through every iteration).
"""


@with_args(_EM_ARGS)
def em_routing(
    votes: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """EM routing of matrix capsules (Hinton et al. 2018): each output j is a Gaussian over the
        votes with mean mu_j and diagonal variance var_j, fitted by EM from R_ij = 1/J:

            M-step:  r_ij = R_ij a_i,  m_j = sum_i r_ij,  mu_j, var_j = the r-weighted moments,
                     a_j = sigmoid(lambda (beta_a_j - sum_h (beta_u_j + ln(var_jh) / 2) m_j))
            E-step:  R_ij = softmax_j(ln a_j + ln N(V_ij; mu_j, var_j)), in the log domain

        Args:
            votes: (B, I, J, H), float32, float64, float16 or bfloat16 (computed in float32 under
                autocast).
    {args}
    """
    if reference_computes("em_routing", votes, a_in, beta_u, beta_a, iters, final_lambda, eps):
        return reference.em_routing(
            votes, a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
        )
    pose, a_out, _ = fused_ops.em_routing(votes, a_in, beta_u, beta_a, iters, final_lambda, eps)
    return pose, a_out


@with_args(_EM_ARGS)
def em_routing_pose(
    pose: Tensor,
    weight: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """em_routing over the votes V_ij = pose_i @ weight_ij (4x4 matrix products, H = 16),
        computed on the fly and never stored.

        Args:
            pose: (B, I, 4, 4) or (B, I, 16), the input poses.
            weight: (I, J, 4, 4), a transform per input and output capsule.
    {args}
    """
    if pose.dim() == 3 and pose.shape[-1] == 16:
        pose = pose.unflatten(-1, (4, 4))
    if reference_computes(
        "em_routing_pose", pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps
    ):
        return reference.em_routing_pose(
            pose, weight, a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
        )
    pose_out, a_out, _ = fused_ops.em_routing_pose(
        pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps
    )
    return pose_out, a_out


def conv_em_routing(
    pose: Tensor,
    a_in: Tensor,
    weight: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    stride: int = 1,
    padding: int = 0,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """EM routing in a convolutional capsule layer (Hinton et al. 2018) with the paper's E-step:
    a child capsule that lies in several overlapping K x K windows has one assignment
    distribution over every parent of every window that contains it (its assignments sum to 1).
    Each window's parents run em_routing's M-step over the window's K*K*C_in children, with the
    votes V = pose_child @ weight[ky, kx, c, o] computed on the fly and never stored.

    Args:
        pose: (B, H, W, C_in, 4, 4) or (B, H, W, C_in, 16), the input poses.
        a_in: (B, H, W, C_in), the input activations, in [0, 1].
        weight: (K, K, C_in, C_out, 4, 4), a transform per window offset and pair of types.
        beta_u, beta_a: (C_out,), the learned costs of the M-step.
        iters: EM iterations (>= 1).
        stride: of the windows (>= 1).
        padding: positions added on every side (>= 0); they are no capsules.
        final_lambda: the inverse temperature of the last iteration; iteration t uses
            final_lambda * (1 - 0.95 ** (t + 1)).
        eps: floors the variances and is added to each parent's mass (> 0).

    Returns:
        (pose (B, H', W', C_out, 16), a_out (B, H', W', C_out)), H' = (H + 2 padding - K) // stride
        + 1 (W' likewise), differentiable w.r.t. every tensor argument (exactly, through every
        iteration).
    """
    if pose.dim() == 5 and pose.shape[-1] == 16:
        pose = pose.unflatten(-1, (4, 4))
    args = (pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps)
    if reference_computes("conv_em_routing", *args):
        return reference.conv_em_routing(
            *args[:6], stride=stride, padding=padding, final_lambda=final_lambda, eps=eps
        )
    pose_out, a_out, _ = fused_ops.conv_em_routing(*args)
    return pose_out, a_out
