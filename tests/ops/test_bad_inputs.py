"""docs/ops.md, "Bad input": bad input raises an error that says what is wrong (wrong dtypes: test_op_contract);
strides the kernels read in place, copy, or refuse, never with a wrong result."""

import math
import random
from dataclasses import replace

import pytest
import torch

import capsroute
from helpers import HAS_CUDA, assert_rel_close, randn
from op_db import OP_DB, capsule_layout


def votes(*shape, **kw):
    return randn(*(shape or (2, 5, 3, 4)), **kw)


# (call(device), the message it raises): through capsroute's functions, the kernels' checks.
BAD_INPUTS = [
    (
        lambda d: capsroute.dynamic_routing(votes(2, 5, 3, device=d)),
        r"votes must have shape \(B, I, J, D\)",
    ),
    (
        lambda d: capsroute.dynamic_routing(votes(device=d), bias=randn(4, 3, device=d)),
        r"bias must have shape \(J, D\) = \(3, 4\)",
    ),
    (
        lambda d: capsroute.dynamic_routing(votes(device=d), iters=0),
        "iters must be >= 1, got 0",
    ),
    (
        lambda d: capsroute.dynamic_routing(votes(device=d), eps=float("nan")),
        "eps must be finite",
    ),
    (
        lambda d: capsroute.dynamic_routing(votes(device=d), eps=float("inf")),
        "eps must be finite",
    ),
    (
        lambda d: capsroute.dynamic_routing(votes(device=d), eps=-1.0),
        "eps must be finite and >= 0",
    ),
    (lambda d: capsroute.dynamic_routing(votes(2, 5, 0, 4, device=d)), "J >= 1"),
    (
        lambda d: capsroute.dense_capsules(randn(2, 5, device=d), randn(5, 3, 4, 8, device=d)),
        r"u must have shape \(B, I, Din\)",
    ),
    (
        lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, device=d)),
        r"weight must have shape \(I, J, D, Din\)",
    ),
    (
        lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(6, 3, 4, 8, device=d)),
        "I = 5 and Din = 8",
    ),
    (
        lambda d: capsroute.dense_capsules(randn(2, 5, 8, device=d), randn(5, 3, 4, 7, device=d)),
        "I = 5 and Din = 8",
    ),
    (
        lambda d: capsroute.dense_capsules(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), iters=-2
        ),
        "iters must be >= 1",
    ),
    (
        lambda d: capsroute.dense_capsules(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), bias=randn(3, 5, device=d)
        ),
        r"bias must have shape \(J, D\)",
    ),
    (lambda d: capsroute.squash(randn(3, 4, device=d), eps=float("nan")), "eps must be finite"),
    (
        lambda d: capsroute.self_attention_routing(votes(2, 5, 3, device=d)),
        r"votes must have shape \(B, I, J, D\)",
    ),
    (
        lambda d: capsroute.self_attention_routing(
            votes(device=d), coupling_bias=randn(3, 5, device=d)
        ),
        r"coupling_bias must have shape \(I, J\) = \(5, 3\), got shape \[3, 5\]",
    ),
    (
        lambda d: capsroute.self_attention_routing(votes(device=d), squash="hinton"),
        'squash must be "efficient" or "sabour", got "hinton"',
    ),
    (
        lambda d: capsroute.self_attention_routing(votes(device=d), eps=-1.0),
        "eps must be finite and >= 0",
    ),
    (lambda d: capsroute.self_attention_routing(votes(2, 5, 3, 0, device=d)), "D >= 1"),
    (
        lambda d: torch.ops.capsroute._self_attention_routing_backward(
            randn(2, 3, 4, device=d),
            votes(device=d),
            None,
            randn(2, 3, 3, 4, device=d),
            "efficient",
            1e-8,
        ),
        r"s_hist must have shape \(2, 2, 3, 4\)",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(votes(2, 5, 3, device=d)),
        r"votes must have shape \(B, I, J, D\)",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(
            votes(device=d), norm_weight=randn(3, device=d)
        ),
        r"norm_weight must have shape \(D,\) = \(4,\), got shape \[3\]",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(
            votes(device=d), norm_bias=randn(1, 4, device=d)
        ),
        r"norm_bias must have shape \(D,\) = \(4,\), got shape \[1, 4\]",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(votes(device=d), iters=0),
        "iters must be >= 1, got 0",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(votes(device=d), eps=0.0),
        "eps must be finite and > 0",
    ),
    (
        lambda d: capsroute.inverted_attention_routing(votes(device=d), eps=float("nan")),
        "eps must be finite and > 0",
    ),
    (lambda d: capsroute.inverted_attention_routing(votes(2, 5, 0, 4, device=d)), "J >= 1"),
    (
        lambda d: capsroute.dense_self_attention_routing(
            randn(2, 5, device=d), randn(5, 3, 4, 8, device=d)
        ),
        r"u must have shape \(B, I, Din\)",
    ),
    (
        lambda d: capsroute.dense_self_attention_routing(
            randn(2, 5, 8, device=d),
            randn(5, 3, 4, 8, device=d),
            coupling_bias=randn(3, 5, device=d),
        ),
        r"coupling_bias must have shape \(I, J\) = \(5, 3\)",
    ),
    (
        lambda d: capsroute.dense_self_attention_routing(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), squash="hinton"
        ),
        "squash must be",
    ),
    (
        lambda d: torch.ops.capsroute._dense_self_attention_routing_backward(
            randn(2, 3, 4, device=d),
            randn(2, 5, 8, device=d),
            randn(5, 3, 4, 8, device=d),
            None,
            randn(2, 3, 3, 4, device=d),
            "efficient",
            1e-8,
        ),
        r"s_hist must have shape \(2, 2, 3, 4\)",
    ),
    (
        lambda d: capsroute.dense_inverted_attention_routing(
            randn(2, 5, 8, device=d), randn(6, 3, 4, 8, device=d)
        ),
        "I = 5 and Din = 8",
    ),
    (
        lambda d: capsroute.dense_inverted_attention_routing(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), norm_bias=randn(8, device=d)
        ),
        r"norm_bias must have shape \(D,\) = \(4,\), got shape \[8\]",
    ),
    (
        lambda d: capsroute.dense_inverted_attention_routing(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), iters=0
        ),
        "iters must be >= 1, got 0",
    ),
    (
        lambda d: capsroute.dense_inverted_attention_routing(
            randn(2, 5, 8, device=d), randn(5, 3, 4, 8, device=d), eps=0.0
        ),
        "eps must be finite and > 0",
    ),
    (
        lambda d: capsroute.dense_inverted_attention_routing(
            randn(2, 5, 8, device=d),
            randn(5, 3, 4, 8, device=d),
            norm_weight=randn(4, device=d, dtype=torch.float32),
        ),
        "norm_weight has dtype Float but u has dtype Double",
    ),
]


@pytest.mark.parametrize("call,message", BAD_INPUTS)
def test_bad_input_raises_a_clear_error(device, call, message):
    with pytest.raises(RuntimeError, match=message):
        call(device)


@pytest.mark.parametrize("call,message", BAD_INPUTS)
def test_meta_tensors_are_refused_alike(call, message):
    """The fakes run the kernels' checks (capsroute._C.checks): meta tensors, and torch.compile's
    fake ones, are refused with eager's message."""
    with pytest.raises(RuntimeError, match=message):
        call("meta")


def test_torch_compile_refuses_what_eager_refuses():
    torch._dynamo.reset()
    compiled = torch.compile(capsroute.dynamic_routing, fullgraph=True)
    with pytest.raises(Exception, match=r"votes must have shape \(B, I, J, D\)"):
        compiled(votes(2, 5, 3))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda v: capsroute.dynamic_routing(v, bias=v.new_ones(4)), r"bias must have shape"),
        (lambda v: capsroute.dynamic_routing(v, 0), "iters must be >= 1, got 0"),
        (lambda v: capsroute.dynamic_routing(v, eps=-1.0), "eps must be finite and >= 0"),
        (lambda v: capsroute.self_attention_routing(v, squash="foo"), "squash must be"),
        (lambda v: capsroute.inverted_attention_routing(v, 0), "iters must be >= 1, got 0"),
        (
            lambda v: capsroute.self_attention_routing(v, coupling_bias=v.new_ones(3)),
            "coupling_bias must have shape",
        ),
    ],
)
def test_transforms_refuse_what_eager_refuses(call, message):
    """Under forward mode and torch.func the reference computes, after the kernels' checks."""
    v = votes()
    with pytest.raises(RuntimeError, match=message):
        torch.func.jvp(call, (v,), (torch.ones_like(v),))
    with pytest.raises(RuntimeError, match=message):
        torch.func.vmap(call)(v.unsqueeze(0))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device for a device mismatch")
def test_device_mismatch():
    with pytest.raises(RuntimeError, match="bias is on"):
        capsroute.dynamic_routing(votes(device="cuda"), bias=randn(3, 4))
    with pytest.raises(RuntimeError, match="weight is on"):
        capsroute.dense_capsules(randn(2, 5, 8, device="cuda"), randn(5, 3, 4, 8))
    with pytest.raises(RuntimeError, match="coupling_bias is on"):
        capsroute.self_attention_routing(votes(device="cuda"), coupling_bias=randn(5, 3))
    with pytest.raises(RuntimeError, match="norm_weight is on"):
        capsroute.inverted_attention_routing(votes(device="cuda"), norm_weight=randn(4))
    u, weight = randn(2, 5, 8, device="cuda"), randn(5, 3, 4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="coupling_bias is on cpu but u is on"):
        capsroute.dense_self_attention_routing(u, weight, coupling_bias=randn(5, 3))
    with pytest.raises(RuntimeError, match="norm_bias is on cpu but u is on"):
        capsroute.dense_inverted_attention_routing(u, weight, norm_bias=randn(4))


def forward_and_backward_args(spec):
    """A detached sample of spec's opcheck shape and the backward operator's arguments after it."""
    shape, options = spec.opcheck[0]
    sample = spec.draw(shape, "cpu", torch.float64, **options)
    sample = replace(
        sample, tensors=tuple(None if t is None else t.detach() for t in sample.tensors)
    )
    out = spec.op(*spec.schema_args(sample))
    out = out if isinstance(out, tuple) else (out,)
    grads = [torch.ones_like(o) for o in out[: spec.grad_outputs]]
    return sample, spec.backward_args(sample, out, grads)


@pytest.mark.parametrize("spec", OP_DB, ids=lambda spec: spec.name)
def test_a_meta_tensor_among_cpu_ones(spec):
    """One meta tensor sends the call to the fake (the Meta dispatch key wins), which refuses the
    devices' mismatch as the kernels do, instead of returning uninitialized CPU memory."""
    sample, (grad, *rest) = forward_and_backward_args(spec)
    inputs = sample.tensors
    for k, t in enumerate(inputs[1:], start=1):
        if t is not None:
            moved = replace(sample, tensors=(*inputs[:k], t.to("meta"), *inputs[k + 1 :]))
            with pytest.raises(RuntimeError, match=r"is on meta but \w+ is on cpu"):
                spec.op(*spec.schema_args(moved))
    with pytest.raises(RuntimeError, match=r"is on cpu but grad_\w+ is on meta"):
        spec.backward_op(grad.to("meta"), *rest)


@pytest.mark.parametrize("spec", OP_DB, ids=lambda spec: spec.name)
def test_backward_operators_refuse_integer_gradients(spec):
    """An integer gradient would be converted and give a wrong result: refused instead."""
    _, (grad, *rest) = forward_and_backward_args(spec)
    with pytest.raises(RuntimeError, match=r"grad_\w+ must be float32, .* got Long"):
        spec.backward_op(grad.long(), *rest)


# ---- strides (docs/ops.md, "Layouts"): read in place, copied, or refused; never wrong ----

with_capsules = pytest.mark.parametrize(
    "spec", [spec for spec in OP_DB if spec.capsule_dims], ids=lambda spec: spec.name
)


def fuzzed_layout(x: torch.Tensor, capsule_dims: int, rng: random.Random) -> torch.Tensor:
    """x's values in a random layout (a leaf like x): the dims before the capsule stored in a random
    order, each every 1st, 2nd or 3rd of a longer one, the capsules 0-3 values apart (a capsule not
    split: the layouts read in place), at a storage offset of 0-3 values (16-byte alignment broken);
    the gaps hold NaN, so a read outside the values shows."""
    outer = x.dim() - capsule_dims
    order = rng.sample(range(outer), outer)
    steps = [rng.choice([1, 2, 3]) for _ in range(outer)]
    n, pad, offset = math.prod(x.shape[outer:]), rng.randrange(4), rng.randrange(4)
    stored = [x.shape[d] * steps[d] for d in order] + [n + pad]
    storage = torch.full(
        (offset + math.prod(stored),), float("nan"), dtype=x.dtype, device=x.device
    )
    y = storage[offset:].view(stored)[tuple(slice(None, None, steps[d]) for d in order)][..., :n]
    y = y.permute([order.index(d) for d in range(outer)] + [outer]).unflatten(-1, x.shape[outer:])
    y.copy_(x.detach())
    return y.requires_grad_(x.requires_grad)


def assert_matches_reference(spec, sample, label):
    for name, actual, expected in spec.compare(sample):
        assert actual.shape == expected.shape, f"{label} {name}: shape {tuple(actual.shape)}"
        assert_rel_close(actual, expected, spec.tolerance(torch.float64), f"{label} {name}")


@with_capsules
def test_fuzzed_strides_match_the_reference(spec, device):
    rng = random.Random(spec.name)
    for trial in range(8):
        sample = spec.draw(spec.shapes[torch.float64][trial % 2], device, torch.float64)
        first, *rest = sample.tensors
        laid_out = fuzzed_layout(first, spec.capsule_dims, rng)
        label = f"strides {laid_out.stride()} offset {laid_out.storage_offset()}"
        assert_matches_reference(spec, replace(sample, tensors=(laid_out, *rest)), label)


@with_capsules
def test_overlapping_strides_from_expand(spec, device):
    """A dimension broadcast by expand (stride 0), the batch, an input capsule or a capsule's own
    values: the overlapping input is read in place or copied, and its gradient is the reference's
    (the broadcast values' gradients summed by autograd)."""
    sample = spec.draw(spec.shapes[torch.float64][0], device, torch.float64)
    first, *rest = sample.tensors
    # A capsule of equal values is the LayerNorm's degenerate point: every deviation from the mean
    # is 0, and the gradient of norm_weight rounding noise (test_attention_routing, D = 1).
    capsule = () if spec.name == "inverted_attention_routing" else (first.dim() - 1,)
    for dim in (0, 1, *capsule):
        one = first.detach().narrow(dim, 0, 1)
        expanded = one.expand(first.shape).requires_grad_()
        assert expanded.stride(dim) == 0
        assert_matches_reference(
            spec, replace(sample, tensors=(expanded, *rest)), f"expanded dim {dim}"
        )


@with_capsules
@pytest.mark.parametrize("empty_dim", [0, 1], ids=["B=0", "I=0"])
def test_zero_size_strided(spec, device, empty_dim):
    """No batch or no input capsules, in a strided layout: the reference's empty outputs and
    gradients (zeros for what is shared across the batch)."""
    shape = list(spec.shapes[torch.float64][0])
    shape[empty_dim] = 0
    sample = spec.draw(tuple(shape), device, torch.float64)
    first, *rest = sample.tensors
    laid_out = capsule_layout(first, "einsum", spec.capsule_dims)
    assert_matches_reference(
        spec, replace(sample, tensors=(laid_out, *rest)), f"{spec.name} {shape}"
    )
