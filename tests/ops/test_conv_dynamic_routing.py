"""conv_dynamic_routing beyond the contract (tests/ops/test_op_contract.py): strides and paddings, the
chunks of output positions (whole images, rows of one image), dynamic_routing on the position's
votes, a weight shared over the child types, and bad input."""

import pytest
import torch

import capsroute
from capsroute import reference
from helpers import assert_rel_close
from op_db import CONV_DYNAMIC_ROUTING, conv_dynamic_inputs


@pytest.mark.parametrize(
    "shape,stride,padding",
    [
        ((2, 6, 5, 3, 4, 8, 5, 3), 1, 1),
        ((2, 7, 8, 2, 3, 16, 4, 3), 2, 0),
        ((1, 5, 5, 2, 2, 4, 3, 2), 3, 2),
        ((1, 4, 6, 3, 2, 8, 2, 4), 1, 3),
        ((1, 5, 7, 2, 2, 4, 3, 3), 2, 4),  # windows on padding alone
    ],
)
def test_strides_and_paddings_match_reference(device, shape, stride, padding):
    sample = CONV_DYNAMIC_ROUTING.draw(shape, device, torch.float64, stride=stride, padding=padding)
    for name, actual, expected in CONV_DYNAMIC_ROUTING.compare(sample):
        assert_rel_close(actual, expected, 1e-10, name)


@pytest.mark.parametrize("chunk", ["1", "5", "13", "30", "64"])
def test_chunks_of_positions_match_reference(device, monkeypatch, chunk):
    """CAPSROUTE_CONV_CHUNK forces the positions per chunk: rows of one image (1, 5, 13: a row is
    6 positions, the image 30), one image, two images with a short last chunk."""
    monkeypatch.setenv("CAPSROUTE_CONV_CHUNK", chunk)
    sample = CONV_DYNAMIC_ROUTING.draw(
        (3, 11, 12, 2, 3, 8, 4, 3), device, torch.float64, stride=2, padding=1, leaky=True
    )
    for name, actual, expected in CONV_DYNAMIC_ROUTING.compare(sample):
        assert_rel_close(actual, expected, 1e-10, name)


@pytest.mark.parametrize("C_in,Din", [(2, 0), (0, 3)])
def test_no_input_capsules_or_values_match_reference(device, C_in, Din):
    """Empty child types or capsules: v is the squashed bias, the gradients empty or the bias'."""
    shape = (2, 5, 5, C_in, 2, 2, Din, 3)
    sample = CONV_DYNAMIC_ROUTING.draw(shape, device, torch.float64, padding=1)
    for name, actual, expected in CONV_DYNAMIC_ROUTING.compare(sample):
        assert_rel_close(actual, expected, 1e-10, name)


def test_rejects_a_bad_chunk(monkeypatch):
    monkeypatch.setenv("CAPSROUTE_CONV_CHUNK", "0")
    u, weight, bias = conv_dynamic_inputs((1, 4, 4, 2, 2, 4, 3, 3))
    with pytest.raises(RuntimeError, match="CAPSROUTE_CONV_CHUNK must be an integer >= 1"):
        capsroute.conv_dynamic_routing(u, weight, bias=bias)


def test_is_dynamic_routing_of_each_positions_votes(device):
    """The op is dynamic_routing over the (B H' W', C_in, C_out, D) votes of conv_capsule_votes."""
    u, weight, bias = conv_dynamic_inputs((2, 6, 7, 3, 4, 8, 5, 3), device=device)
    v = capsroute.conv_dynamic_routing(u, weight, bias=bias, stride=2, padding=1)
    votes = reference.conv_capsule_votes(u, weight, stride=2, padding=1)
    expected = capsroute.dynamic_routing(votes.flatten(0, 2), bias=bias).unflatten(
        0, votes.shape[:3]
    )
    assert_rel_close(v, expected, 1e-12, "v")
    # Couplings: the schema op's second output, per position and child type.
    c = torch.ops.capsroute.conv_dynamic_routing(u, weight, bias, 3, 2, 1, False, False, 1e-8)[1]
    _, expected_c = capsroute.dynamic_routing_coupling(votes.flatten(0, 2), bias=bias)
    assert_rel_close(c, expected_c.unflatten(0, votes.shape[:3]), 1e-12, "c")


def test_votes_are_the_convolution_of_each_child_type():
    """conv_capsule_votes (the reference's votes) against torch's grouped conv2d."""
    B, H, W, C_in, C_out, D, Din, K = 2, 7, 6, 3, 4, 5, 2, 3
    u, weight, _ = conv_dynamic_inputs((B, H, W, C_in, C_out, D, Din, K))
    votes = reference.conv_capsule_votes(u, weight, stride=2, padding=1)
    images = u.permute(0, 3, 4, 1, 2).reshape(B, C_in * Din, H, W)
    kernels = weight.permute(2, 3, 4, 5, 0, 1).reshape(C_in * C_out * D, Din, K, K)
    conv = torch.nn.functional.conv2d(images, kernels, stride=2, padding=1, groups=C_in)
    expected = conv.unflatten(1, (C_in, C_out, D)).permute(0, 4, 5, 1, 2, 3)
    assert_rel_close(votes, expected, 1e-12, "votes")


def test_a_weight_shared_over_child_types(device):
    """SegCaps' one transform for every child type: an expanded weight, its gradient summed."""
    u, weight, bias = conv_dynamic_inputs((2, 5, 5, 3, 2, 8, 4, 3), device=device)
    shared = weight[:, :, :1].detach().clone().requires_grad_()
    v = capsroute.conv_dynamic_routing(u, shared.expand_as(weight), bias=bias, padding=1)
    expected = reference.conv_dynamic_routing(u, shared.expand_as(weight), bias=bias, padding=1)
    assert_rel_close(v, expected, 1e-10, "v")
    cotangent = torch.randn_like(v)
    (grad,) = torch.autograd.grad(v, shared, cotangent)
    (expected_grad,) = torch.autograd.grad(expected, shared, cotangent)
    assert grad.shape == shared.shape
    assert_rel_close(grad, expected_grad, 1e-10, "grad_weight")


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(u=lambda u: u[0]), r"u must have shape \(B, H, W, C_in, Din\)"),
        (dict(weight=lambda w: w[:, :, :1]), "weight must have C_in = 2"),
        (dict(weight=lambda w: w[..., :2]), "weight must have C_in = 2 .* and Din = 3"),
        (dict(weight=lambda w: w[:, :2]), r"weight must have shape \(K, K, C_in, C_out, D, Din\)"),
        (dict(weight=lambda w: w[:, :, :, :0]), "K, C_out, D >= 1"),
        (dict(stride=0), "stride must be >= 1, got 0"),
        (dict(padding=-1), "padding must be >= 0, got -1"),
        (dict(weight=lambda w: w.repeat(2, 2, 1, 1, 1, 1)), "kernel size K = 6 is larger"),
        (dict(bias=lambda b: b[:1]), r"bias must have shape \(J, D\) = \(2, 4\)"),
        (dict(iters=0), "iters must be >= 1"),
        (dict(eps=float("nan")), "eps must be finite"),
        (dict(weight=lambda w: w.float()), "weight has dtype Float but u has dtype Double"),
    ],
)
def test_bad_input_is_refused_in_one_line(change, message):
    u, weight, bias = (t.detach() for t in conv_dynamic_inputs((1, 4, 4, 2, 2, 4, 3, 3)))
    tensors = dict(u=u, weight=weight, bias=bias)
    options = dict(iters=3, stride=1, padding=0, eps=1e-8)
    for name, value in change.items():
        if name in tensors:
            tensors[name] = value(tensors[name])
        else:
            options[name] = value
    with pytest.raises(RuntimeError, match=message) as error:
        capsroute.conv_dynamic_routing(
            tensors["u"], tensors["weight"], bias=tensors["bias"], **options
        )
    assert "\n" not in str(error.value).split("\nException raised from")[0].strip()


@pytest.mark.parametrize("share_weights", [True, False])
def test_layer_backends_agree(device, share_weights):
    """nn.ConvDynamicCapsules on the op and on the reference: same function, same parameters."""
    layer = capsroute.nn.ConvDynamicCapsules(
        3, 4, 2, 8, kernel_size=3, stride=2, share_weights=share_weights
    )
    layer = layer.to(device=device, dtype=torch.float64)
    assert layer.weight.shape == (3, 3, 1 if share_weights else 3, 2, 8, 4)
    u = torch.randn(2, 7, 6, 3, 4, dtype=torch.float64, device=device)
    fused = layer(u)
    assert fused.shape == (2, 4, 3, 2, 8)  # padding "same" = 1
    grads = torch.autograd.grad(fused.square().sum(), list(layer.parameters()))
    layer.backend = "reference"
    ref = layer(u)
    ref_grads = torch.autograd.grad(ref.square().sum(), list(layer.parameters()))
    assert_rel_close(fused, ref, 1e-10, "v")
    for g, r in zip(grads, ref_grads):
        assert_rel_close(g, r, 1e-10, "parameter gradient")


def test_layer_refuses_a_bad_padding():
    with pytest.raises(ValueError, match="padding must be an int >= 0 or 'same', got 'valid'"):
        capsroute.nn.ConvDynamicCapsules(2, 4, 2, 4, padding="valid")
