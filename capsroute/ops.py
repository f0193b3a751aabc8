"""Typed Python API of the capsroute operators, with their autograd, fake and autocast implementations.

The schemas live in csrc/ops.cpp; the contract (math, shapes, saved state, errors) is docs/ops.md.
"""
import torch
from torch import Tensor

from . import _autocast

_ops = torch.ops.capsroute

# The public operators, in the order of csrc/ops.cpp. Each has a backward operator _<op>_backward
# that takes the saved state the forward returns.
OPS = ("squash", "dynamic_routing", "dense_capsules", "em_routing", "em_routing_pose")
SCHEMA_OPS = tuple(name for op in OPS for name in (op, f"_{op}_backward"))


def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """squash(s) = |s|^2 / (1 + |s|^2) * s / sqrt(|s|^2 + eps), over `dim`."""
    if dim in (-1, s.dim() - 1):
        return _ops.squash(s, eps)
    return _ops.squash(s.movedim(dim, -1), eps).movedim(-1, dim)


def dynamic_routing(votes: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                    detach: bool = False, eps: float = 1e-8) -> Tensor:
    """Routing by agreement (Sabour et al. 2017) over votes (B, I, J, D); returns v (B, J, D).

    Gradients are exact through every iteration w.r.t. votes and bias; with detach=True the
    coupling coefficients are constants in the backward pass.
    """
    return _ops.dynamic_routing(votes, bias, iters, leaky, detach, eps)[0]


def dynamic_routing_coupling(votes: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                             detach: bool = False, eps: float = 1e-8) -> tuple[Tensor, Tensor]:
    """Like dynamic_routing, also returning the final coupling coefficients c (B, I, J).

    c is for inspection: it is not differentiable (v is).
    """
    v, c, _ = _ops.dynamic_routing(votes, bias, iters, leaky, detach, eps)
    return v, c


def dense_capsules(u: Tensor, weight: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                   detach: bool = False, eps: float = 1e-8) -> Tensor:
    """Dynamic routing over votes_ij = weight_ij @ u_i, computed on the fly.

    u (B, I, Din), weight (I, J, D, Din), bias (J, D) or None; returns v (B, J, D).
    """
    return _ops.dense_capsules(u, weight, bias, iters, leaky, detach, eps)[0]


# ---- fake (meta) implementations: shapes and dtypes only, for torch.compile ----

def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _routing_outputs(like: Tensor, B: int, I: int, J: int, D: int, iters: int):
    return (like.new_empty(B, J, D), like.new_empty(B, I, J),
            like.new_empty(B, iters, J, D, dtype=_acc_dtype(like.dtype)))


@torch.library.register_fake("capsroute::squash")
def _(s, eps):
    return torch.empty_like(s)


@torch.library.register_fake("capsroute::_squash_backward")
def _(grad_v, s, eps):
    return torch.empty_like(s)


@torch.library.register_fake("capsroute::dynamic_routing")
def _(votes, bias, iters, leaky, detach, eps):
    B, I, J, D = votes.shape
    return _routing_outputs(votes, B, I, J, D, iters)


@torch.library.register_fake("capsroute::_dynamic_routing_backward")
def _(grad_v, votes, s_hist, leaky, detach, eps):
    return torch.empty_like(votes), votes.new_empty(votes.shape[2], votes.shape[3])


@torch.library.register_fake("capsroute::dense_capsules")
def _(u, weight, bias, iters, leaky, detach, eps):
    I, J, D, _ = weight.shape
    return _routing_outputs(u, u.shape[0], I, J, D, iters)


@torch.library.register_fake("capsroute::_dense_capsules_backward")
def _(grad_v, u, weight, s_hist, leaky, detach, eps):
    return torch.empty_like(u), torch.empty_like(weight), u.new_empty(weight.shape[1], weight.shape[2])


# ---- autograd ----

def _squash_setup(ctx, inputs, output):
    s, eps = inputs
    ctx.save_for_backward(s)
    ctx.eps = eps


def _squash_backward(ctx, grad_v):
    (s,) = ctx.saved_tensors
    return _ops._squash_backward(grad_v, s, ctx.eps), None


torch.library.register_autograd("capsroute::squash", _squash_backward, setup_context=_squash_setup)


def _routing_setup(ctx, inputs, output, vote_inputs):
    *tensors, bias, iters, leaky, detach, eps = inputs
    v, c, s_hist = output
    ctx.mark_non_differentiable(c, s_hist)
    ctx.save_for_backward(*tensors[:vote_inputs], s_hist)
    ctx.options = (leaky, detach, eps)
    ctx.has_bias = bias is not None


def _dynamic_routing_backward(ctx, grad_v, grad_c, grad_s_hist):
    votes, s_hist = ctx.saved_tensors
    grad_votes, grad_bias = _ops._dynamic_routing_backward(grad_v, votes, s_hist, *ctx.options)
    return grad_votes, grad_bias if ctx.has_bias else None, None, None, None, None


def _dense_capsules_backward(ctx, grad_v, grad_c, grad_s_hist):
    u, weight, s_hist = ctx.saved_tensors
    grad_u, grad_weight, grad_bias = _ops._dense_capsules_backward(grad_v, u, weight, s_hist, *ctx.options)
    return grad_u, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None


torch.library.register_autograd("capsroute::dynamic_routing", _dynamic_routing_backward,
                                setup_context=lambda ctx, inputs, output: _routing_setup(ctx, inputs, output, 1))
torch.library.register_autograd("capsroute::dense_capsules", _dense_capsules_backward,
                                setup_context=lambda ctx, inputs, output: _routing_setup(ctx, inputs, output, 2))


# ---- EM routing ----

def em_routing(votes: Tensor, a_in: Tensor, beta_u: Tensor, beta_a: Tensor, iters: int = 3, *,
               final_lambda: float = 0.01, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """EM routing for matrix capsules (Hinton et al. 2018): votes (B, I, J, H), a_in (B, I),
    beta_u and beta_a (J,) -> (pose (B, J, H), a_out (B, J)).

    Gradients are exact through every iteration w.r.t. votes, a_in, beta_u and beta_a. Sums over
    inputs are divided by m_j + eps, so an output capsule that receives no mass stays finite.
    """
    pose, a_out, _ = _ops.em_routing(votes, a_in, beta_u, beta_a, iters, final_lambda, eps)
    return pose, a_out


@torch.library.register_fake("capsroute::em_routing")
def _(votes, a_in, beta_u, beta_a, iters, final_lambda, eps):
    B, I, J, H = votes.shape
    return (votes.new_empty(B, J, H), votes.new_empty(B, J),
            votes.new_empty(B, iters, J, 2 * H + 1, dtype=_acc_dtype(votes.dtype)))


@torch.library.register_fake("capsroute::_em_routing_backward")
def _(grad_pose, grad_a_out, votes, a_in, beta_u, beta_a, stats, final_lambda, eps):
    return torch.empty_like(votes), torch.empty_like(a_in), torch.empty_like(beta_u), torch.empty_like(beta_a)


def _em_setup(ctx, inputs, output):
    votes, a_in, beta_u, beta_a, iters, final_lambda, eps = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(votes, a_in, beta_u, beta_a, output[2])
    ctx.options = (final_lambda, eps)


def _zeros_if_none(grad_pose, grad_a_out, stats, H):
    """Autograd passes None for an output that got no gradient; the backward ops want zeros."""
    B, J = stats.shape[0], stats.shape[2]
    if grad_pose is None:
        grad_pose = stats.new_zeros(B, J, H)
    if grad_a_out is None:
        grad_a_out = stats.new_zeros(B, J)
    return grad_pose, grad_a_out


def _em_backward(ctx, grad_pose, grad_a_out, grad_stats):
    votes, a_in, beta_u, beta_a, stats = ctx.saved_tensors
    grad_pose, grad_a_out = _zeros_if_none(grad_pose, grad_a_out, stats, votes.shape[3])
    grads = _ops._em_routing_backward(grad_pose, grad_a_out, votes, a_in, beta_u, beta_a, stats, *ctx.options)
    return (*grads, None, None, None)


torch.library.register_autograd("capsroute::em_routing", _em_backward, setup_context=_em_setup)


def em_routing_pose(pose: Tensor, weight: Tensor, a_in: Tensor, beta_u: Tensor, beta_a: Tensor, iters: int = 3, *,
                    final_lambda: float = 0.01, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """em_routing over votes_ij = pose_i @ weight_ij (4x4 matrices), computed on the fly and never
    stored: pose (B, I, 4, 4) or (B, I, 16), weight (I, J, 4, 4). Returns (pose (B, J, 16), a_out (B, J)),
    with gradients w.r.t. pose, weight, a_in, beta_u and beta_a."""
    if pose.dim() == 3 and pose.shape[-1] == 16:
        pose = pose.unflatten(-1, (4, 4))
    pose_out, a_out, _ = _ops.em_routing_pose(pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps)
    return pose_out, a_out


@torch.library.register_fake("capsroute::em_routing_pose")
def _(pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps):
    B, J = pose.shape[0], weight.shape[1]
    return (pose.new_empty(B, J, 16), pose.new_empty(B, J),
            pose.new_empty(B, iters, J, 33, dtype=_acc_dtype(pose.dtype)))


@torch.library.register_fake("capsroute::_em_routing_pose_backward")
def _(grad_pose_out, grad_a_out, pose, weight, a_in, beta_u, beta_a, stats, final_lambda, eps):
    return (torch.empty_like(pose), torch.empty_like(weight), torch.empty_like(a_in), torch.empty_like(beta_u),
            torch.empty_like(beta_a))


def _em_pose_setup(ctx, inputs, output):
    pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps = inputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(pose, weight, a_in, beta_u, beta_a, output[2])
    ctx.options = (final_lambda, eps)


def _em_pose_backward(ctx, grad_pose_out, grad_a_out, grad_stats):
    pose, weight, a_in, beta_u, beta_a, stats = ctx.saved_tensors
    grad_pose_out, grad_a_out = _zeros_if_none(grad_pose_out, grad_a_out, stats, 16)
    grads = _ops._em_routing_pose_backward(grad_pose_out, grad_a_out, pose, weight, a_in, beta_u, beta_a, stats,
                                           *ctx.options)
    return (*grads, None, None, None)


torch.library.register_autograd("capsroute::em_routing_pose", _em_pose_backward, setup_context=_em_pose_setup)


# ---- autocast: the rules of capsroute/_autocast.py, on the operators themselves ----

_lib = torch.library.Library("capsroute", "IMPL")
_autocast.register(_lib)
