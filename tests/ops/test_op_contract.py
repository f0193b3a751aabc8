"""The contract every capsroute op keeps, checked for every spec in tests/op_db.py on every device:
capsroute matches the float64 reference in every storage dtype (outputs and all gradients),
finite differences agree with the analytic gradients, torch.library.opcheck passes on the forward
and the backward op, torch.compile(fullgraph=True) traces it, non-contiguous inputs and an empty
batch work, results are bitwise deterministic, a wrong dtype raises an error that names the
argument, and under autocast the op follows its declared rule. What is specific to one op lives in
tests/test_<op>.py."""

from dataclasses import replace

import pytest
import torch

from capsroute import ops
from capsroute.ops import _autocast
from helpers import assert_rel_close, noncontiguous, randn
from op_db import CAPSULE_LAYOUTS, DTYPES, OP_DB, capsule_layout

# The ops whose kernels return their capsule input's gradient in that input's layout where they
# read it in place and it is dense (docs/ops.md, "Layouts"); the rest return it contiguous. The
# CUDA kernels of ROWS_ON_CUDA read votes in rows of J capsules, which the permute layout's are
# not (J outermost): copied, their gradient comes back contiguous.
GRADIENT_IN_INPUT_LAYOUT = (
    "dynamic_routing",
    "em_routing",
    "em_routing_pose",
    "self_attention_routing",
    "inverted_attention_routing",
)
ROWS_ON_CUDA = (
    "dynamic_routing",
    "em_routing",
    "self_attention_routing",
    "inverted_attention_routing",
)

per_op = pytest.mark.parametrize("spec", OP_DB, ids=lambda spec: spec.name)


def test_every_op_has_a_spec():
    assert [spec.name for spec in OP_DB] == list(ops.OPS)


def call_op(spec, sample):
    out = spec.op(*spec.schema_args(sample))
    return out if isinstance(out, tuple) else (out,)


def detached(sample):
    return replace(sample, tensors=tuple(None if t is None else t.detach() for t in sample.tensors))


@per_op
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_matches_reference(spec, device, dtype):
    for sample in spec.samples(device, dtype):
        shape = tuple(sample.tensors[0].shape)
        for name, actual, expected in spec.compare(sample):
            assert actual.dtype == dtype, f"{shape} {name}: dtype {actual.dtype}"
            assert torch.isfinite(actual).all() or not torch.isfinite(expected).all(), (
                f"{shape} {name}: not finite"
            )
            assert_rel_close(actual, expected, spec.tolerance(dtype), f"{shape} {name}")


@per_op
def test_gradcheck(spec, device):
    for shape, options in spec.gradcheck:
        sample = spec.draw(shape, device, torch.float64, **options)

        def fn(*tensors):
            return spec.outputs(spec.fn, replace(sample, tensors=tensors))[: spec.grad_outputs]

        assert torch.autograd.gradcheck(fn, sample.tensors, fast_mode=False)


@per_op
def test_opcheck(spec, device):
    for shape, options in spec.opcheck:
        sample = spec.draw(shape, device, torch.float64, **options)
        torch.library.opcheck(spec.op, spec.schema_args(sample))
        saved = detached(sample)
        out = call_op(spec, saved)
        grads = [randn(*o.shape, device=device) for o in out[: spec.grad_outputs]]
        torch.library.opcheck(spec.backward_op, spec.backward_args(saved, out, grads))


@per_op
def test_opcheck_non_contiguous(spec, device):
    """Every input, output gradients included, not contiguous (helpers.noncontiguous: dense with its
    dims reversed, or a strided vector): the fakes give each output the strides the kernels give
    it, as torch.compile needs."""
    shape, options = spec.opcheck[0]
    sample = detached(spec.draw(shape, device, torch.float64, **options))
    sample = replace(
        sample, tensors=tuple(t if t is None else noncontiguous(t) for t in sample.tensors)
    )
    torch.library.opcheck(spec.op, spec.schema_args(sample))
    out = call_op(spec, sample)
    grads = [noncontiguous(randn(*o.shape, device=device)) for o in out[: spec.grad_outputs]]
    torch.library.opcheck(spec.backward_op, spec.backward_args(sample, out, grads))


@per_op
def test_torch_compile_fullgraph(spec, device):
    """The op in a whole-graph compile: dynamo traces it, AOT autograd runs its fake and its
    autograd formula; inductor compiles dynamic_routing's graph (the op itself is an extern call
    in every graph, so the other ops' would check nothing more at a cold compile each)."""
    # loss below is one code object for every op: dynamo's cache of its compilations holds 8
    # (recompile_limit), fewer than the ops, so each test starts from an empty one.
    torch._dynamo.reset()
    backend = "inductor" if spec.name == "dynamic_routing" else "aot_eager"
    shape, options = spec.opcheck[0]
    sample = spec.draw(shape, device, torch.float32, **options)
    cotangents = [
        randn(*o.shape, dtype=torch.float32, device=device)
        for o in spec.outputs(spec.fn, detached(sample))[: spec.grad_outputs]
    ]

    def loss(*tensors):
        out = spec.outputs(spec.fn, replace(sample, tensors=tensors))
        return sum((o * g).sum() for o, g in zip(out, cotangents))

    losses = {
        "compiled": torch.compile(loss, fullgraph=True, backend=backend)(*sample.tensors),
        "eager": loss(*sample.tensors),
    }
    grads = {how: torch.autograd.grad(value, sample.inputs()) for how, value in losses.items()}
    # The compiled graph may sum the loss in another order: float32 rounding apart.
    tol = spec.tolerance(torch.float32)
    assert_rel_close(losses["compiled"].detach(), losses["eager"].detach(), tol, "loss")
    for name, a, e in zip(
        spec.names(sample)[len(spec.output_names) :], grads["compiled"], grads["eager"]
    ):
        assert_rel_close(a, e, tol, name)


@pytest.mark.parametrize("name", ["squash", "dynamic_routing", "em_routing"])
def test_compiled_autograd(name):
    """The backward traced by compiled autograd (torch._dynamo's): one op with one output, one with
    couplings and state beside its output, one with two differentiable outputs."""
    from torch._dynamo import compiled_autograd

    spec = next(s for s in OP_DB if s.name == name)
    shape, options = spec.opcheck[0]
    sample = spec.draw(shape, "cpu", torch.float32, **options)

    def grads():
        out = spec.outputs(spec.fn, sample)[: spec.grad_outputs]
        return torch.autograd.grad(sum(o.square().sum() for o in out), sample.inputs())

    torch._dynamo.reset()
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        traced = grads()
    for input_name, a, e in zip(spec.input_names, traced, grads()):
        assert_rel_close(a, e, spec.tolerance(torch.float32), input_name)


@per_op
def test_non_contiguous(spec, device):
    sample = spec.draw(spec.shapes[torch.float64][0], device, torch.float64)
    sample = replace(sample, tensors=tuple(noncontiguous(t) for t in sample.tensors))
    for name, actual, expected in spec.compare(sample):
        assert_rel_close(actual, expected, spec.tolerance(torch.float64), name)


with_capsules = pytest.mark.parametrize(
    "spec", [spec for spec in OP_DB if spec.capsule_dims], ids=lambda spec: spec.name
)


def in_layout(sample, layout, capsule_dims):
    """The sample with its first input (votes, u or pose) in `layout` (op_db.capsule_layout)."""
    first, *rest = sample.tensors
    return replace(sample, tensors=(capsule_layout(first, layout, capsule_dims), *rest))


@with_capsules
@pytest.mark.parametrize("layout", CAPSULE_LAYOUTS)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32], ids=lambda dtype: str(dtype).removeprefix("torch.")
)
def test_capsule_layouts(spec, device, layout, dtype):
    """The layouts einsum, permute and slicing give: outputs and every gradient match the reference;
    the first input's gradient comes back in its layout where the kernels read it in place and it
    is dense, else contiguous (docs/ops.md, "Layouts")."""
    for shape in spec.shapes[dtype][:2]:
        sample = in_layout(spec.draw(shape, device, dtype), layout, spec.capsule_dims)
        compared = spec.compare(sample)
        for name, actual, expected in compared:
            assert_rel_close(actual, expected, spec.tolerance(dtype), f"{shape} {name}")
        first, grad_first = sample.inputs()[0], compared[len(spec.output_names)][1]
        in_its_layout = spec.name in GRADIENT_IN_INPUT_LAYOUT and not (
            device == "cuda" and spec.name in ROWS_ON_CUDA and layout == "permute"
        )
        expected = torch.empty_like(first) if in_its_layout else first.contiguous()
        assert grad_first.stride() == expected.stride(), (
            f"{shape} grad_{spec.input_names[0]} strides {grad_first.stride()}, "
            f"{spec.input_names[0]} strides {first.stride()}"
        )


@with_capsules
@pytest.mark.parametrize("layout", CAPSULE_LAYOUTS)
def test_capsule_layouts_opcheck(spec, device, layout):
    """The fake backward op gives the first input's gradient the strides the kernels give it."""
    shape, options = spec.opcheck[0]
    saved = detached(
        in_layout(spec.draw(shape, device, torch.float64, **options), layout, spec.capsule_dims)
    )
    out = call_op(spec, saved)
    grads = [randn(*o.shape, device=device) for o in out[: spec.grad_outputs]]
    torch.library.opcheck(spec.backward_op, spec.backward_args(saved, out, grads))


def copies_of(spec, sample, like: torch.Tensor) -> list[str]:
    """The copies (aten::clone, contiguous, copy_) of a tensor of like's shape that a forward and
    backward of the sample make, from the profiler's record of every aten op the kernels call."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True
    ) as prof:
        spec.run(spec.fn, sample)
    copy_ops = {"aten::clone", "aten::contiguous", "aten::copy_"}
    return [
        e.name for e in prof.events() if e.name in copy_ops and list(like.shape) in e.input_shapes
    ]


@with_capsules
def test_capsule_layouts_are_not_copied(spec):
    """On the CPU the einsum layout (and the others of CAPSULE_LAYOUTS) run without a copy of the
    first input; one whose capsules are not contiguous is copied, which this check must see."""
    sample = spec.draw(spec.shapes[torch.float32][0], "cpu", torch.float32)
    for layout in CAPSULE_LAYOUTS:
        laid_out = in_layout(sample, layout, spec.capsule_dims)
        assert copies_of(spec, laid_out, laid_out.tensors[0]) == [], layout
    strided = in_layout(sample, "inner", spec.capsule_dims)
    assert copies_of(spec, strided, strided.tensors[0]), (
        "no copy seen of capsules that are not contiguous"
    )


@per_op
def test_empty_batch(spec, device):
    """No outputs, gradients of the batch's shape, and exact zeros for the gradients of what is
    shared across the batch (weights, biases, betas): the reference's results."""
    shape = spec.shapes[torch.float64][0]
    sample = spec.draw((0, *shape[1:]), device, torch.float64)
    for name, actual, expected in spec.compare(sample):
        assert actual.shape == expected.shape and torch.equal(actual, expected), name


@per_op
def test_deterministic(spec, device):
    for sample in spec.samples(device, torch.float32):
        first, cotangents = spec.run(spec.fn, sample)
        second, _ = spec.run(spec.fn, sample, cotangents)
        for name, a, b in zip(spec.names(sample), first, second):
            assert torch.equal(a, b), name


@per_op
def test_bad_dtype_is_named(spec, device):
    """An integer first input, or another input in a different float dtype, raises an error naming it."""
    shape, options = spec.opcheck[0]
    sample = detached(spec.draw(shape, device, torch.float64, **options))
    first, *rest = spec.input_names
    with pytest.raises(
        RuntimeError, match=f"{first} must be float32, float64, float16 or bfloat16"
    ):
        spec.outputs(
            spec.fn, replace(sample, tensors=(sample.tensors[0].int(), *sample.tensors[1:]))
        )
    for k, name in enumerate(rest, 1):
        tensors = list(sample.tensors)
        tensors[k] = tensors[k].float()
        with pytest.raises(RuntimeError, match=f"{name} has dtype Float"):
            spec.outputs(spec.fn, replace(sample, tensors=tuple(tensors)))


@per_op
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_rule(spec, device, amp):
    """Under torch.autocast the op casts its inputs by the rule declared in capsroute/ops/_autocast.py
    (float32 for EM routing, the autocast dtype for dynamic routing and dense capsules, none for
    squash) and gives bitwise what it gives on the cast inputs outside autocast, gradients
    included; the reference follows the same rule."""
    rule = {
        **dict.fromkeys(_autocast.IN_FLOAT32, torch.float32),
        **dict.fromkeys(_autocast.IN_AUTOCAST_DTYPE, amp),
    }.get(spec.name)
    shape, options = spec.opcheck[0]
    sample = spec.draw(shape, device, torch.float32, **options)
    # The first input as the layer below delivers it under autocast; the rest as float32 parameters.
    sample = replace(
        sample, tensors=(sample.tensors[0].detach().to(amp).requires_grad_(), *sample.tensors[1:])
    )
    cast = replace(
        sample,
        tensors=tuple(t if t is None or rule is None else t.to(rule) for t in sample.tensors),
    )
    with torch.autocast(device, dtype=amp):
        got, cotangents = spec.run(spec.fn, sample)
        ref_got = spec.outputs(spec.ref, sample)
    want, _ = spec.run(spec.fn, cast, cotangents)
    inputs = sample.inputs()
    want[len(want) - len(inputs) :] = [
        g.to(t.dtype) for g, t in zip(want[len(want) - len(inputs) :], inputs)
    ]
    for name, a, b in zip(spec.names(sample), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert [o.dtype for o in ref_got] == [o.dtype for o in got[: len(ref_got)]]
    if (
        rule == torch.float32
    ):  # autocast is off inside: the reference on the float32 inputs, bitwise
        for name, a, b in zip(spec.output_names, ref_got, spec.outputs(spec.ref, cast)):
            assert torch.equal(a, b), f"reference {name}"
