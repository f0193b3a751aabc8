"""dense_self_attention_routing and dense_inverted_attention_routing beyond the contract
(tests/ops/test_op_contract.py): the vote-input op on the einsum's votes, both squash forms, absent
parameters, a group of elements larger than one slab, the 4x4 pose form, and the layers on them."""

import pytest
import torch

import capsroute
from capsroute import reference
from capsroute.nn.attention import InvertedAttentionCapsules, SelfAttentionCapsules
from helpers import assert_rel_close, randn
from op_db import (
    DENSE_INVERTED_ATTENTION_ROUTING,
    DENSE_SELF_ATTENTION_ROUTING,
    dense_inverted_attention_inputs,
    dense_self_attention_inputs,
)

TOL = 1e-10  # float64 against the float64 reference


def assert_matches_reference(spec, sample, tol=TOL):
    for name, a, e in spec.compare(sample):
        assert_rel_close(a, e, tol, name)


@pytest.mark.parametrize("squash", ["efficient", "sabour"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "coupling-bias"])
def test_self_attention_options(device, squash, with_bias):
    tensors = dense_self_attention_inputs((3, 13, 6, 8, 5), device, coupling_bias=with_bias)
    spec = DENSE_SELF_ATTENTION_ROUTING
    assert_matches_reference(spec, spec.sample(tensors, squash=squash))


@pytest.mark.parametrize("iters", [1, 2, 4])
@pytest.mark.parametrize("affine", [(False, False), (True, False), (True, True)])
def test_inverted_attention_options(device, iters, affine):
    tensors = dense_inverted_attention_inputs(
        (3, 13, 6, 8, 5), device, weight=affine[0], bias=affine[1]
    )
    spec = DENSE_INVERTED_ATTENTION_ROUTING
    assert_matches_reference(spec, spec.sample(tensors, iters=iters))


def test_the_vote_input_ops_on_the_same_votes(device):
    """The same rule and loop as the vote-input ops: equal (to rounding) on the einsum's votes."""
    u, weight, bias = dense_self_attention_inputs((2, 11, 5, 8, 4), device)
    votes = reference.dense_votes(u, weight)
    assert_rel_close(
        capsroute.dense_self_attention_routing(u, weight, coupling_bias=bias),
        capsroute.self_attention_routing(votes, coupling_bias=bias),
        TOL,
        "self-attention",
    )
    u, weight, nw, nb = dense_inverted_attention_inputs((2, 11, 5, 8, 4), device)
    votes = reference.dense_votes(u, weight)
    assert_rel_close(
        capsroute.dense_inverted_attention_routing(u, weight, 2, norm_weight=nw, norm_bias=nb),
        capsroute.inverted_attention_routing(votes, 2, norm_weight=nw, norm_bias=nb),
        TOL,
        "inverted attention",
    )


def test_more_elements_than_a_slab_holds():
    """At MNIST's capsule count the CPU computes the votes a group of elements at a time (3 MB of
    slab per thread): several groups, their gradients summed across them."""
    spec = DENSE_INVERTED_ATTENTION_ROUTING
    sample = spec.draw((40, 1152, 10, 16, 2), "cpu", torch.float32)
    for name, a, e in spec.compare(sample):
        assert_rel_close(a, e, spec.tolerance(torch.float32), name)


def test_pose_block_weight_makes_the_pose_votes():
    pose = randn(2, 3, 4, 4)
    weight = randn(3, 5, 4, 4)
    block = capsroute.ops.pose_block_weight(weight)
    assert block.shape == (3, 5, 16, 16)
    assert_rel_close(
        reference.dense_votes(pose.flatten(2), block),
        reference.pose_votes(pose, weight),
        TOL,
        "votes",
    )


def test_pose_form(device):
    pose = randn(3, 7, 4, 4, device=device, requires_grad=True)
    weight = randn(7, 5, 4, 4, device=device, scale=0.5, requires_grad=True)
    nw = (1 + randn(16, device=device, scale=0.1)).requires_grad_()
    nb = randn(16, device=device, scale=0.1, requires_grad=True)
    ours = capsroute.dense_inverted_attention_routing_pose(
        pose, weight, 2, norm_weight=nw, norm_bias=nb
    )
    ref = reference.dense_inverted_attention_routing_pose(
        pose, weight, 2, norm_weight=nw, norm_bias=nb
    )
    assert ours.shape == (3, 5, 16)
    assert_rel_close(ours, ref, TOL, "v")
    cotangent = randn(*ours.shape, device=device)
    inputs = (pose, weight, nw, nb)
    for name, a, e in zip(
        ("pose", "weight", "norm_weight", "norm_bias"),
        torch.autograd.grad(ours, inputs, cotangent),
        torch.autograd.grad(ref, inputs, cotangent),
    ):
        assert_rel_close(a, e, TOL, f"grad_{name}")


@pytest.mark.parametrize(
    "pose,weight,message",
    [
        ((2, 3, 16), (3, 5, 4, 4), r"pose must have shape \(B, I, 4, 4\)"),
        ((2, 3, 4, 4), (3, 5, 16), r"weight must have shape \(I, J, 4, 4\)"),
        ((2, 3, 4, 4), (4, 5, 4, 4), r"with I = 3 to match pose of shape \(2, 3, 4, 4\)"),
    ],
)
def test_pose_form_refuses_other_shapes(pose, weight, message):
    with pytest.raises(ValueError, match=message):
        capsroute.dense_inverted_attention_routing_pose(randn(*pose), randn(*weight))


def test_pose_form_names_pose():
    """The pose form checks what it flattens, so its messages name pose, not the op's u."""
    pose, weight = randn(2, 3, 4, 4), randn(3, 5, 4, 4)
    with pytest.raises(RuntimeError, match="pose must be float32, .* got torch.int64"):
        capsroute.dense_inverted_attention_routing_pose(pose.long(), weight)
    with pytest.raises(
        RuntimeError, match="weight is torch.float32 on cpu but pose is torch.float64"
    ):
        capsroute.dense_inverted_attention_routing_pose(pose, weight.float())
    with pytest.raises(RuntimeError, match="weight is torch.float64 on meta but pose is .* on cpu"):
        capsroute.dense_inverted_attention_routing_pose(pose, weight.to("meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # its rule casts both: no mismatch
        v = capsroute.dense_inverted_attention_routing_pose(pose.bfloat16(), weight.float())
    assert v.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "layer,op",
    [
        (lambda: SelfAttentionCapsules(9, 4, 3, 8), "dense_self_attention_routing"),
        (lambda: InvertedAttentionCapsules(9, 4, 3, 8), "dense_inverted_attention_routing"),
    ],
    ids=["self-attention", "inverted-attention"],
)
def test_layers_make_no_votes(layer, op):
    """The layers route with the dense op (the votes never stored), and the reference backend
    agrees with it."""
    torch.manual_seed(0)
    fused = layer().double()
    u = randn(2, 9, 4, requires_grad=True)
    capsroute.clear_kernel_paths()
    v = fused(u)
    assert capsroute.last_kernel_path(op) == "cpu"
    ref = layer().double()
    ref.load_state_dict(fused.state_dict())
    ref.backend = "reference"
    assert_rel_close(v, ref(u), TOL, "v")
