"""The op table shared by the tests, `capsroute doctor`, the benchmark's checks and the GPU checks:
the storage dtypes, the tolerances against the float64 reference, how to draw each op's inputs, and
the shapes and calls the doctor checks (as torch_scatter/testing.py and flash_attn/utils/testing.py
serve their tests and benchmarks).

Every sampler takes (shape, device, dtype, generator) and returns the op's differentiable inputs in
its order (None for an optional one left out), leaf tensors that require grad: random values drawn
in float64 on the CPU (from `generator`, else the global generator) and then cast, so every device
and dtype gets the same values up to rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Relative tolerance against the float64 reference per storage dtype; EM routing divides by
# variances and gets a factor more.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
EM_TOLERANCE_FACTOR = {torch.float32: 10, torch.float16: 4, torch.bfloat16: 4}
# Self-attention's logits sum products over every input capsule, so their float32 rounding grows
# with the logits (tens at the test shapes) and the softmax passes it on.
SELF_ATTENTION_TOLERANCE_FACTOR = {torch.float32: 2}
EM_OPS = ("em_routing", "em_routing_pose", "conv_em_routing")


def tolerance(op: str, dtype: torch.dtype) -> float:
    """The relative error op may have in dtype against the float64 reference."""
    if op in EM_OPS:
        return TOLERANCE[dtype] * EM_TOLERANCE_FACTOR.get(dtype, 1)
    if "self_attention" in op:
        return TOLERANCE[dtype] * SELF_ATTENTION_TOLERANCE_FACTOR.get(dtype, 1)
    return TOLERANCE[dtype]


def randn(
    *shape, dtype=torch.float64, device="cpu", scale=1.0, requires_grad=False, generator=None
) -> torch.Tensor:
    t = torch.randn(*shape, dtype=torch.float64, generator=generator) * scale
    return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)


def _leaf(*shape, device, dtype, generator, scale=1.0) -> torch.Tensor:
    return randn(
        *shape, dtype=dtype, device=device, scale=scale, requires_grad=True, generator=generator
    )


def squash_inputs(shape, device="cpu", dtype=torch.float64, generator=None):
    return (_leaf(*shape, device=device, dtype=dtype, generator=generator),)


def routing_inputs(shape, device="cpu", dtype=torch.float64, generator=None, bias=True):
    B, I, J, D = shape
    votes = _leaf(B, I, J, D, device=device, dtype=dtype, generator=generator)
    b = _leaf(J, D, device=device, dtype=dtype, generator=generator, scale=0.1) if bias else None
    return votes, b


def dense_inputs(shape, device="cpu", dtype=torch.float64, generator=None, bias=True):
    B, I, J, D, Din = shape
    u = _leaf(B, I, Din, device=device, dtype=dtype, generator=generator)
    weight = _leaf(I, J, D, Din, device=device, dtype=dtype, generator=generator, scale=0.5)
    b = _leaf(J, D, device=device, dtype=dtype, generator=generator, scale=0.1) if bias else None
    return u, weight, b


def em_activations_and_betas(B, I, J, device="cpu", dtype=torch.float64, generator=None):
    """a_in (B, I), beta_u and beta_a (J,). Activations well inside (0, 1]: near 0 the outputs bend
    too sharply for finite differences (gradcheck); exact zeros have their own robustness tests."""
    a_in = 0.1 + 0.9 * torch.rand(B, I, dtype=torch.float64, generator=generator)
    a_in = a_in.to(device, dtype).requires_grad_()
    beta_u = _leaf(J, device=device, dtype=dtype, generator=generator, scale=0.5)
    beta_a = _leaf(J, device=device, dtype=dtype, generator=generator, scale=0.5)
    return a_in, beta_u, beta_a


def em_inputs(shape, device="cpu", dtype=torch.float64, generator=None, vote_scale=1.0):
    B, I, J, H = shape
    votes = _leaf(B, I, J, H, device=device, dtype=dtype, generator=generator, scale=vote_scale)
    return (votes, *em_activations_and_betas(B, I, J, device, dtype, generator))


def em_pose_inputs(shape, device="cpu", dtype=torch.float64, generator=None):
    B, I, J = shape
    pose = _leaf(B, I, 4, 4, device=device, dtype=dtype, generator=generator)
    weight = _leaf(I, J, 4, 4, device=device, dtype=dtype, generator=generator, scale=0.5)
    return (pose, weight, *em_activations_and_betas(B, I, J, device, dtype, generator))


def conv_em_inputs(shape, device="cpu", dtype=torch.float64, generator=None):
    B, H, W, C_in, C_out, K = shape
    pose = _leaf(B, H, W, C_in, 4, 4, device=device, dtype=dtype, generator=generator)
    weight = _leaf(
        K, K, C_in, C_out, 4, 4, device=device, dtype=dtype, generator=generator, scale=0.5
    )
    a_in, beta_u, beta_a = em_activations_and_betas(
        B, H * W * C_in, C_out, device, dtype, generator
    )
    return pose, a_in.detach().reshape(B, H, W, C_in).requires_grad_(), weight, beta_u, beta_a


def conv_dynamic_inputs(shape, device="cpu", dtype=torch.float64, generator=None, bias=True):
    """The weight scaled as nn.ConvDynamicCapsules initialises it (votes of unit size)."""
    B, H, W, C_in, C_out, D, Din, K = shape
    u = _leaf(B, H, W, C_in, Din, device=device, dtype=dtype, generator=generator)
    scale = (K * K * max(Din, 1)) ** -0.5
    weight = _leaf(
        K, K, C_in, C_out, D, Din, device=device, dtype=dtype, generator=generator, scale=scale
    )
    b = (
        _leaf(C_out, D, device=device, dtype=dtype, generator=generator, scale=0.1)
        if bias
        else None
    )
    return u, weight, b


def self_attention_inputs(
    shape, device="cpu", dtype=torch.float64, generator=None, coupling_bias=True
):
    B, I, J, D = shape
    votes = _leaf(B, I, J, D, device=device, dtype=dtype, generator=generator)
    bias = (
        _leaf(I, J, device=device, dtype=dtype, generator=generator, scale=0.1)
        if coupling_bias
        else None
    )
    return votes, bias


def inverted_attention_inputs(
    shape, device="cpu", dtype=torch.float64, generator=None, weight=True, bias=True
):
    """votes, and the LayerNorm's weight near 1 and bias near 0."""
    B, I, J, D = shape
    votes = _leaf(B, I, J, D, device=device, dtype=dtype, generator=generator)
    w = (1 + randn(D, scale=0.1, generator=generator)).to(device, dtype).requires_grad_()
    b = _leaf(D, device=device, dtype=dtype, generator=generator, scale=0.1)
    return votes, (w if weight else None), (b if bias else None)


def dense_self_attention_inputs(
    shape, device="cpu", dtype=torch.float64, generator=None, coupling_bias=True
):
    B, I, J, D, Din = shape
    u, weight, _ = dense_inputs(shape, device, dtype, generator, bias=False)
    bias = self_attention_inputs((B, I, J, D), device, dtype, generator, coupling_bias)[1]
    return u, weight, bias


def dense_inverted_attention_inputs(
    shape, device="cpu", dtype=torch.float64, generator=None, weight=True, bias=True
):
    B, I, J, D, Din = shape
    u, w, _ = dense_inputs(shape, device, dtype, generator, bias=False)
    params = inverted_attention_inputs((B, I, J, D), device, dtype, generator, weight, bias)[1:]
    return (u, w, *params)


@dataclass(frozen=True)
class OpCheck:
    """How an op's inputs are drawn and the op called: call(module, *tensors) with module capsroute
    or capsroute.reference (looked up at every call) returns the outputs, the first grad_outputs of
    them differentiable; the shapes the doctor checks and times it at."""

    name: str
    make: Callable  # a sampler: (shape, device, dtype, generator) -> the differentiable inputs
    call: Callable
    grad_outputs: int
    small: dict  # label -> shape: odd sizes (J > 32 or D > 16 where the op has the warp rows)
    canonical: dict  # label -> shape: the canonical ones at a small batch
    timing: tuple  # (label, shape on the CPU, shape on CUDA): where it is timed against eager
    # which CUDA paths it has: "squash", "routing", "dense", "em", "conv-em", "conv", "attention"
    # or "dense-attention"
    family: str

    def shapes(self, quick: bool) -> dict:
        return self.small if quick else {**self.small, **self.canonical}

    def tolerance(self, dtype) -> float:
        return tolerance(self.name, dtype)


OPS = [
    OpCheck(
        "squash",
        squash_inputs,
        lambda m, s: (m.squash(s),),
        1,
        {"7x16": (7, 16), "3x5x33": (3, 5, 33)},
        {"primary B=2": (2, 1152, 8)},
        ("primary", (32, 1152, 8), (512, 1152, 8)),
        "squash",
    ),
    OpCheck(
        "dynamic_routing",
        routing_inputs,
        lambda m, votes, bias: (m.dynamic_routing(votes, bias=bias),),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"mnist B=2": (2, 1152, 10, 16)},
        ("mnist", (32, 1152, 10, 16), (512, 1152, 10, 16)),
        "routing",
    ),
    OpCheck(
        "dense_capsules",
        dense_inputs,
        lambda m, u, weight, bias: (m.dense_capsules(u, weight, bias=bias),),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"mnist B=2": (2, 1152, 10, 16, 8)},
        ("mnist", (32, 1152, 10, 16, 8), (512, 1152, 10, 16, 8)),
        "dense",
    ),
    OpCheck(
        "em_routing",
        em_inputs,
        lambda m, *tensors: m.em_routing(*tensors),
        2,
        {"3,37,7,16": (3, 37, 7, 16), "2,19,10,4": (2, 19, 10, 4)},
        {"em-class B=2": (2, 512, 10, 16), "em-conv B=4": (4, 288, 32, 16)},
        ("em-class", (16, 512, 10, 16), (256, 512, 10, 16)),
        "em",
    ),
    OpCheck(
        "em_routing_pose",
        em_pose_inputs,
        lambda m, *tensors: m.em_routing_pose(*tensors),
        2,
        {"3,37,7": (3, 37, 7)},
        {"em-class B=2": (2, 512, 10), "em-conv B=4": (4, 288, 32)},
        ("em-class", (16, 512, 10), (256, 512, 10)),
        "em",
    ),
    # Every shape with stride 2 and padding 1: overlapping windows, padding and a stride at once.
    # (K = 2 there leaves corner windows one real child wide: too ill-conditioned for float32.)
    OpCheck(
        "conv_em_routing",
        conv_em_inputs,
        lambda m, *tensors: m.conv_em_routing(*tensors, stride=2, padding=1),
        2,
        {"2,5,5,3,4 K=3": (2, 5, 5, 3, 4, 3), "1,7,6,2,3 K=3": (1, 7, 6, 2, 3, 3)},
        {"conv1 12x12 8->16 B=2": (2, 12, 12, 8, 16, 3)},
        ("conv1 12x12 8->16", (16, 12, 12, 8, 16, 3), (64, 12, 12, 8, 16, 3)),
        "conv-em",
    ),
    # SegCaps-like: 5 x 5 windows with padding 2 (the grid keeps its size), 8 types of 16D.
    OpCheck(
        "conv_dynamic_routing",
        conv_dynamic_inputs,
        lambda m, u, weight, bias: (m.conv_dynamic_routing(u, weight, bias=bias, padding=2),),
        1,
        {
            "2,5,6,3,33,4,5 K=5": (2, 5, 6, 3, 33, 4, 5, 5),
            "1,4,4,2,3,32,3 K=3": (1, 4, 4, 2, 3, 32, 3, 3),
        },
        {"segcaps 16x16 8->8 B=2": (2, 16, 16, 8, 8, 16, 16, 5)},
        ("segcaps 8->8", (2, 32, 32, 8, 8, 16, 16, 5), (16, 64, 64, 8, 8, 16, 16, 5)),
        "conv",
    ),
    # Efficient-CapsNet's class capsules: 16 primary capsules vote for 10 of 16D.
    OpCheck(
        "self_attention_routing",
        self_attention_inputs,
        lambda m, votes, coupling_bias: (
            m.self_attention_routing(votes, coupling_bias=coupling_bias),
        ),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"effcaps B=2": (2, 16, 10, 16)},
        ("effcaps", (256, 16, 10, 16), (4096, 16, 10, 16)),
        "attention",
    ),
    OpCheck(
        "inverted_attention_routing",
        inverted_attention_inputs,
        lambda m, votes, norm_weight, norm_bias: (
            m.inverted_attention_routing(votes, norm_weight=norm_weight, norm_bias=norm_bias),
        ),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"mnist B=2": (2, 1152, 10, 16)},
        ("mnist", (32, 1152, 10, 16), (512, 1152, 10, 16)),
        "attention",
    ),
    OpCheck(
        "dense_self_attention_routing",
        dense_self_attention_inputs,
        lambda m, u, weight, coupling_bias: (
            m.dense_self_attention_routing(u, weight, coupling_bias=coupling_bias),
        ),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"effcaps B=2": (2, 16, 10, 16, 8)},
        ("effcaps", (256, 16, 10, 16, 8), (4096, 16, 10, 16, 8)),
        "dense-attention",
    ),
    OpCheck(
        "dense_inverted_attention_routing",
        dense_inverted_attention_inputs,
        lambda m, u, weight, norm_weight, norm_bias: (
            m.dense_inverted_attention_routing(
                u, weight, norm_weight=norm_weight, norm_bias=norm_bias
            ),
        ),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"mnist B=2": (2, 1152, 10, 16, 8)},
        ("mnist", (32, 1152, 10, 16, 8), (512, 1152, 10, 16, 8)),
        "dense-attention",
    ),
]
SAMPLES = {check.name: check for check in OPS}
