"""Typed Python API of the capsroute operators, with their autograd, fake and autocast implementations.

The schemas live in csrc/ops.cpp; the contract (math, shapes, saved state, errors) is docs/ops.md.

Derivatives: reverse mode to first order runs the fused backward operators. Everything else is
computed by the plain-PyTorch reference (capsroute.reference), which is exact to every order:
a gradient with a graph (`create_graph=True`: double backward, gradient penalties, Hessian-vector
products) differentiates the reference at the saved inputs, and under a torch.func transform
(grad, vjp, jvp, vmap, jacrev, jacfwd, hessian) or forward-mode AD the functions below call the
reference instead of the operator.
"""

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

# _fake and _autograd register the fake and autograd implementations.
from . import _autocast, _autograd, _fake, reference  # noqa: F401

_ops = torch.ops.capsroute

# The public operators, in the order of csrc/ops.cpp. Each has a backward operator _<op>_backward
# that takes the saved state the forward returns.
OPS = (
    "squash",
    "dynamic_routing",
    "dense_capsules",
    "em_routing",
    "em_routing_pose",
    "conv_em_routing",
    "conv_dynamic_routing",
    "self_attention_routing",
    "inverted_attention_routing",
    "dense_self_attention_routing",
    "dense_inverted_attention_routing",
)
SCHEMA_OPS = tuple(name for op in OPS for name in (op, f"_{op}_backward"))


def _reference_computes(op: str, *args) -> bool:
    """Whether a torch.func transform or forward-mode AD sees a tensor of args (op's schema arguments):
    the fused ops have reverse-mode formulas only, so the reference computes, after op's checks."""
    if torch.compiler.is_compiling():
        return False
    dual = fwAD._current_level >= 0
    transformed = any(
        isinstance(t, Tensor)
        and (
            torch._C._functorch.is_functorch_wrapped_tensor(t)
            or (dual and fwAD.unpack_dual(t).tangent is not None)
        )
        for t in args
    )
    if transformed:
        _fake.check_arguments(op, _autocast.cast_arguments(op, args))
    return transformed


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
    if _reference_computes("squash", s, eps):
        return reference.squash(s, dim, eps)
    if dim in (-1, s.dim() - 1):
        return _ops.squash(s, eps)
    return _ops.squash(s.movedim(dim, -1), eps).movedim(-1, dim)


def _with_args(text: str):
    """Fills the {args} of the decorated function's docstring: the arguments several ops share."""

    def decorate(fn):
        fn.__doc__ = fn.__doc__.format(args=text.strip("\n"))
        return fn

    return decorate


_ROUTING_ARGS = """
        iters: routing iterations (>= 1); the agreement updates the logits iters - 1 times.
        bias: optional (J, D), added to every s_j before the squash.
        leaky: append a zero logit as an extra output before each softmax and drop its share,
            so votes that agree with no output go nowhere (leaky routing).
        detach: treat the couplings as constants in the backward pass (the gradient flows only
            through the last weighted sum), as some CapsNet implementations do.
        eps: the squash's eps (>= 0).
"""


@_with_args(_ROUTING_ARGS)
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
    return dynamic_routing_coupling(votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps)[0]


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
    if _reference_computes("dynamic_routing", votes, bias, iters, leaky, detach, eps):
        v, c = reference.dynamic_routing_coupling(
            votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
        )
        return v, c.detach()
    v, c, _ = _ops.dynamic_routing(votes, bias, iters, leaky, detach, eps)
    return v, c


@_with_args(_ROUTING_ARGS)
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
    if _reference_computes("dense_capsules", u, weight, bias, iters, leaky, detach, eps):
        return reference.dense_capsules(
            u, weight, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
        )
    return _ops.dense_capsules(u, weight, bias, iters, leaky, detach, eps)[0]


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


@_with_args(_EM_ARGS)
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
    if _reference_computes("em_routing", votes, a_in, beta_u, beta_a, iters, final_lambda, eps):
        return reference.em_routing(
            votes, a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
        )
    pose, a_out, _ = _ops.em_routing(votes, a_in, beta_u, beta_a, iters, final_lambda, eps)
    return pose, a_out


@_with_args(_EM_ARGS)
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
    if _reference_computes(
        "em_routing_pose", pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps
    ):
        return reference.em_routing_pose(
            pose, weight, a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
        )
    pose_out, a_out, _ = _ops.em_routing_pose(
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
    if _reference_computes("conv_em_routing", *args):
        return reference.conv_em_routing(
            *args[:6], stride=stride, padding=padding, final_lambda=final_lambda, eps=eps
        )
    pose_out, a_out, _ = _ops.conv_em_routing(*args)
    return pose_out, a_out


@_with_args(_ROUTING_ARGS)
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
    if _reference_computes(
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
    return _ops.conv_dynamic_routing(u, weight, bias, iters, stride, padding, leaky, detach, eps)[0]


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
    return self_attention_routing_coupling(
        votes, coupling_bias=coupling_bias, squash=squash, eps=eps
    )[0]


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
    if _reference_computes("self_attention_routing", votes, coupling_bias, squash, eps):
        v, c = reference.self_attention_routing_coupling(
            votes, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
        return v, c.detach()
    v, c, _ = _ops.self_attention_routing(votes, coupling_bias, squash, eps)
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
    return inverted_attention_routing_coupling(
        votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
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
    if _reference_computes("inverted_attention_routing", votes, norm_weight, norm_bias, iters, eps):
        v, c = reference.inverted_attention_routing_coupling(
            votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
        return v, c.detach()
    v, c, _ = _ops.inverted_attention_routing(votes, norm_weight, norm_bias, iters, eps)
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
    if _reference_computes("dense_self_attention_routing", u, weight, coupling_bias, squash, eps):
        return reference.dense_self_attention_routing(
            u, weight, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
    return _ops.dense_self_attention_routing(u, weight, coupling_bias, squash, eps)[0]


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
    if _reference_computes("dense_inverted_attention_routing", *tensors, iters, eps):
        return reference.dense_inverted_attention_routing(
            u, weight, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    return _ops.dense_inverted_attention_routing(*tensors, iters, eps)[0]


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


# ---- autocast: the rules of capsroute/_autocast.py, on the operators themselves ----

_lib = torch.library.Library("capsroute", "IMPL")
_autocast.register(_lib)
