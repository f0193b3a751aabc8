"""One spec per public capsroute op: the table that tests/ops/test_op_contract.py runs every contract
check over (in the manner of extension-cpp's sample_inputs and torchvision's RoIOpTester).

A spec says how to call the op and its plain-PyTorch reference, how to draw sample inputs (random
values, odd sizes) per dtype, which outputs carry gradients, the tolerance against the float64
reference, and how to call the schema ops, forward and backward, directly. The per-op test files
use the same samplers for what is specific to their op. Adding an op: add a spec to OP_DB.
"""

from dataclasses import dataclass
from typing import Callable

import torch

import capsroute
from capsroute import reference
from capsroute.testing import (  # noqa: F401  (the per-op test files import them from here)
    conv_dynamic_inputs,
    conv_em_inputs,
    dense_inputs,
    dense_inverted_attention_inputs,
    dense_self_attention_inputs,
    em_activations_and_betas,
    em_inputs,
    em_pose_inputs,
    inverted_attention_inputs,
    routing_inputs,
    self_attention_inputs,
    squash_inputs,
    tolerance,
)
from helpers import randn

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@dataclass(frozen=True)
class Sample:
    """spec.fn(*tensors, **options). tensors are the differentiable inputs in the op's order (None for
    an absent optional one); options are the rest, complete and in the schema's order."""

    tensors: tuple
    options: dict

    def inputs(self) -> list:
        return [t for t in self.tensors if t is not None]


@dataclass(frozen=True)
class OpSpec:
    name: str
    fn: Callable  # capsroute's Python API: fn(*tensors, **options) -> outputs
    ref: Callable  # the same function from capsroute.reference
    make: Callable  # (shape, device, dtype) -> the sample's tensors
    defaults: dict  # the options of the schema op, in its order
    shapes: dict  # dtype -> sample shapes matched against the float64 reference
    input_names: tuple
    output_names: tuple  # the first `grad_outputs` outputs are differentiable
    grad_outputs: int
    backward_args: (
        Callable  # (sample, outputs of the schema op, output gradients) -> backward op arguments
    )
    gradcheck: list  # (shape, options): finite differences in float64 (small shapes)
    opcheck: (
        list  # (shape, options): torch.library.opcheck of both schema ops; the first is compiled
    )
    capsule_dims: int = (
        0  # the first input's capsule (read in place in every CAPSULE_LAYOUTS): its last dims
    )

    def tolerance(self, dtype) -> float:
        """The relative tolerance against the float64 reference."""
        return tolerance(self.name, dtype)

    @property
    def op(self):
        return getattr(torch.ops.capsroute, self.name).default

    @property
    def backward_op(self):
        return getattr(torch.ops.capsroute, f"_{self.name}_backward").default

    def sample(self, tensors, **options) -> Sample:
        unknown = set(options) - set(self.defaults)
        assert not unknown, f"{self.name} has no options {unknown}"
        return Sample(tuple(tensors), {**self.defaults, **options})

    def draw(self, shape, device, dtype, **options) -> Sample:
        """A random sample; options the schema does not know (bias=False) go to the sampler."""
        sampler_options = {k: options.pop(k) for k in list(options) if k not in self.defaults}
        return self.sample(self.make(shape, device, dtype, **sampler_options), **options)

    def samples(self, device, dtype) -> list[Sample]:
        return [self.draw(shape, device, dtype) for shape in self.shapes[dtype]]

    def schema_args(self, sample: Sample) -> tuple:
        return (*sample.tensors, *sample.options.values())

    def outputs(self, impl, sample: Sample) -> tuple:
        out = impl(*sample.tensors, **sample.options)
        return out if isinstance(out, tuple) else (out,)

    def run(self, impl, sample: Sample, cotangents=None, generator=None) -> tuple[list, list]:
        """(outputs and the gradients of sum(output * cotangent) w.r.t. the sample's tensors, the
        cotangents): random float64 ones unless given."""
        out = self.outputs(impl, sample)
        diff = out[: self.grad_outputs]
        if cotangents is None:
            cotangents = [randn(*o.shape, device=o.device, generator=generator) for o in diff]
        grads = torch.autograd.grad(
            diff, sample.inputs(), [g.to(o.dtype) for o, g in zip(diff, cotangents)]
        )
        return [*out, *grads], cotangents

    def compare(self, sample: Sample, generator=None) -> list[tuple]:
        """(name, capsroute's value, the float64 reference's value) for every output and gradient."""
        ref_sample = Sample(
            tuple(
                None if t is None else t.detach().double().requires_grad_() for t in sample.tensors
            ),
            sample.options,
        )
        ours, cotangents = self.run(self.fn, sample, generator=generator)
        ref, _ = self.run(self.ref, ref_sample, cotangents)
        return list(zip(self.names(sample), ours, ref))

    def names(self, sample: Sample) -> list[str]:
        """The names of what run returns: the outputs, then grad_<input> for every tensor given."""
        return [
            *self.output_names,
            *(f"grad_{n}" for n, t in zip(self.input_names, sample.tensors) if t is not None),
        ]


# ---- layouts: the same values laid out as einsum, permute and slicing leave them ----


def capsule_layout(t: torch.Tensor, layout: str, capsule_dims: int) -> torch.Tensor:
    """t's values (B, I, ..., capsule) in `layout`, a leaf like t, each capsule (the last
    capsule_dims dims) still contiguous (docs/ops.md, "Layouts"): "einsum" input-capsule-major, as
    torch.einsum("bik,ijdk->bijd", u, W) returns votes; "permute" the dims before the capsule stored
    in reverse order; "slice" every other input capsule of a tensor twice as long, each capsule a
    slice of a wider row (votes[:, ::2, :, 1:D + 1]: capsule and row strides not D), at an odd
    storage offset; "offset" contiguous but one value into its storage (not 16-byte aligned);
    "inner" the capsule's values every other one of a buffer (not readable in place: copied)."""
    x = t.detach()
    outer = x.dim() - capsule_dims
    if layout == "einsum":
        y = x.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "permute":
        order = [*reversed(range(outer)), *range(outer, x.dim())]
        y = x.permute(order).contiguous().permute(order)
    elif layout == "slice":
        flat = x.flatten(outer)  # a capsule's values as the last dim
        n = flat.shape[-1]
        wide = torch.zeros(
            flat.shape[0],
            2 * flat.shape[1],
            *flat.shape[2:-1],
            n + 3,
            dtype=x.dtype,
            device=x.device,
        )
        wide[:, ::2, ..., 1 : n + 1] = flat
        y = wide[:, ::2, ..., 1 : n + 1].unflatten(-1, x.shape[outer:])
    elif layout == "offset":
        storage = torch.zeros(x.numel() + 1, dtype=x.dtype, device=x.device)
        y = storage[1:].view(x.shape)
        y.copy_(x)
    elif layout == "inner":
        y = torch.stack([x, torch.zeros_like(x)], -1)[..., 0]
    else:
        raise ValueError(f"unknown layout {layout}")
    assert torch.equal(y, x)
    return y.requires_grad_(t.requires_grad)


CAPSULE_LAYOUTS = [
    "einsum",
    "permute",
    "slice",
    "offset",
]  # read in place by every op with capsule_dims


def _shapes(full_precision, low_precision):
    return {
        torch.float64: full_precision,
        torch.float32: full_precision,
        torch.float16: low_precision,
        torch.bfloat16: low_precision,
    }


SQUASH_SHAPES = [(7, 16), (3, 5, 8), (33,), (2, 0, 4)]
# Odd sizes: I and J not multiples of 32, D in {4, 8, 16, 32}.
ROUTING_SHAPES = [
    (3, 37, 7, 16),
    (2, 65, 33, 4),
    (1, 5, 1, 8),
    (4, 19, 10, 32),
    (2, 1, 3, 8),
    (2, 41, 5, 8),
]  # B, I, J, D
DENSE_SHAPES = [
    (3, 37, 7, 16, 8),
    (2, 65, 33, 4, 5),
    (1, 5, 1, 8, 1),
    (4, 19, 10, 32, 3),
]  # B, I, J, D, Din
EM_SHAPES = [
    (3, 37, 7, 16),
    (2, 19, 10, 4),
    (1, 5, 1, 16),
    (2, 33, 3, 1),
    (2, 21, 5, 8),
]  # B, I, J, H
EM_POSE_SHAPES = [(3, 37, 7), (1, 5, 1), (20, 9, 32)]  # B, I, J
# Odd grids; one window (K = H = W); K = 1.
CONV_EM_SHAPES = [
    (2, 5, 6, 3, 4, 3),
    (1, 4, 4, 2, 3, 4),
    (2, 3, 7, 2, 5, 2),
    (1, 3, 3, 5, 2, 1),
]  # B, H, W, C_in, C_out, K
# Odd grids; one window (K = H = W); K = 1; D from 4 to 32 (tests/ops/test_conv_dynamic_routing.py: strides
# and paddings).
CONV_DYNAMIC_SHAPES = [
    (2, 5, 6, 3, 4, 8, 5, 3),
    (1, 4, 4, 2, 3, 16, 8, 4),
    (2, 3, 7, 1, 5, 4, 3, 2),
    (1, 3, 3, 5, 2, 32, 2, 1),
]  # B, H, W, C_in, C_out, D, Din, K

SQUASH = OpSpec(
    name="squash",
    fn=lambda s, eps: capsroute.squash(s, eps=eps),
    ref=lambda s, eps: reference.squash(s, eps=eps),
    make=squash_inputs,
    defaults=dict(eps=1e-8),
    shapes=_shapes(SQUASH_SHAPES, SQUASH_SHAPES),
    input_names=("s",),
    output_names=("v",),
    grad_outputs=1,
    backward_args=lambda sample, out, grads: (*grads, *sample.tensors, sample.options["eps"]),
    gradcheck=[((5, 7), {})],
    opcheck=[((5, 7), {})],
)

DYNAMIC_ROUTING = OpSpec(
    name="dynamic_routing",
    fn=lambda votes, bias, **options: capsroute.dynamic_routing_coupling(
        votes, bias=bias, **options
    ),
    ref=lambda votes, bias, **options: reference.dynamic_routing_coupling(
        votes, bias=bias, **options
    ),
    make=routing_inputs,
    defaults=dict(iters=3, leaky=False, detach=False, eps=1e-8),
    shapes=_shapes(ROUTING_SHAPES, [(4, 37, 10, 16)]),
    input_names=("votes", "bias"),
    output_names=("v", "c"),
    grad_outputs=1,  # the coupling c is for inspection
    backward_args=lambda sample, out, grads: (
        *grads,
        sample.tensors[0],
        out[2],
        *list(sample.options.values())[1:],
    ),
    # With detach=True the coupling is a constant: no finite differences (test_dynamic_routing checks it).
    gradcheck=[((2, 5, 3, 4), dict(leaky=False)), ((2, 5, 3, 4), dict(leaky=True))],
    opcheck=[
        ((2, 7, 3, 4), {}),
        ((2, 7, 3, 4), dict(bias=False, iters=2, leaky=True, detach=True)),
    ],
    capsule_dims=1,
)

DENSE_CAPSULES = OpSpec(
    name="dense_capsules",
    fn=lambda u, weight, bias, **options: capsroute.dense_capsules(u, weight, bias=bias, **options),
    ref=lambda u, weight, bias, **options: reference.dense_capsules(
        u, weight, bias=bias, **options
    ),
    make=dense_inputs,
    defaults=dict(iters=3, leaky=False, detach=False, eps=1e-8),
    shapes=_shapes(DENSE_SHAPES, [(4, 37, 10, 16, 8)]),
    input_names=("u", "weight", "bias"),
    output_names=("v",),
    grad_outputs=1,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors[:2],
        out[2],
        *list(sample.options.values())[1:],
    ),
    gradcheck=[((2, 4, 3, 4, 3), dict(leaky=True))],
    opcheck=[
        ((2, 5, 3, 4, 3), {}),
        ((2, 5, 3, 4, 3), dict(bias=False, iters=2, leaky=True, detach=True)),
    ],
    capsule_dims=1,
)

EM_ROUTING = OpSpec(
    name="em_routing",
    fn=capsroute.em_routing,
    ref=reference.em_routing,
    make=em_inputs,
    defaults=dict(iters=3, final_lambda=0.01, eps=1e-6),
    shapes=_shapes(EM_SHAPES, [(3, 37, 10, 16)]),
    input_names=("votes", "a_in", "beta_u", "beta_a"),
    output_names=("pose", "a_out"),
    grad_outputs=2,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors,
        out[2],
        *list(sample.options.values())[1:],
    ),
    gradcheck=[((2, 5, 3, 4), dict(final_lambda=0.5))],
    opcheck=[((2, 7, 3, 4), {})],
    capsule_dims=1,
)

EM_ROUTING_POSE = OpSpec(
    name="em_routing_pose",
    fn=capsroute.em_routing_pose,
    ref=reference.em_routing_pose,
    make=em_pose_inputs,
    defaults=dict(iters=3, final_lambda=0.01, eps=1e-6),
    shapes=_shapes(EM_POSE_SHAPES, [(3, 37, 10)]),
    input_names=("pose", "weight", "a_in", "beta_u", "beta_a"),
    output_names=("pose", "a_out"),
    grad_outputs=2,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors,
        out[2],
        *list(sample.options.values())[1:],
    ),
    gradcheck=[((2, 3, 2), dict(iters=2, final_lambda=0.5))],
    opcheck=[((2, 3, 2), {})],
    capsule_dims=2,
)

CONV_EM_ROUTING = OpSpec(
    name="conv_em_routing",
    fn=capsroute.conv_em_routing,
    ref=reference.conv_em_routing,
    make=conv_em_inputs,
    defaults=dict(iters=3, stride=1, padding=0, final_lambda=0.01, eps=1e-6),
    shapes=_shapes(CONV_EM_SHAPES, [(2, 5, 5, 3, 4, 3)]),
    input_names=("pose", "a_in", "weight", "beta_u", "beta_a"),
    output_names=("pose", "a_out"),
    grad_outputs=2,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors,
        out[2],
        *list(sample.options.values())[1:],
    ),
    gradcheck=[
        ((1, 4, 3, 2, 2, 2), dict(iters=3, final_lambda=0.5)),
        ((1, 4, 5, 1, 2, 3), dict(iters=2, stride=2, padding=1, final_lambda=0.5)),
    ],
    opcheck=[((2, 4, 4, 2, 3, 2), dict(stride=2, padding=1))],
)

CONV_DYNAMIC_ROUTING = OpSpec(
    name="conv_dynamic_routing",
    fn=lambda u, weight, bias, **options: capsroute.conv_dynamic_routing(
        u, weight, bias=bias, **options
    ),
    ref=lambda u, weight, bias, **options: reference.conv_dynamic_routing(
        u, weight, bias=bias, **options
    ),
    make=conv_dynamic_inputs,
    defaults=dict(iters=3, stride=1, padding=0, leaky=False, detach=False, eps=1e-8),
    shapes=_shapes(CONV_DYNAMIC_SHAPES, [(2, 5, 5, 3, 4, 16, 8, 3)]),
    input_names=("u", "weight", "bias"),
    output_names=("v",),
    grad_outputs=1,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors[:2],
        out[2],
        *list(sample.options.values())[1:],
    ),
    gradcheck=[
        ((1, 4, 3, 2, 3, 4, 2, 2), dict(leaky=True)),
        ((1, 4, 5, 1, 2, 4, 3, 3), dict(iters=2, stride=2, padding=1)),
    ],
    opcheck=[
        ((2, 4, 4, 2, 3, 4, 3, 2), dict(stride=2, padding=1)),
        ((1, 3, 4, 2, 2, 4, 2, 3), dict(bias=False, iters=2, leaky=True, detach=True, padding=1)),
    ],
)

SELF_ATTENTION_ROUTING = OpSpec(
    name="self_attention_routing",
    fn=lambda votes, coupling_bias, **options: capsroute.self_attention_routing_coupling(
        votes, coupling_bias=coupling_bias, **options
    ),
    ref=lambda votes, coupling_bias, **options: reference.self_attention_routing_coupling(
        votes, coupling_bias=coupling_bias, **options
    ),
    make=self_attention_inputs,
    defaults=dict(squash="efficient", eps=1e-8),
    shapes=_shapes(ROUTING_SHAPES, [(4, 37, 10, 16)]),
    input_names=("votes", "coupling_bias"),
    output_names=("v", "c"),
    grad_outputs=1,  # the coupling c is for inspection
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors,
        out[2],
        *sample.options.values(),
    ),
    gradcheck=[((2, 5, 3, 4), {}), ((2, 5, 3, 4), dict(squash="sabour"))],
    opcheck=[((2, 7, 3, 4), {}), ((2, 7, 3, 4), dict(coupling_bias=False, squash="sabour"))],
    capsule_dims=1,
)

INVERTED_ATTENTION_ROUTING = OpSpec(
    name="inverted_attention_routing",
    fn=lambda votes, norm_weight, norm_bias, **options: (
        capsroute.inverted_attention_routing_coupling(
            votes, norm_weight=norm_weight, norm_bias=norm_bias, **options
        )
    ),
    ref=lambda votes, norm_weight, norm_bias, **options: (
        reference.inverted_attention_routing_coupling(
            votes, norm_weight=norm_weight, norm_bias=norm_bias, **options
        )
    ),
    make=inverted_attention_inputs,
    defaults=dict(iters=3, eps=1e-5),
    shapes=_shapes(ROUTING_SHAPES, [(4, 37, 10, 16)]),
    input_names=("votes", "norm_weight", "norm_bias"),
    output_names=("v", "c"),
    grad_outputs=1,
    backward_args=lambda sample, out, grads: (
        *grads,
        *sample.tensors,
        out[2],
        sample.options["eps"],
    ),
    gradcheck=[((2, 5, 3, 4), {}), ((2, 5, 3, 4), dict(iters=2, weight=False, bias=False))],
    opcheck=[((2, 7, 3, 4), {}), ((2, 7, 3, 4), dict(iters=1, weight=False))],
    capsule_dims=1,
)

DENSE_SELF_ATTENTION_ROUTING = OpSpec(
    name="dense_self_attention_routing",
    fn=lambda u, weight, coupling_bias, **options: capsroute.dense_self_attention_routing(
        u, weight, coupling_bias=coupling_bias, **options
    ),
    ref=lambda u, weight, coupling_bias, **options: reference.dense_self_attention_routing(
        u, weight, coupling_bias=coupling_bias, **options
    ),
    make=dense_self_attention_inputs,
    defaults=SELF_ATTENTION_ROUTING.defaults,
    shapes=_shapes(DENSE_SHAPES, [(4, 37, 10, 16, 8)]),
    input_names=("u", "weight", "coupling_bias"),
    output_names=("v",),
    grad_outputs=1,
    backward_args=SELF_ATTENTION_ROUTING.backward_args,
    gradcheck=[((2, 5, 3, 4, 3), {}), ((2, 5, 3, 4, 3), dict(squash="sabour"))],
    opcheck=[((2, 7, 3, 4, 3), {}), ((2, 7, 3, 4, 3), dict(coupling_bias=False, squash="sabour"))],
    capsule_dims=1,
)

DENSE_INVERTED_ATTENTION_ROUTING = OpSpec(
    name="dense_inverted_attention_routing",
    fn=lambda u, weight, norm_weight, norm_bias, **options: (
        capsroute.dense_inverted_attention_routing(
            u, weight, norm_weight=norm_weight, norm_bias=norm_bias, **options
        )
    ),
    ref=lambda u, weight, norm_weight, norm_bias, **options: (
        reference.dense_inverted_attention_routing(
            u, weight, norm_weight=norm_weight, norm_bias=norm_bias, **options
        )
    ),
    make=dense_inverted_attention_inputs,
    defaults=INVERTED_ATTENTION_ROUTING.defaults,
    shapes=_shapes(DENSE_SHAPES, [(4, 37, 10, 16, 8)]),
    input_names=("u", "weight", "norm_weight", "norm_bias"),
    output_names=("v",),
    grad_outputs=1,
    backward_args=INVERTED_ATTENTION_ROUTING.backward_args,
    gradcheck=[((2, 5, 3, 4, 3), {}), ((2, 5, 3, 4, 3), dict(iters=2, weight=False, bias=False))],
    opcheck=[((2, 7, 3, 4, 3), {}), ((2, 7, 3, 4, 3), dict(iters=1, weight=False))],
    capsule_dims=1,
)

OP_DB = [
    SQUASH,
    DYNAMIC_ROUTING,
    DENSE_CAPSULES,
    EM_ROUTING,
    EM_ROUTING_POSE,
    CONV_EM_ROUTING,
    CONV_DYNAMIC_ROUTING,
    SELF_ATTENTION_ROUTING,
    INVERTED_ATTENTION_ROUTING,
    DENSE_SELF_ATTENTION_ROUTING,
    DENSE_INVERTED_ATTENTION_ROUTING,
]
