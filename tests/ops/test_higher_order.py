"""Derivatives beyond first-order reverse mode, for every spec in tests/op_db.py: double backward
(create_graph=True) and forward mode are exact (docs/ops.md, "Derivatives"), through the reference's
autograd, while a plain backward still runs the fused backward operator. Compared with the float64
reference and with finite differences (gradgradcheck)."""

from dataclasses import replace

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.profiler import profile

import capsroute
from helpers import assert_rel_close, randn
from op_db import OP_DB

per_op = pytest.mark.parametrize("spec", OP_DB, ids=lambda spec: spec.name)
TOL = 1e-9  # float64 against float64: only rounding differs


def differentiable(spec, impl, sample):
    """impl as a function of the sample's tensors (None stays None) returning its differentiable outputs."""
    given = [i for i, t in enumerate(sample.tensors) if t is not None]

    def fn(*tensors):
        full = list(sample.tensors)
        for i, t in zip(given, tensors):
            full[i] = t
        return spec.outputs(impl, replace(sample, tensors=tuple(full)))[: spec.grad_outputs]

    return fn


def small_samples(spec, device):
    return [spec.draw(shape, device, torch.float64, **options) for shape, options in spec.gradcheck]


# The inputs with a batch dimension; the others (weights, biases, betas) are shared by the batch.
PER_ELEMENT = {"s", "votes", "u", "pose", "a_in"}


def primals(sample):
    return tuple(t.detach() for t in sample.inputs())


@per_op
def test_gradgradcheck(spec, device):
    for sample in small_samples(spec, device):
        # fast_mode: finite differences of random projections (the full Jacobians of the
        # gradients take a minute per op); test_double_backward_matches_reference checks all entries.
        # A graph-making backward differentiates the reference, whose index_add (conv_em_routing)
        # accumulates in atomic order on CUDA: the same gradients up to float64 rounding.
        nondet_tol = 1e-12 if device == "cuda" else 0.0
        assert torch.autograd.gradgradcheck(
            differentiable(spec, spec.fn, sample),
            sample.inputs(),
            fast_mode=True,
            nondet_tol=nondet_tol,
        )


def second_order(fn, inputs, cotangents, weights):
    """d/dx <grad_x <fn(x), cotangents>, weights>: a gradient penalty's gradient."""
    grads = torch.autograd.grad(fn(*inputs), inputs, cotangents, create_graph=True)
    penalty = sum((g * w).sum() for g, w in zip(grads, weights))
    return torch.autograd.grad(penalty, inputs)


@per_op
def test_double_backward_matches_reference(spec, device):
    for sample in small_samples(spec, device):
        outs = differentiable(spec, spec.ref, sample)(*sample.inputs())
        cotangents = [randn(*o.shape, device=device) for o in outs]
        weights = [randn(*t.shape, device=device) for t in sample.inputs()]
        ours = second_order(
            differentiable(spec, spec.fn, sample), sample.inputs(), cotangents, weights
        )
        ref = second_order(
            differentiable(spec, spec.ref, sample), sample.inputs(), cotangents, weights
        )
        for name, a, e in zip(spec.input_names, ours, ref):
            assert e.abs().max() > 0, (
                f"{name}: the reference's second derivative is zero: a vacuous check"
            )
            assert_rel_close(a, e, TOL, f"second-order grad_{name}")


@per_op
def test_jvp_matches_reference(spec, device):
    for sample in small_samples(spec, device):
        tangents = tuple(randn(*t.shape, device=device) for t in primals(sample))
        _, ours = torch.func.jvp(differentiable(spec, spec.fn, sample), primals(sample), tangents)
        _, ref = torch.func.jvp(differentiable(spec, spec.ref, sample), primals(sample), tangents)
        for name, a, e in zip(spec.output_names, ours, ref):
            assert e.abs().max() > 0, f"{name}: zero reference tangent"
            assert_rel_close(a, e, TOL, f"jvp {name}")


@per_op
def test_forward_ad_dual_tensors(spec, device):
    sample = small_samples(spec, device)[0]
    tangents = [randn(*t.shape, device=device) for t in primals(sample)]
    results = []
    for impl in (spec.fn, spec.ref):
        with fwAD.dual_level():
            duals = [fwAD.make_dual(p, t) for p, t in zip(primals(sample), tangents)]
            outs = differentiable(spec, impl, sample)(*duals)
            results.append([fwAD.unpack_dual(o).tangent for o in outs])
    for name, a, e in zip(spec.output_names, *results):
        assert a is not None, f"{name}: no tangent"
        assert_rel_close(a, e, TOL, f"forward-mode {name}")


@per_op
def test_func_transforms_match_reference(spec, device):
    """torch.func.grad, vmap(grad) (per-sample gradients) and jacrev."""
    sample = small_samples(spec, device)[0]
    x = primals(sample)

    def scalar(impl):
        return lambda *ts: sum(o.pow(2).sum() for o in differentiable(spec, impl, sample)(*ts))

    argnums = tuple(range(len(x)))
    for a, e in zip(
        torch.func.grad(scalar(spec.fn), argnums)(*x),
        torch.func.grad(scalar(spec.ref), argnums)(*x),
    ):
        assert_rel_close(a, e, TOL, "torch.func.grad")

    def per_sample(impl):
        # One batch element at a time: the batch-independent tensors (weights, betas) are shared.
        fn = differentiable(spec, impl, sample)
        names = [n for n, t in zip(spec.input_names, sample.tensors) if t is not None]
        in_dims = tuple(0 if name in PER_ELEMENT else None for name in names)

        def loss(*tensors):
            one = [t.unsqueeze(0) if d == 0 else t for t, d in zip(tensors, in_dims)]
            return sum(o.pow(2).sum() for o in fn(*one))

        return torch.func.vmap(torch.func.grad(loss), in_dims=in_dims)(*x)

    if spec.name != "squash":  # squash has no batch dimension of its own
        assert_rel_close(per_sample(spec.fn), per_sample(spec.ref), TOL, "vmap(grad)")

    for a, e in zip(
        torch.func.jacrev(differentiable(spec, spec.fn, sample))(*x),
        torch.func.jacrev(differentiable(spec, spec.ref, sample))(*x),
    ):
        assert_rel_close(a, e, TOL, "jacrev")


@per_op
def test_first_order_backward_runs_the_fused_operator(spec):
    sample = small_samples(spec, "cpu")[0]
    outs = differentiable(spec, spec.fn, sample)(*sample.inputs())
    with profile() as prof:
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert f"capsroute::_{spec.name}_backward" in {event.name for event in prof.events()}


def test_transforms_under_autocast():
    """Under autocast an op takes mixed dtypes (its rule casts them), and so does its reference
    path under a transform, which checks the arguments as the rule hands them on."""
    votes, coupling_bias = randn(2, 5, 3, 4).bfloat16(), randn(5, 3).float()
    pose, a_in, betas = randn(2, 5, 3, 16).bfloat16(), torch.rand(2, 5), torch.zeros(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = capsroute.self_attention_routing(votes, coupling_bias=coupling_bias)
        mapped = torch.func.vmap(
            lambda v: capsroute.self_attention_routing(v, coupling_bias=coupling_bias)
        )(votes.unsqueeze(0))[0]
        grad_a = torch.func.grad(lambda a: capsroute.em_routing(pose, a, betas, betas)[1].sum())(
            a_in
        )
    assert eager.dtype == mapped.dtype == torch.bfloat16
    assert_rel_close(mapped.float(), eager.float(), 2e-2, "vmap under autocast")
    assert grad_a.dtype == torch.float32 and torch.isfinite(grad_a).all()


def test_a_tensor_in_two_inputs_gets_both_gradients_once():
    """em_routing(votes, a_in, beta, beta): with a graph or without, beta's gradient is the sum of
    its two inputs' gradients (each counted once)."""
    pose, a_in = randn(2, 5, 3, 4, requires_grad=True), torch.rand(2, 5, dtype=torch.float64)
    beta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    fused = torch.autograd.grad(capsroute.em_routing(pose, a_in, beta, beta)[1].sum(), beta)[0]
    graphed = torch.autograd.grad(
        capsroute.em_routing(pose, a_in, beta, beta)[1].sum(), beta, create_graph=True
    )[0]
    assert graphed.requires_grad
    assert_rel_close(graphed, fused, TOL, "beta's gradient with a graph")


def test_an_error_of_the_reference_keeps_its_type(monkeypatch):
    """A Python error raised while differentiating the reference reaches the caller as itself."""
    from capsroute.ops import _autograd

    def broken(*args):
        raise ValueError("the reference failed")

    monkeypatch.setitem(_autograd.REFERENCES, "squash", broken)
    s = randn(2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="the reference failed"):
        torch.autograd.grad(capsroute.squash(s).sum(), s, create_graph=True)
