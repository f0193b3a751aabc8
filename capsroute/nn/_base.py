"""What every capsule layer shares: the routing backends, the base class, the argument checks."""

import operator

from torch import nn

from .. import ops
from ..ops import reference

BACKENDS = {"fused": ops, "reference": reference}


def check_counts(**counts) -> None:
    """Constructor arguments that count capsules, values or positions: each an integer >= 1
    (numpy's too)."""
    for name, value in counts.items():
        try:
            valid = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def routing_ops(backend: str):
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}") from None


class CapsuleLayer(nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str):
        routing_ops(value)
        self._backend = value

    @property
    def ops(self):
        return routing_ops(self._backend)

    def extra_repr(self) -> str:
        return f"backend={self._backend!r}"


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Switches every capsule layer inside `module` to `backend`; returns the module."""
    for layer in module.modules():
        if isinstance(layer, CapsuleLayer):
            layer.backend = backend
    return module
