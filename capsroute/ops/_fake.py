"""The fake (meta) implementations of the capsroute operators: shapes, dtypes and strides, for
torch.compile and torch.library.opcheck (registered on import, by capsroute.ops)."""

import functools

import torch
from torch import Tensor

from .._C import checks


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 for float64 storage, float32 for the others."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _symbolic(t: Tensor) -> bool:
    return any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride()))


def schema_arguments(op: str, args: tuple, kwargs: dict) -> tuple:
    """op's schema arguments as a call gives them, positional or by name, with the schema's
    defaults for those it leaves out."""
    rest = [
        kwargs[a.name] if a.name in kwargs else a.default_value for a in _schema(op)[len(args) :]
    ]
    return (*args, *rest)


def schema_names(op: str) -> tuple[str, ...]:
    """The names of op's schema arguments, in order."""
    return tuple(a.name for a in _schema(op))


def check_arguments(op: str, args) -> None:
    """op's argument checks on its schema arguments (defaults left out allowed): every tensor on one
    device, then the kernels' own (csrc/common/checks.h), which tensors with symbolic sizes
    (torch.compile's dynamic shapes) skip: they cannot read them."""
    named = list(zip(schema_names(op), schema_arguments(op, args, {})))
    tensors = [(name, a) for name, a in named if isinstance(a, Tensor)]
    ref_name, ref = tensors[0]
    for name, t in tensors[1:]:
        if t.device != ref.device:
            raise RuntimeError(
                f"capsroute: {name} is on {t.device} but {ref_name} is on {ref.device}"
            )
    if not any(_symbolic(t) for _, t in tensors):
        # (couplings, which asks for an output, has nothing to check)
        getattr(checks, op)(*(a for name, a in named if name != "couplings"))


@functools.cache
def _schema(op: str) -> tuple:
    return tuple(getattr(torch.ops.capsroute, op).default._schema.arguments)


def register_fake(op: str):
    """torch.library.register_fake for capsroute::<op>, checking its arguments first as the kernels
    do: torch.compile then refuses what eager refuses, with the same message, and one meta tensor
    among CPU ones (which sends the call here: the Meta dispatch key wins) is a device mismatch
    instead of outputs of uninitialized CPU memory."""

    def decorate(fake):
        @functools.wraps(fake)
        def checked(*args, **kwargs):
            args = schema_arguments(op, args, kwargs)
            check_arguments(op, args)
            return fake(*args)

        return torch.library.register_fake(f"capsroute::{op}")(checked)

    return decorate


def _contiguous(t: Tensor) -> Tensor:
    """An output the kernels allocate contiguous (every one but the capsule inputs' gradients)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _has_contiguous_capsules(t: Tensor, capsule_dims: int) -> bool:
    """Whether each of t's capsules, its last capsule_dims dims, is one contiguous run."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - capsule_dims, -1):
        if t.shape[d] != 1 and t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return True


def _capsule_gradient(t: Tensor, capsule_dims: int) -> Tensor:
    """The gradient of a capsule input as the kernels allocate it (csrc/common/layout.h,
    empty_capsule_gradient of with_contiguous_capsules): in t's layout where it is dense and its
    capsules (capsule_dims) contiguous, else contiguous."""
    contiguous = _contiguous(t)
    if not _has_contiguous_capsules(t, capsule_dims):
        return contiguous
    like = torch.empty_like(t)
    return like if _has_contiguous_capsules(like, capsule_dims) else contiguous


def _votes_gradient(votes: Tensor) -> Tensor:
    """The CUDA kernels read a row of J capsules at a time, the CPU ones a capsule (docs/ops.md,
    "Layouts")."""
    return _capsule_gradient(votes, 2 if votes.device.type == "cuda" else 1)


def _routing_outputs(like: Tensor, B: int, I: int, J: int, D: int, iters: int, couplings: bool):
    return (
        like.new_empty(B, J, D),
        like.new_empty(B, I, J) if couplings else like.new_empty(0),
        like.new_empty(B, iters, J, D, dtype=acc_dtype(like.dtype)),
    )


@register_fake("squash")
def _(s, eps):
    return _contiguous(s)


@register_fake("_squash_backward")
def _(grad_v, s, eps):
    return _contiguous(s)


@register_fake("dynamic_routing")
def _(votes, bias, iters, leaky, detach, eps, couplings):
    B, I, J, D = votes.shape
    return _routing_outputs(votes, B, I, J, D, iters, couplings)


@register_fake("_dynamic_routing_backward")
def _(grad_v, votes, s_hist, leaky, detach, eps):
    return (
        _votes_gradient(votes),
        votes.new_empty(votes.shape[2], votes.shape[3]),
    )


@register_fake("dense_capsules")
def _(u, weight, bias, iters, leaky, detach, eps, couplings):
    I, J, D, _ = weight.shape
    return _routing_outputs(u, u.shape[0], I, J, D, iters, couplings)


@register_fake("_dense_capsules_backward")
def _(grad_v, u, weight, s_hist, leaky, detach, eps):
    return (
        _contiguous(u),
        _contiguous(weight),
        u.new_empty(weight.shape[1], weight.shape[2]),
    )


@register_fake("em_routing")
def _(votes, a_in, beta_u, beta_a, iters, final_lambda, eps):
    B, I, J, H = votes.shape
    return (
        votes.new_empty(B, J, H),
        votes.new_empty(B, J),
        votes.new_empty(B, iters, J, 2 * H + 1, dtype=acc_dtype(votes.dtype)),
    )


@register_fake("_em_routing_backward")
def _(grad_pose, grad_a_out, votes, a_in, beta_u, beta_a, stats, final_lambda, eps):
    return (
        _votes_gradient(votes),
        _contiguous(a_in),
        _contiguous(beta_u),
        _contiguous(beta_a),
    )


@register_fake("em_routing_pose")
def _(pose, weight, a_in, beta_u, beta_a, iters, final_lambda, eps):
    B, J = pose.shape[0], weight.shape[1]
    return (
        pose.new_empty(B, J, 16),
        pose.new_empty(B, J),
        pose.new_empty(B, iters, J, 33, dtype=acc_dtype(pose.dtype)),
    )


@register_fake("_em_routing_pose_backward")
def _(grad_pose_out, grad_a_out, pose, weight, a_in, beta_u, beta_a, stats, final_lambda, eps):
    return (
        _capsule_gradient(pose, 2),
        _contiguous(weight),
        _contiguous(a_in),
        _contiguous(beta_u),
        _contiguous(beta_a),
    )


@register_fake("conv_em_routing")
def _(pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps):
    B, H, W = pose.shape[:3]
    K, C_out = weight.shape[0], weight.shape[3]
    Ho, Wo = conv_output_size(H, K, stride, padding), conv_output_size(W, K, stride, padding)
    return (
        pose.new_empty(B, Ho, Wo, C_out, 16),
        pose.new_empty(B, Ho, Wo, C_out),
        pose.new_empty(B, Ho, Wo, iters, C_out, 33, dtype=acc_dtype(pose.dtype)),
    )


@register_fake("_conv_em_routing_backward")
def _(
    grad_pose_out,
    grad_a_out,
    pose,
    a_in,
    weight,
    beta_u,
    beta_a,
    stats,
    stride,
    padding,
    final_lambda,
    eps,
):
    return (
        _contiguous(pose),
        _contiguous(a_in),
        _contiguous(weight),
        _contiguous(beta_u),
        _contiguous(beta_a),
    )


def conv_output_size(size: int, kernel_size: int, stride: int, padding: int) -> int:
    """The output positions along an axis of `size` input positions of a convolutional capsule
    layer."""
    return (size + 2 * padding - kernel_size) // stride + 1


@register_fake("conv_dynamic_routing")
def _(u, weight, bias, iters, stride, padding, leaky, detach, eps):
    B, H, W, C_in, _ = u.shape
    K, _, _, C_out, D, _ = weight.shape
    Ho, Wo = conv_output_size(H, K, stride, padding), conv_output_size(W, K, stride, padding)
    return (
        u.new_empty(B, Ho, Wo, C_out, D),
        u.new_empty(B, Ho, Wo, C_in, C_out),
        u.new_empty(B, Ho, Wo, iters, C_out, D, dtype=acc_dtype(u.dtype)),
    )


@register_fake("_conv_dynamic_routing_backward")
def _(grad_v, u, weight, s_hist, stride, padding, leaky, detach, eps):
    return (
        _contiguous(u),
        _contiguous(weight),
        u.new_empty(weight.shape[3], weight.shape[4]),
    )


@register_fake("self_attention_routing")
def _(votes, coupling_bias, squash, eps, couplings):
    B, I, J, D = votes.shape
    return _routing_outputs(votes, B, I, J, D, 2, couplings)


@register_fake("_self_attention_routing_backward")
def _(grad_v, votes, coupling_bias, s_hist, squash, eps):
    return _votes_gradient(votes), votes.new_empty(votes.shape[1], votes.shape[2])


@register_fake("inverted_attention_routing")
def _(votes, norm_weight, norm_bias, iters, eps, couplings):
    B, I, J, D = votes.shape
    return _routing_outputs(votes, B, I, J, D, iters, couplings)


@register_fake("_inverted_attention_routing_backward")
def _(grad_v, votes, norm_weight, norm_bias, s_hist, eps):
    D = votes.shape[3]
    return _votes_gradient(votes), votes.new_empty(D), votes.new_empty(D)


@register_fake("dense_self_attention_routing")
def _(u, weight, coupling_bias, squash, eps, couplings):
    I, J, D, _ = weight.shape
    return _routing_outputs(u, u.shape[0], I, J, D, 2, couplings)


@register_fake("_dense_self_attention_routing_backward")
def _(grad_v, u, weight, coupling_bias, s_hist, squash, eps):
    return (
        _contiguous(u),
        _contiguous(weight),
        u.new_empty(weight.shape[0], weight.shape[1]),
    )


@register_fake("dense_inverted_attention_routing")
def _(u, weight, norm_weight, norm_bias, iters, eps, couplings):
    I, J, D, _ = weight.shape
    return _routing_outputs(u, u.shape[0], I, J, D, iters, couplings)


@register_fake("_dense_inverted_attention_routing_backward")
def _(grad_v, u, weight, norm_weight, norm_bias, s_hist, eps):
    D = weight.shape[2]
    return (
        _contiguous(u),
        _contiguous(weight),
        u.new_empty(D),
        u.new_empty(D),
    )
