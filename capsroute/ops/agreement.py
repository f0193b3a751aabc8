"""The agreement routings: squash, dynamic routing (on votes, dense, convolutional)."""

from torch import Tensor

from . import reference
from ._dispatch import fused_ops, reference_computes, with_args


def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """The capsule nonlinearity of Sabour et al. (2017), over `dim`:

        squash(s) = |s|^2 / (1 + |s|^2) * s / sqrt(|s|^2 + eps)

    Args:
        s: any shape, a floating dtype.
        dim: the dimension that holds each capsule's vector.
        eps: keeps the norm and its gradient finite at s = 0 (>= 0).

    Returns:
        v, the shape and dtype of `s`: the direction of s with a length in [0, 1).
    """
    if reference_computes("squash", s, eps):
        return reference.squash(s, dim, eps)
    if dim in (-1, s.dim() - 1):
        return fused_ops.squash(s, eps)
    return fused_ops.squash(s.movedim(dim, -1), eps).movedim(-1, dim)


_ROUTING_ARGS = """
        iters: routing iterations (>= 1); the agreement updates the logits iters - 1 times.
        bias: optional (J, D), added to every s_j before the squash.
        leaky: append a zero logit as an extra output before each softmax and drop its share,
            so votes that agree with no output go nowhere (leaky routing).
        detach: treat the couplings as constants in the backward pass (the gradient flows only
            through the last weighted sum), as some CapsNet implementations do.
        eps: the squash's eps (>= 0).
"""


@with_args(_ROUTING_ARGS)
def dynamic_routing(
    votes: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """Routing by agreement (Sabour et al. 2017) over the votes u_ij of input i for output j:

            b = 0;  repeat iters times:  c_ij = softmax_j(b_ij),  s_j = sum_i c_ij u_ij + bias_j,
            v_j = squash(s_j),  b_ij += <u_ij, v_j>   (not after the last iteration)

        Args:
            votes: (B, I, J, D), float32, float64, float16 or bfloat16.
    {args}

        Returns:
            v: (B, J, D), the output capsules, differentiable w.r.t. votes and bias (exactly,
            through every iteration).
    """
    if reference_computes("dynamic_routing", votes, bias, iters, leaky, detach, eps):
        return reference.dynamic_routing(
            votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
        )
    return fused_ops.dynamic_routing(votes, bias, iters, leaky, detach, eps, couplings=False)[0]


def dynamic_routing_coupling(
    votes: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """dynamic_routing that also returns the final couplings c (B, I, J), for inspection.

    Takes the arguments of dynamic_routing. Returns (v (B, J, D), c (B, I, J)); c is not
    differentiable (v is).
    """
    if reference_computes("dynamic_routing", votes, bias, iters, leaky, detach, eps):
        v, c = reference.dynamic_routing_coupling(
            votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
        )
        return v, c.detach()
    v, c, _ = fused_ops.dynamic_routing(votes, bias, iters, leaky, detach, eps)
    return v, c


@with_args(_ROUTING_ARGS)
def dense_capsules(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """A fully connected capsule layer: dynamic_routing over the votes u_ij = weight_ij @ u_i,
        computed on the fly and never stored.

        Args:
            u: (B, I, Din), the input capsules.
            weight: (I, J, D, Din), a transform per input and output capsule.
    {args}

        Returns:
            v: (B, J, D), differentiable w.r.t. u, weight and bias.
    """
    if reference_computes("dense_capsules", u, weight, bias, iters, leaky, detach, eps):
        return reference.dense_capsules(
            u, weight, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
        )
    return fused_ops.dense_capsules(u, weight, bias, iters, leaky, detach, eps, couplings=False)[0]


@with_args(_ROUTING_ARGS)
def conv_dynamic_routing(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """A convolutional capsule layer with dynamic routing (SegCaps' locally-constrained routing,
        LaLonde and Bagci 2018): at every output position (y, x), child type c votes for parent type
        o through a K x K convolution of its capsules,

            u_hat[y, x, c, o] = sum_{{ky, kx}} weight[ky, kx, c, o] @ u[y stride + ky - padding,
                                                                      x stride + kx - padding, c],

        and the position's C_in votes per parent are routed by dynamic_routing (softmax over the
        parent types). The votes are computed a chunk of positions at a time, never stored for the
        whole batch.

        Args:
            u: (B, H, W, C_in, Din), the input capsules (zeros outside the input).
            weight: (K, K, C_in, C_out, D, Din), a transform per window offset and pair of types
                (expand a (K, K, 1, C_out, D, Din) weight to share it over the child types, as
                SegCaps does).
    {args}
            stride: of the windows (>= 1).
            padding: positions of zeros added on every side (>= 0).

        Returns:
            v: (B, H', W', C_out, D), H' = (H + 2 padding - K) // stride + 1 (W' likewise),
            differentiable w.r.t. u, weight and bias.
    """
    if reference_computes(
        "conv_dynamic_routing", u, weight, bias, iters, stride, padding, leaky, detach, eps
    ):
        return reference.conv_dynamic_routing(
            u,
            weight,
            iters,
            bias=bias,
            stride=stride,
            padding=padding,
            leaky=leaky,
            detach=detach,
            eps=eps,
        )
    return fused_ops.conv_dynamic_routing(
        u, weight, bias, iters, stride, padding, leaky, detach, eps
    )[0]
