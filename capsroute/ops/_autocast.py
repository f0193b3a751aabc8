"""The ops' autocast rules, declared once: capsroute.ops registers them on the operators and
capsroute.reference applies them to its plain-PyTorch versions, so under torch.autocast an op,
its reference and the layers built on either compute in the same dtypes.

- EM routing divides by variances of small pose differences: its inputs are cast to float32 and
  it runs with autocast off, as torch runs softmax and norms.
- Dynamic routing (dense and convolutional capsules too) and the attention routings take their
  inputs in the autocast dtype, as torch runs matmul (their kernels accumulate in float32 whatever
  the storage dtype).

As in torch's own rules, float64 tensors and tensors on another device type are left alone.
"""

import functools

import torch

IN_FLOAT32 = ("em_routing", "em_routing_pose", "conv_em_routing")
IN_AUTOCAST_DTYPE = (
    "dynamic_routing",
    "dense_capsules",
    "conv_dynamic_routing",
    "self_attention_routing",
    "inverted_attention_routing",
    "dense_self_attention_routing",
    "dense_inverted_attention_routing",
)
DEVICE_TYPES = ("cpu", "cuda")


def _cast(value, device_type: str, dtype: torch.dtype):
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
    ):
        return value.to(dtype)
    return value


def _rule_dtype(name: str, args) -> tuple[str, torch.dtype | None]:
    """The device type of args' tensors, and the dtype op `name`'s rule casts them to there (None
    outside autocast)."""
    device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
    if not torch.is_autocast_enabled(device_type):
        return device_type, None
    float32 = name in IN_FLOAT32
    return device_type, torch.float32 if float32 else torch.get_autocast_dtype(device_type)


def cast_arguments(name: str, args: tuple) -> tuple:
    """args as op `name`'s rule hands them to its kernel under autocast (as given outside autocast,
    or for an op without a rule)."""
    if name not in IN_FLOAT32 and name not in IN_AUTOCAST_DTYPE:
        return args
    device_type, dtype = _rule_dtype(name, args)
    return args if dtype is None else tuple(_cast(a, device_type, dtype) for a in args)


def _cast_outputs(out, device_type: str, dtype: torch.dtype):
    if isinstance(out, tuple):
        return tuple(_cast(o, device_type, dtype) for o in out)
    return _cast(out, device_type, dtype)


def register(lib: torch.library.Library):
    """Registers the rules on the capsroute:: operators (the backward operators run outside autocast)."""
    for name in IN_FLOAT32:
        for device_type in DEVICE_TYPES:
            torch.library.register_autocast(
                f"capsroute::{name}", device_type, torch.float32, lib=lib
            )
    for name in IN_AUTOCAST_DTYPE:
        for device_type in DEVICE_TYPES:
            lib.impl(
                name,
                _autocast_dtype_kernel(getattr(torch.ops.capsroute, name).default, device_type),
                "Autocast" + device_type.upper(),
            )


def _autocast_dtype_kernel(op, device_type: str):
    # torch.library.register_autocast takes one fixed dtype; these ops follow the autocast dtype.
    def kernel(*args, **options):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return op(*(_cast(a, device_type, dtype) for a in args), **options)

    return kernel


def like_op(name: str):
    """Decorates a plain-PyTorch function with the autocast rule of op `name` (its tensor arguments
    decide the device type). The autocast-dtype rule leaves autocast on inside, so plain PyTorch keeps
    torch's own per-op choices (the honest baseline); the float32 rule turns it off."""
    float32 = name in IN_FLOAT32
    assert float32 or name in IN_AUTOCAST_DTYPE, f"no autocast rule for {name}"

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            device_type, dtype = _rule_dtype(name, args)
            if dtype is None:
                return fn(*args, **kwargs)
            args = [_cast(a, device_type, dtype) for a in args]
            kwargs = {k: _cast(v, device_type, dtype) for k, v in kwargs.items()}
            if not float32:  # torch's per-op choices inside (CUDA's softmax and sums in float32)
                return _cast_outputs(fn(*args, **kwargs), device_type, dtype)
            with torch.autocast(device_type, enabled=False):
                return fn(*args, **kwargs)

        return wrapper

    return decorate
