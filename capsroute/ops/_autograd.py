"""The gradients with a graph of the capsroute operators: their autograd is C++ (csrc/autograd.cpp),
whose backward runs the fused backward operator, or, when the engine builds a graph of the gradient
(create_graph=True), calls reference_vjp below, which differentiates the reference at the saved
inputs so that every higher derivative is exact (docs/ops.md, "Derivatives"). Registered on
import, by capsroute.ops."""

import torch

from .._C import set_reference_vjp
from . import reference
from ._fake import acc_dtype, schema_names


def reference_vjp(op: str, inputs: list, options: list, grads: list, needs_grad: list) -> list:
    """The vector-Jacobian product of op's reference at `inputs`, as a graph, in the accumulation
    dtype; None for the inputs that need no gradient."""
    wanted = [i for i, t in enumerate(inputs) if t is not None and needs_grad[i]]
    result = [None] * len(inputs)
    if not wanted:
        return result
    if schema_names(op)[-1] == "couplings":
        options = options[:-1]
    like = inputs[wanted[0]]
    acc = acc_dtype(like.dtype)
    with torch.enable_grad(), torch.autocast(like.device.type, enabled=False):
        # An alias per input: a tensor passed as two inputs gets each one's gradient once.
        aliases = {i: inputs[i].view_as(inputs[i]) for i in wanted}
        args = [aliases.get(i, t) for i, t in enumerate(inputs)]
        outputs = REFERENCES[op](*(None if t is None else t.to(acc) for t in args), *options)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, g.to(out.dtype)) for out, g in zip(outputs, grads) if g is not None]
        grads_in = torch.autograd.grad(
            [p[0] for p in pairs],
            list(aliases.values()),
            [p[1] for p in pairs],
            create_graph=True,
            allow_unused=True,
            materialize_grads=True,
        )
    for i, g in zip(wanted, grads_in):
        result[i] = g.to(inputs[i].dtype)
    return result


# Each operator's reference: its differentiable outputs in plain PyTorch, from the op's inputs and
# options (without `couplings`, which asks for an output without a gradient).
REFERENCES = {
    "squash": lambda s, eps: reference.squash(s, eps=eps),
    "dynamic_routing": lambda votes, bias, iters, leaky, detach, eps: reference.dynamic_routing(
        votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
    ),
    "dense_capsules": lambda u, weight, bias, iters, leaky, detach, eps: reference.dense_capsules(
        u, weight, iters, bias=bias, leaky=leaky, detach=detach, eps=eps
    ),
    "em_routing": lambda *args: reference.em_routing(*args[:5], final_lambda=args[5], eps=args[6]),
    "em_routing_pose": lambda *args: reference.em_routing_pose(
        *args[:6], final_lambda=args[6], eps=args[7]
    ),
    "conv_em_routing": lambda *args: reference.conv_em_routing(
        *args[:6], stride=args[6], padding=args[7], final_lambda=args[8], eps=args[9]
    ),
    "conv_dynamic_routing": lambda u, weight, bias, iters, stride, padding, leaky, detach, eps: (
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
    "self_attention_routing": lambda votes, coupling_bias, squash, eps: (
        reference.self_attention_routing(votes, coupling_bias=coupling_bias, squash=squash, eps=eps)
    ),
    "inverted_attention_routing": lambda votes, norm_weight, norm_bias, iters, eps: (
        reference.inverted_attention_routing(
            votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    ),
    "dense_self_attention_routing": lambda u, weight, coupling_bias, squash, eps: (
        reference.dense_self_attention_routing(
            u, weight, coupling_bias=coupling_bias, squash=squash, eps=eps
        )
    ),
    "dense_inverted_attention_routing": lambda u, weight, norm_weight, norm_bias, iters, eps: (
        reference.dense_inverted_attention_routing(
            u, weight, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
        )
    ),
}

set_reference_vjp(reference_vjp)
