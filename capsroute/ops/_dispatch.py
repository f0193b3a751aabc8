"""What every op's Python function shares: the operators, when the reference computes instead, and
the argument text several docstrings share."""

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

from . import _autocast, _fake

fused_ops = torch.ops.capsroute


def reference_computes(op: str, *args) -> bool:
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


def with_args(text: str):
    """Fills the {args} of the decorated function's docstring: the arguments several ops share."""

    def decorate(fn):
        fn.__doc__ = fn.__doc__.format(args=text.strip("\n"))
        return fn

    return decorate
