"""self_attention_routing and inverted_attention_routing beyond the contract
(tests/ops/test_op_contract.py): both squash forms, the coupling bias and its gradient, LayerNorm with
and without its affine parameters, one iteration, couplings that leak nothing, the kernels'
formulation of self-attention against the paper's formula, large logits, D = 1."""

import math

import pytest
import torch

import capsroute
from helpers import assert_rel_close, randn
from op_db import (
    INVERTED_ATTENTION_ROUTING,
    SELF_ATTENTION_ROUTING,
    inverted_attention_inputs,
    self_attention_inputs,
)

TOL = 1e-10  # float64 against the float64 reference
per_spec = pytest.mark.parametrize(
    "spec", [SELF_ATTENTION_ROUTING, INVERTED_ATTENTION_ROUTING], ids=lambda spec: spec.name
)


def assert_matches_reference(spec, sample, tol=TOL):
    for name, a, e in spec.compare(sample):
        assert_rel_close(a, e, tol, name)


@pytest.mark.parametrize("squash", ["efficient", "sabour"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "coupling-bias"])
def test_both_squash_forms(device, squash, with_bias):
    tensors = self_attention_inputs((3, 13, 6, 8), device, coupling_bias=with_bias)
    assert_matches_reference(
        SELF_ATTENTION_ROUTING, SELF_ATTENTION_ROUTING.sample(tensors, squash=squash)
    )


@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.parametrize("squash", ["efficient", "sabour"])
def test_an_output_with_zero_votes(device, squash, eps):
    """s_j = 0 where every vote for j is 0: v_j = 0, and the votes' gradient through the squash's
    Jacobian at 0 (Efficient-CapsNet's: (1 - e^-n) / n times the identity, n = sqrt(eps))."""
    votes, coupling_bias = self_attention_inputs((3, 13, 6, 8), device)
    votes = votes.detach().clone()
    votes[:, :, 2] = 0
    sample = SELF_ATTENTION_ROUTING.sample(
        (votes.requires_grad_(), coupling_bias), squash=squash, eps=eps
    )
    assert_matches_reference(SELF_ATTENTION_ROUTING, sample)


def test_squash_forms_differ(device):
    """The squash option reaches the kernel: "efficient" is not "sabour"."""
    votes, bias = self_attention_inputs((2, 7, 3, 4), device)
    efficient = capsroute.self_attention_routing(votes, coupling_bias=bias)
    sabour = capsroute.self_attention_routing(votes, coupling_bias=bias, squash="sabour")
    assert not torch.allclose(efficient, sabour)


def test_coupling_bias_gradient(device):
    """grad_coupling_bias_ij = sum_b <dL/ds_bj, u_bij>: the couplings enter s linearly, the bias
    after the softmax."""
    votes, bias = self_attention_inputs((4, 9, 5, 8), device)
    v, c = capsroute.self_attention_routing_coupling(votes, coupling_bias=bias)
    cotangent = randn(*v.shape, device=device)
    grad_bias, grad_votes = torch.autograd.grad(v, (bias, votes), cotangent)
    s = torch.einsum("bij,bijd->bjd", c, votes.detach()).requires_grad_()
    (grad_s,) = torch.autograd.grad(capsroute.reference.squash_exp(s), s, cotangent)
    assert_rel_close(grad_bias, torch.einsum("bjd,bijd->ij", grad_s, votes.detach()), TOL, "grad")
    # The couplings are the softmax plus the bias: less the bias, each row sums to 1.
    assert_rel_close(
        (c - bias.detach()).sum(-1), torch.ones(4, 9, dtype=c.dtype, device=device), TOL, "rows"
    )


def test_self_attention_formulation_is_the_papers_formula(device):
    """The kernels run two passes (a uniform one, then logits (J / sqrt(D)) <u_ij, s^0_j>, s^0 the
    uniformly coupled sum): the same as Efficient-CapsNet's a_ij = <u_ij, sum_k u_kj> / sqrt(D),
    written here directly, in float64."""
    B, I, J, D = 3, 11, 5, 16
    votes, bias = (t.detach() for t in self_attention_inputs((B, I, J, D), device))
    logits = torch.einsum("bijd,bjd->bij", votes, votes.sum(1)) / math.sqrt(D)
    c = torch.softmax(logits, -1) + bias
    s = torch.einsum("bij,bijd->bjd", c, votes)
    n = s.norm(dim=-1, keepdim=True)
    v = (1 - torch.exp(-n)) * s / n
    got_v, got_c, s_hist = torch.ops.capsroute.self_attention_routing(votes, bias, "efficient", 0.0)
    assert_rel_close(got_v, v, TOL, "v")
    assert_rel_close(got_c, c, TOL, "c")
    assert_rel_close(s_hist[:, 0], votes.sum(1) / J, TOL, "s^0")
    assert_rel_close(s_hist[:, 1], s, TOL, "s^1")


@pytest.mark.parametrize("iters", [1, 2, 3])
@pytest.mark.parametrize(
    "weight,bias", [(False, False), (True, False), (False, True), (True, True)]
)
def test_layer_norm_with_and_without_affine_parameters(device, iters, weight, bias):
    tensors = inverted_attention_inputs((3, 13, 6, 8), device, weight=weight, bias=bias)
    sample = INVERTED_ATTENTION_ROUTING.sample(tensors, iters=iters)
    assert_matches_reference(INVERTED_ATTENTION_ROUTING, sample)


def test_one_iteration_is_the_layer_norm_of_the_mean_vote(device):
    votes, weight, bias = (t.detach() for t in inverted_attention_inputs((2, 9, 4, 8), device))
    v, c = capsroute.inverted_attention_routing_coupling(
        votes, 1, norm_weight=weight, norm_bias=bias
    )
    want = torch.nn.functional.layer_norm(votes.sum(1) / 4, (8,), weight, bias)
    assert_rel_close(v, want, TOL, "v")
    assert torch.equal(c, torch.full_like(c, 1 / 4))


@pytest.mark.parametrize("op", ["self_attention", "inverted_attention"])
def test_couplings_leak_nothing(device, op):
    """Neither routing has a leaky option: each input's softmax shares sum to 1."""
    votes = randn(3, 10, 7, 8, device=device)
    routing = getattr(capsroute, f"{op}_routing_coupling")
    _, c = routing(votes)
    assert_rel_close(c.sum(-1), torch.ones(3, 10, dtype=c.dtype, device=device), TOL, "sum over j")


@per_spec
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_large_logits_stay_finite(device, spec, dtype):
    """Votes 100 times larger: logits in the thousands saturate the softmax (a max-shifted one,
    no overflow); the outputs and gradients stay finite and close to the reference (in float32 the
    logits' rounding, 1e-7 of thousands, moves near-tied couplings by about 1e-3)."""
    sample = spec.draw((2, 13, 5, 8), device, dtype)
    votes = (sample.tensors[0].detach() * 100).requires_grad_()
    scaled = spec.sample((votes, *sample.tensors[1:]))
    for name, a, e in spec.compare(scaled):
        assert torch.isfinite(a).all(), name
        assert_rel_close(a, e, 1e-2 if dtype == torch.float32 else 1e-8, name)


def test_inverted_with_one_value_per_capsule(device):
    """D = 1: each capsule's LayerNorm sees one value, whose deviation from its mean is 0, so v is
    norm_bias (0 without it) and the gradients of votes and norm_weight 0 up to rounding (the
    reference's too: gx - mean(gx) of one value, times 1 / sqrt(eps)); the couplings still follow
    <u, v>."""
    tensors = inverted_attention_inputs((3, 7, 4, 1), device)
    for name, a, e in INVERTED_ATTENTION_ROUTING.compare(
        INVERTED_ATTENTION_ROUTING.sample(tensors)
    ):
        if name in ("grad_votes", "grad_norm_weight"):
            assert a.abs().max() < 1e-12 and e.abs().max() < 1e-12, name
        else:
            assert_rel_close(a, e, TOL, name)
    votes, weight, bias = tensors
    v = capsroute.inverted_attention_routing(votes, norm_weight=weight, norm_bias=bias)
    assert_rel_close(v, bias.detach().expand(3, 4, 1), TOL, "v")


@per_spec
def test_kernel_path_is_recorded(spec):
    capsroute.clear_kernel_paths()
    sample = spec.draw((2, 5, 3, 4), "cpu", torch.float32)
    spec.run(spec.fn, sample)
    assert capsroute.last_kernel_path(spec.name, "forward") == "cpu"
    assert capsroute.last_kernel_path(spec.name, "backward") == "cpu"


@per_spec
def test_coupling_is_not_differentiable(device, spec):
    v, c = spec.outputs(spec.fn, spec.draw((2, 5, 3, 4), device, torch.float64))
    assert v.requires_grad and not c.requires_grad


@pytest.mark.parametrize(
    "op", ["self_attention_routing", "inverted_attention_routing", "dynamic_routing"]
)
def test_float32_sums_over_many_inputs(device, op):
    """At I = 16384 the sums over input capsules (s forward, the logits' gradient backward) round
    like float32 eager's pairwise sums, not like a chain of I additions: self-attention's logits,
    tens in size, turned a chain's rounding into relative errors of 9e-5 in the vote gradient."""
    generator = torch.Generator().manual_seed(0)
    votes = randn(1, 16384, 10, 16, scale=0.5, generator=generator)
    cotangent = randn(1, 10, 16, generator=generator)

    def output_and_grad(module, x):
        x = x.detach().requires_grad_()
        fn = getattr(module, op)
        v = fn(x) if op == "self_attention_routing" else fn(x, 3)
        (grad,) = torch.autograd.grad((v.double() * cotangent.to(v.device)).sum(), x)
        return v, grad

    expected = output_and_grad(capsroute.reference, votes)
    actual = output_and_grad(capsroute, votes.to(device, torch.float32))
    for name, a, e in zip(("v", "grad_votes"), actual, expected):
        assert_rel_close(a.double().cpu(), e, 2e-5, f"{op} float32 {name}")
