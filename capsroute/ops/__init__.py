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

# _fake and _autograd register the fake and autograd implementations.
from . import _autocast, _autograd, _fake, reference  # noqa: F401
from .agreement import (
    conv_dynamic_routing,
    dense_capsules,
    dynamic_routing,
    dynamic_routing_coupling,
    squash,
)
from .attention import (
    dense_inverted_attention_routing,
    dense_inverted_attention_routing_pose,
    dense_self_attention_routing,
    inverted_attention_routing,
    inverted_attention_routing_coupling,
    pose_block_weight,
    self_attention_routing,
    self_attention_routing_coupling,
)
from .em import conv_em_routing, em_routing, em_routing_pose

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


# ---- autocast: the rules of capsroute/ops/_autocast.py, on the operators themselves ----

_lib = torch.library.Library("capsroute", "IMPL")
_autocast.register(_lib)


__all__ = [
    "OPS",
    "SCHEMA_OPS",
    "conv_dynamic_routing",
    "conv_em_routing",
    "dense_capsules",
    "dense_inverted_attention_routing",
    "dense_inverted_attention_routing_pose",
    "dense_self_attention_routing",
    "dynamic_routing",
    "dynamic_routing_coupling",
    "em_routing",
    "em_routing_pose",
    "inverted_attention_routing",
    "inverted_attention_routing_coupling",
    "pose_block_weight",
    "reference",
    "self_attention_routing",
    "self_attention_routing_coupling",
    "squash",
]
