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

from . import _autocast, _fake, reference  # noqa: F401  (_fake registers the fake implementations)
from ._fake import acc_dtype

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
)
SCHEMA_OPS = tuple(name for op in OPS for name in (op, f"_{op}_backward"))


def _transformed(*tensors: Tensor | None) -> bool:
    """Whether a torch.func transform or forward-mode AD sees one of the tensors: the fused
    operators have reverse-mode formulas only, so the reference computes instead."""
    if torch.compiler.is_compiling():
        return False
    dual = fwAD._current_level >= 0
    return any(
        t is not None
        and (
            torch._C._functorch.is_functorch_wrapped_tensor(t)
            or (dual and fwAD.unpack_dual(t).tangent is not None)
        )
        for t in tensors
    )


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
    if _transformed(s):
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
    if _transformed(votes, bias):
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
    if _transformed(u, weight, bias):
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
    if _transformed(votes, a_in, beta_u, beta_a):
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
    if _transformed(pose, weight, a_in, beta_u, beta_a):
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
    if _transformed(pose, a_in, weight, beta_u, beta_a):
        return reference.conv_em_routing(
            pose,
            a_in,
            weight,
            beta_u,
            beta_a,
            iters,
            stride=stride,
            padding=padding,
            final_lambda=final_lambda,
            eps=eps,
        )
    if (
        pose.is_cuda
        and not torch.compiler.is_compiling()
        and torch.cuda.is_current_stream_capturing()
    ):
        raise RuntimeError(
            "capsroute: conv_em_routing cannot be captured in a CUDA graph: its CUDA path computes"
            " on host copies (docs/ops.md, conv_em_routing)"
        )
    pose_out, a_out, _ = _ops.conv_em_routing(
        pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps
    )
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
    if _transformed(u, weight, bias):
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


# ---- autograd ----
# Each operator's inputs are its tensors, then its options. setup_context saves the tensors and
# the forward's saved state; the backward runs the fused backward operator, or, when the engine
# builds a graph of the gradient (grad mode is on in a backward only with create_graph=True),
# differentiates the reference at the saved inputs so that every higher derivative is exact.


def _reference_vjp(ctx, tensors: list, grads: tuple) -> list:
    """The vector-Jacobian product of ctx.reference at `tensors`, as a graph, in the
    accumulation dtype; None for the tensors that need no gradient."""
    wanted = [i for i, t in enumerate(tensors) if t is not None and ctx.needs_input_grad[i]]
    like = tensors[wanted[0]] if wanted else None
    result = [None] * len(tensors)
    if like is None:
        return result
    acc = acc_dtype(like.dtype)
    with torch.enable_grad(), torch.autocast(like.device.type, enabled=False):
        outputs = ctx.reference(*(None if t is None else t.to(acc) for t in tensors))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, g.to(out.dtype)) for out, g in zip(outputs, grads) if g is not None]
        inputs = [tensors[i] for i in wanted]
        grads_in = torch.autograd.grad(
            [p[0] for p in pairs],
            inputs,
            [p[1] for p in pairs],
            create_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )
    for i, g in zip(wanted, grads_in):
        result[i] = g.to(tensors[i].dtype)
    return result


def _register_autograd(
    name: str, num_tensors: int, num_differentiable: int, reference_fn, fused_backward
):
    """reference_fn(*tensors, *options) gives the op's differentiable outputs in plain PyTorch;
    fused_backward(ctx, tensors, state, grads) the first-order gradients of the tensors."""

    def setup_context(ctx, inputs, output):
        tensors, options = inputs[:num_tensors], inputs[num_tensors:]
        state = None
        if isinstance(output, tuple):
            ctx.mark_non_differentiable(*output[num_differentiable:])
            state = output[-1]
            # Autograd would otherwise pass zeros the size of the couplings and the saved state as
            # their gradients, which the backward drops.
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, state)
        ctx.options = options
        ctx.reference = lambda *ts: reference_fn(*ts, *options)

    def backward(ctx, *grads):
        *tensors, state = ctx.saved_tensors
        grads = grads[:num_differentiable]
        if all(g is None for g in grads):
            return (*(None for _ in tensors), *(None for _ in ctx.options))
        if torch.is_grad_enabled():
            grads_in = _reference_vjp(ctx, tensors, grads)
        else:
            grads_in = fused_backward(ctx, tensors, state, grads)
        return (*grads_in, *(None for _ in ctx.options))

    torch.library.register_autograd(f"capsroute::{name}", backward, setup_context=setup_context)


def _zeros_if_none(grads: tuple, stats: Tensor, H: int) -> tuple[Tensor, Tensor]:
    """Autograd passes None for an output that got no gradient; the backward ops want zeros."""
    grad_pose, grad_a_out = grads
    B, J = stats.shape[0], stats.shape[2]
    return (
        stats.new_zeros(B, J, H) if grad_pose is None else grad_pose,
        stats.new_zeros(B, J) if grad_a_out is None else grad_a_out,
    )


def _squash_backward(ctx, tensors, state, grads):
    return [_ops._squash_backward(grads[0], tensors[0], *ctx.options)]


def _dynamic_routing_backward(ctx, tensors, s_hist, grads):
    votes, bias = tensors
    iters, leaky, detach, eps = ctx.options
    grad_votes, grad_bias = _ops._dynamic_routing_backward(
        grads[0], votes, s_hist, leaky, detach, eps
    )
    return [grad_votes, None if bias is None else grad_bias]


def _dense_capsules_backward(ctx, tensors, s_hist, grads):
    u, weight, bias = tensors
    iters, leaky, detach, eps = ctx.options
    grad_u, grad_weight, grad_bias = _ops._dense_capsules_backward(
        grads[0], u, weight, s_hist, leaky, detach, eps
    )
    return [grad_u, grad_weight, None if bias is None else grad_bias]


def _em_backward(ctx, tensors, stats, grads):
    iters, final_lambda, eps = ctx.options
    grad_pose, grad_a_out = _zeros_if_none(grads, stats, tensors[0].shape[3])
    return list(
        _ops._em_routing_backward(grad_pose, grad_a_out, *tensors, stats, final_lambda, eps)
    )


def _em_pose_backward(ctx, tensors, stats, grads):
    iters, final_lambda, eps = ctx.options
    grad_pose, grad_a_out = _zeros_if_none(grads, stats, 16)
    return list(
        _ops._em_routing_pose_backward(grad_pose, grad_a_out, *tensors, stats, final_lambda, eps)
    )


def _conv_em_backward(ctx, tensors, stats, grads):
    iters, stride, padding, final_lambda, eps = ctx.options
    grad_pose, grad_a_out = grads
    B, Ho, Wo, _, J, _ = stats.shape
    grad_pose = stats.new_zeros(B, Ho, Wo, J, 16) if grad_pose is None else grad_pose
    grad_a_out = stats.new_zeros(B, Ho, Wo, J) if grad_a_out is None else grad_a_out
    return list(
        _ops._conv_em_routing_backward(
            grad_pose, grad_a_out, *tensors, stats, stride, padding, final_lambda, eps
        )
    )


def _conv_dynamic_routing_backward(ctx, tensors, s_hist, grads):
    u, weight, bias = tensors
    iters, stride, padding, leaky, detach, eps = ctx.options
    grad_u, grad_weight, grad_bias = _ops._conv_dynamic_routing_backward(
        grads[0], u, weight, s_hist, stride, padding, leaky, detach, eps
    )
    return [grad_u, grad_weight, None if bias is None else grad_bias]


_register_autograd("squash", 1, 1, lambda s, eps: reference.squash(s, eps=eps), _squash_backward)
_register_autograd(
    "dynamic_routing",
    2,
    1,
    lambda votes, bias, iters, leaky, detach, eps: reference.dynamic_routing(
        votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
    ),
    _dynamic_routing_backward,
)
_register_autograd(
    "dense_capsules",
    3,
    1,
    lambda u, weight, bias, iters, leaky, detach, eps: reference.dense_capsules(
        u, weight, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
    ),
    _dense_capsules_backward,
)
_register_autograd(
    "em_routing",
    4,
    2,
    lambda *args: reference.em_routing(*args[:5], final_lambda=args[5], eps=args[6]),
    _em_backward,
)
_register_autograd(
    "em_routing_pose",
    5,
    2,
    lambda *args: reference.em_routing_pose(*args[:6], final_lambda=args[6], eps=args[7]),
    _em_pose_backward,
)
_register_autograd(
    "conv_em_routing",
    5,
    2,
    lambda *args: reference.conv_em_routing(
        *args[:6], stride=args[6], padding=args[7], final_lambda=args[8], eps=args[9]
    ),
    _conv_em_backward,
)

_register_autograd(
    "conv_dynamic_routing",
    3,
    1,
    lambda u, weight, bias, iters, stride, padding, leaky, detach, eps: (
        reference.conv_dynamic_routing(
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
    ),
    _conv_dynamic_routing_backward,
)

# ---- autocast: the rules of capsroute/_autocast.py, on the operators themselves ----

_lib = torch.library.Library("capsroute", "IMPL")
_autocast.register(_lib)
