"""The autograd implementations of the capsroute operators (registered on import, by
capsroute.ops): the fused backward operators to first order, the reference's autograd for a
gradient with a graph (docs/ops.md, "Derivatives")."""

import torch
from torch import Tensor

from . import reference
from ._fake import acc_dtype, schema_names

_ops = torch.ops.capsroute

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
    fused_backward(ctx, tensors, state, grads) the first-order gradients of the tensors. Neither
    sees the option `couplings`, which asks for an output without a gradient."""
    has_couplings = schema_names(name)[-1] == "couplings"

    def setup_context(ctx, inputs, output):
        tensors, options = inputs[:num_tensors], inputs[num_tensors:]
        if has_couplings:
            options = options[:-1]
        state = None
        if isinstance(output, tuple):
            ctx.mark_non_differentiable(*output[num_differentiable:])
            state = output[-1]
            # Autograd would otherwise pass zeros the size of the couplings and the saved state as
            # their gradients, which the backward drops.
            ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors, state)
        ctx.options = options
        ctx.no_gradients = (None,) * (len(inputs) - num_tensors)  # one per option
        ctx.reference = lambda *ts: reference_fn(*ts, *options)

    def backward(ctx, *grads):
        *tensors, state = ctx.saved_tensors
        grads = grads[:num_differentiable]
        if all(g is None for g in grads):
            return (*(None for _ in tensors), *ctx.no_gradients)
        if torch.is_grad_enabled():
            grads_in = _reference_vjp(ctx, tensors, grads)
        else:
            grads_in = fused_backward(ctx, tensors, state, grads)
        return (*grads_in, *ctx.no_gradients)

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


def _self_attention_routing_backward(ctx, tensors, s_hist, grads):
    votes, coupling_bias = tensors
    squash, eps = ctx.options
    grad_votes, grad_coupling_bias = _ops._self_attention_routing_backward(
        grads[0], votes, coupling_bias, s_hist, squash, eps
    )
    return [grad_votes, None if coupling_bias is None else grad_coupling_bias]


def _inverted_attention_routing_backward(ctx, tensors, s_hist, grads):
    votes, norm_weight, norm_bias = tensors
    iters, eps = ctx.options
    grad_votes, grad_norm_weight, grad_norm_bias = _ops._inverted_attention_routing_backward(
        grads[0], votes, norm_weight, norm_bias, s_hist, eps
    )
    return [
        grad_votes,
        None if norm_weight is None else grad_norm_weight,
        None if norm_bias is None else grad_norm_bias,
    ]


def _dense_self_attention_routing_backward(ctx, tensors, s_hist, grads):
    u, weight, coupling_bias = tensors
    squash, eps = ctx.options
    grad_u, grad_weight, grad_coupling_bias = _ops._dense_self_attention_routing_backward(
        grads[0], u, weight, coupling_bias, s_hist, squash, eps
    )
    return [grad_u, grad_weight, None if coupling_bias is None else grad_coupling_bias]


def _dense_inverted_attention_routing_backward(ctx, tensors, s_hist, grads):
    u, weight, norm_weight, norm_bias = tensors
    iters, eps = ctx.options
    grad_u, grad_weight, grad_norm_weight, grad_norm_bias = (
        _ops._dense_inverted_attention_routing_backward(
            grads[0], u, weight, norm_weight, norm_bias, s_hist, eps
        )
    )
    return [
        grad_u,
        grad_weight,
        None if norm_weight is None else grad_norm_weight,
        None if norm_bias is None else grad_norm_bias,
    ]


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
_register_autograd(
    "self_attention_routing",
    2,
    1,
    lambda votes, coupling_bias, squash, eps: reference.self_attention_routing(
        votes, coupling_bias=coupling_bias, squash=squash, eps=eps
    ),
    _self_attention_routing_backward,
)
_register_autograd(
    "inverted_attention_routing",
    3,
    1,
    lambda votes, norm_weight, norm_bias, iters, eps: reference.inverted_attention_routing(
        votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
    ),
    _inverted_attention_routing_backward,
)
_register_autograd(
    "dense_self_attention_routing",
    3,
    1,
    lambda u, weight, coupling_bias, squash, eps: reference.dense_self_attention_routing(
        u, weight, coupling_bias=coupling_bias, squash=squash, eps=eps
    ),
    _dense_self_attention_routing_backward,
)
_register_autograd(
    "dense_inverted_attention_routing",
    4,
    1,
    lambda u, weight, norm_weight, norm_bias, iters, eps: (
        reference.dense_inverted_attention_routing(
            u, weight, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    ),
    _dense_inverted_attention_routing_backward,
)
