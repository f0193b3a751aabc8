"""The sample inputs of the op table (tests/op_db.py): random values with odd sizes, per op, shared
with the per-op test files (which import them from op_db)."""

import torch

from helpers import randn


def squash_inputs(shape, device="cpu", dtype=torch.float64):
    return (randn(*shape, dtype=dtype, device=device, requires_grad=True),)


def routing_inputs(shape, device="cpu", dtype=torch.float64, bias=True):
    B, I, J, D = shape
    votes = randn(B, I, J, D, dtype=dtype, device=device, requires_grad=True)
    b = randn(J, D, dtype=dtype, device=device, scale=0.1, requires_grad=True) if bias else None
    return votes, b


def dense_inputs(shape, device="cpu", dtype=torch.float64, bias=True):
    B, I, J, D, Din = shape
    u = randn(B, I, Din, dtype=dtype, device=device, requires_grad=True)
    weight = randn(I, J, D, Din, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    b = randn(J, D, dtype=dtype, device=device, scale=0.1, requires_grad=True) if bias else None
    return u, weight, b


def em_activations_and_betas(B, I, J, dtype=torch.float64, device="cpu", generator=None):
    # Activations well inside (0, 1]: near 0 the outputs bend too sharply for finite differences
    # (gradcheck); exact zeros have their own robustness tests.
    a_in = (
        (0.1 + 0.9 * torch.rand(B, I, dtype=torch.float64, generator=generator))
        .to(device, dtype)
        .requires_grad_()
    )
    beta_u = randn(
        J, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=generator
    )
    beta_a = randn(
        J, dtype=dtype, device=device, scale=0.5, requires_grad=True, generator=generator
    )
    return a_in, beta_u, beta_a


def em_inputs(shape, device="cpu", dtype=torch.float64, generator=None, vote_scale=1.0):
    B, I, J, H = shape
    votes = randn(
        B,
        I,
        J,
        H,
        dtype=dtype,
        device=device,
        scale=vote_scale,
        requires_grad=True,
        generator=generator,
    )
    return (votes, *em_activations_and_betas(B, I, J, dtype, device, generator))


def em_pose_inputs(shape, device="cpu", dtype=torch.float64):
    B, I, J = shape
    pose = randn(B, I, 4, 4, dtype=dtype, device=device, requires_grad=True)
    weight = randn(I, J, 4, 4, dtype=dtype, device=device, scale=0.5, requires_grad=True)
    return (pose, weight, *em_activations_and_betas(B, I, J, dtype, device))


def conv_em_inputs(shape, device="cpu", dtype=torch.float64, generator=None):
    B, H, W, C_in, C_out, K = shape
    pose = randn(
        B, H, W, C_in, 4, 4, dtype=dtype, device=device, requires_grad=True, generator=generator
    )
    weight = randn(
        K,
        K,
        C_in,
        C_out,
        4,
        4,
        dtype=dtype,
        device=device,
        scale=0.5,
        requires_grad=True,
        generator=generator,
    )
    a_in, beta_u, beta_a = em_activations_and_betas(
        B, H * W * C_in, C_out, dtype, device, generator
    )
    a_in = a_in.detach().reshape(B, H, W, C_in).requires_grad_()
    return pose, a_in, weight, beta_u, beta_a


def conv_dynamic_inputs(shape, device="cpu", dtype=torch.float64, bias=True):
    B, H, W, C_in, C_out, D, Din, K = shape
    u = randn(B, H, W, C_in, Din, dtype=dtype, device=device, requires_grad=True)
    weight = randn(
        K, K, C_in, C_out, D, Din, dtype=dtype, device=device, scale=0.3, requires_grad=True
    )
    b = randn(C_out, D, dtype=dtype, device=device, scale=0.1, requires_grad=True) if bias else None
    return u, weight, b


def self_attention_inputs(shape, device="cpu", dtype=torch.float64, coupling_bias=True):
    B, I, J, D = shape
    votes = randn(B, I, J, D, dtype=dtype, device=device, requires_grad=True)
    bias = (
        randn(I, J, dtype=dtype, device=device, scale=0.1, requires_grad=True)
        if coupling_bias
        else None
    )
    return votes, bias


def inverted_attention_inputs(shape, device="cpu", dtype=torch.float64, weight=True, bias=True):
    B, I, J, D = shape
    votes = randn(B, I, J, D, dtype=dtype, device=device, requires_grad=True)
    w = randn(D, dtype=torch.float64, scale=0.1) + 1
    w = w.to(device, dtype).requires_grad_() if weight else None
    b = randn(D, dtype=dtype, device=device, scale=0.1, requires_grad=True) if bias else None
    return votes, w, b


def dense_self_attention_inputs(shape, device="cpu", dtype=torch.float64, coupling_bias=True):
    B, I, J, D, Din = shape
    u, weight, _ = dense_inputs(shape, device, dtype, bias=False)
    bias = self_attention_inputs((B, I, J, D), device, dtype, coupling_bias)[1]
    return u, weight, bias


def dense_inverted_attention_inputs(
    shape, device="cpu", dtype=torch.float64, weight=True, bias=True
):
    B, I, J, D, Din = shape
    u, w, _ = dense_inputs(shape, device, dtype, bias=False)
    return (u, w, *inverted_attention_inputs((B, I, J, D), device, dtype, weight, bias)[1:])
