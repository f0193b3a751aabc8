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

from capsroute.ops import reference

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# Relative tolerance against the float64 reference per storage dtype; EM routing divides by
# variances and gets a factor more.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
EM_TOLERANCE_FACTOR = {torch.float32: 10, torch.float16: 4, torch.bfloat16: 4}
# Self-attention's logits sum products over every input capsule, so their float32 rounding grows
# with the logits (tens at the test shapes) and the softmax passes it on.
SELF_ATTENTION_TOLERANCE_FACTOR = {torch.float32: 2}
EM_OPS = ("em_routing", "em_routing_pose", "conv_em_routing")


# The GPU checks (scripts/gpu_sweep.py, scripts/sanitizer_workload.py) reach what the contract's
# shapes do not: sums over 16384 input capsules, batches of 2048, LayerNorms over D = 1. There
# float32's rounding gets a factor more: EM's log-variances 2, the agreement's sums 5.
GPU_CHECK_FACTOR = {"em": 2, "agreement": 5}


def tolerance(op: str, dtype: torch.dtype, gpu_check: bool = False) -> float:
    """The relative error op may have in dtype against the float64 reference (gpu_check: in the
    GPU checks, GPU_CHECK_FACTOR)."""
    em = op in EM_OPS
    tol = TOLERANCE[dtype]
    if em:
        tol *= EM_TOLERANCE_FACTOR.get(dtype, 1)
    elif "self_attention" in op:
        tol *= SELF_ATTENTION_TOLERANCE_FACTOR.get(dtype, 1)
    if gpu_check and dtype == torch.float32:
        tol *= GPU_CHECK_FACTOR["em" if em else "agreement"]
    return tol


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


# What a layer feeds each op, for the benchmark: drawn on the device in float32 (its sizes reach
# gigabytes) from `generator`, then cast. Shapes as the samplers' above, but the attention
# routings' votes come from u and a weight, so their vote-input forms take (B, I, J, D, Din) too.
VOTE_STD = 0.1  # dynamic_routing votes ~ N(0, 0.1^2): |s| ~ 1, so squash and the agreement matter
WEIGHT_STD = 0.05  # dense_capsules weight ~ N(0, 0.05^2); u = squash(N(0, 1)) like primary capsules
# The attention layers' other parameters near their initial values, never constants:
# self_attention_routing's coupling bias ~ N(0, 0.01^2) (the layer's starts at 0),
# inverted_attention_routing's norm_weight ~ 1 + N(0, 0.1^2) and norm_bias ~ N(0, 0.1^2)
COUPLING_BIAS_STD = 0.01
NORM_STD = 0.1
VOTE_CHUNK = 1024  # input capsules whose weights layer_votes draws at once


def _drawer(device, dtype, generator):
    def draw(*shape, std=1.0, cast=True):
        x = torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).mul_(std)
        return x.to(dtype) if cast else x

    return draw


def layer_routing(shape, device, dtype, generator):
    return (_drawer(device, dtype, generator)(*shape, std=VOTE_STD),)


def layer_dense(shape, device, dtype, generator):
    B, I, J, D, Din = shape
    draw = _drawer(device, dtype, generator)
    u = reference.squash(draw(B, I, Din, cast=False)).to(dtype)
    return u, draw(I, J, D, Din, std=WEIGHT_STD)


def layer_conv_dynamic(shape, device, dtype, generator):
    B, H, W, C_in, C_out, D, Din, K = shape
    draw = _drawer(device, dtype, generator)
    u = reference.squash(draw(B, H, W, C_in, Din, cast=False)).to(dtype)
    return u, draw(K, K, C_in, C_out, D, Din, std=(K * K * Din) ** -0.5)  # the layer's init


def _layer_activations(B, I, J, device, dtype, generator, draw):
    """a_in ~ U(0, 1) (B, I), beta_u and beta_a ~ N(0, 0.5^2) (J,)."""
    a_in = torch.rand(B, I, generator=generator, device=device).to(dtype)
    return a_in, draw(J, std=0.5), draw(J, std=0.5)


def layer_em(shape, device, dtype, generator):
    B, I, J, H = shape
    draw = _drawer(device, dtype, generator)
    activations = _layer_activations(B, I, J, device, dtype, generator, draw)
    return draw(B, I, J, H), *activations


def layer_em_pose(shape, device, dtype, generator):
    B, I, J = shape
    draw = _drawer(device, dtype, generator)
    activations = _layer_activations(B, I, J, device, dtype, generator, draw)
    return draw(B, I, 4, 4), draw(I, J, 4, 4, std=0.5), *activations


def layer_conv_em(shape, device, dtype, generator):
    B, H, W, C_in, C_out, K = shape
    draw = _drawer(device, dtype, generator)
    pose = draw(B, H, W, C_in, 16)
    a_in = torch.rand(B, H, W, C_in, generator=generator, device=device).to(dtype)
    weight = draw(K, K, C_in, C_out, 4, 4, std=0.5)
    return pose, a_in, weight, draw(C_out, std=0.5), draw(C_out, std=0.5)


def _self_attention_u(shape, draw):
    """SelfAttentionCapsules' inputs: primary capsules squashed by Efficient-CapsNet's squash, a
    weight of he_normal's standard deviation sqrt(2 / (I J Din))."""
    B, I, J, D, Din = shape
    return reference.squash_exp(draw(B, I, Din, cast=False)), (2 / (I * J * Din)) ** 0.5


def _inverted_attention_u(shape, draw):
    """InvertedAttentionCapsules' inputs: primary capsules LayerNorm'd (Tsai et al.'s), a weight
    N(0, J / (I Din))."""
    B, I, J, D, Din = shape
    u = torch.nn.functional.layer_norm(draw(B, I, Din, cast=False), (Din,))
    return u, (J / (I * Din)) ** 0.5


def _attention_layer(primary, dense: bool, parameters):
    def sample(shape, device, dtype, generator):
        draw = _drawer(device, dtype, generator)
        u, std = primary(shape, draw)
        return (
            *attention_votes(dense, u, shape, std, draw, dtype),
            *parameters(shape, draw, dtype),
        )

    return sample


def _coupling_bias(shape, draw, dtype):
    return (draw(shape[1], shape[2], std=COUPLING_BIAS_STD),)


def _norm_parameters(shape, draw, dtype):
    D = shape[3]
    return (1 + draw(D, std=NORM_STD, cast=False)).to(dtype), draw(D, std=NORM_STD)


def attention_votes(dense: bool, u, shape, std: float, draw, dtype) -> tuple:
    """The capsule inputs of an attention layer with weight ~ N(0, std^2): (u, weight) for the dense
    forms, its votes (layer_votes) for the vote-input ones, the same values either way (the weight
    is drawn VOTE_CHUNK input capsules at a time in both)."""
    B, I, J, D, Din = shape
    if not dense:
        return (layer_votes(u, J, D, std, draw).to(dtype),)
    chunks = [
        draw(min(VOTE_CHUNK, I - i), J, D, Din, std=std, cast=False)
        for i in range(0, I, VOTE_CHUNK)
    ]
    return u.to(dtype), torch.cat(chunks).to(dtype)


def layer_votes(u: torch.Tensor, J: int, D: int, std: float, draw) -> torch.Tensor:
    """The votes W_ij u_i (B, I, J, D) of a dense capsule layer with weight W ~ N(0, std^2) (I, J, D,
    Din), as the attention layers compute them (reference.dense_votes), in float32. The weight is
    drawn VOTE_CHUNK input capsules at a time, so it is never whole in memory (0.8 GB at I = 16384,
    J = 100, D = 16, Din = 8)."""
    B, I, Din = u.shape
    votes = torch.empty(B, I, J, D, device=u.device)
    with torch.no_grad():
        for i in range(0, I, VOTE_CHUNK):
            n = min(VOTE_CHUNK, I - i)
            votes[:, i : i + n] = reference.dense_votes(
                u[:, i : i + n], draw(n, J, D, Din, std=std, cast=False)
            )
    return votes


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
    draw: Callable | None = None  # what a layer feeds it (the benchmark's inputs), as layer_routing
    activation: int | None = None  # EM ops: the index of a_in among the inputs

    def shapes(self, quick: bool) -> dict:
        return self.small if quick else {**self.small, **self.canonical}

    def tolerance(self, dtype) -> float:
        return tolerance(self.name, dtype)


OPS = [
    OpCheck(
        "squash",
        squash_inputs,
        lambda m, s, **kw: (m.squash(s, **kw),),
        1,
        {"7x16": (7, 16), "3x5x33": (3, 5, 33)},
        {"primary B=2": (2, 1152, 8)},
        ("primary", (32, 1152, 8), (512, 1152, 8)),
        "squash",
    ),
    OpCheck(
        "dynamic_routing",
        routing_inputs,
        lambda m, votes, bias, **kw: (m.dynamic_routing(votes, bias=bias, **kw),),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"mnist B=2": (2, 1152, 10, 16)},
        ("mnist", (32, 1152, 10, 16), (512, 1152, 10, 16)),
        "routing",
        draw=layer_routing,
    ),
    OpCheck(
        "dense_capsules",
        dense_inputs,
        lambda m, u, weight, bias, **kw: (m.dense_capsules(u, weight, bias=bias, **kw),),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"mnist B=2": (2, 1152, 10, 16, 8)},
        ("mnist", (32, 1152, 10, 16, 8), (512, 1152, 10, 16, 8)),
        "dense",
        draw=layer_dense,
    ),
    OpCheck(
        "em_routing",
        em_inputs,
        lambda m, *tensors, **kw: m.em_routing(*tensors, **kw),
        2,
        {"3,37,7,16": (3, 37, 7, 16), "2,19,10,4": (2, 19, 10, 4)},
        {"em-class B=2": (2, 512, 10, 16), "em-conv B=4": (4, 288, 32, 16)},
        ("em-class", (16, 512, 10, 16), (256, 512, 10, 16)),
        "em",
        draw=layer_em,
        activation=1,
    ),
    OpCheck(
        "em_routing_pose",
        em_pose_inputs,
        lambda m, *tensors, **kw: m.em_routing_pose(*tensors, **kw),
        2,
        {"3,37,7": (3, 37, 7)},
        {"em-class B=2": (2, 512, 10), "em-conv B=4": (4, 288, 32)},
        ("em-class", (16, 512, 10), (256, 512, 10)),
        "em",
        draw=layer_em_pose,
        activation=2,
    ),
    # Every shape with stride 2 and padding 1: overlapping windows, padding and a stride at once.
    # (K = 2 there leaves corner windows one real child wide: too ill-conditioned for float32.)
    OpCheck(
        "conv_em_routing",
        conv_em_inputs,
        lambda m, *tensors, **kw: m.conv_em_routing(*tensors, **{"stride": 2, "padding": 1, **kw}),
        2,
        {"2,5,5,3,4 K=3": (2, 5, 5, 3, 4, 3), "1,7,6,2,3 K=3": (1, 7, 6, 2, 3, 3)},
        {"conv1 12x12 8->16 B=2": (2, 12, 12, 8, 16, 3)},
        ("conv1 12x12 8->16", (16, 12, 12, 8, 16, 3), (64, 12, 12, 8, 16, 3)),
        "conv-em",
        draw=layer_conv_em,
        activation=1,
    ),
    # SegCaps-like: 5 x 5 windows with padding 2 (the grid keeps its size), 8 types of 16D.
    OpCheck(
        "conv_dynamic_routing",
        conv_dynamic_inputs,
        lambda m, u, weight, bias, **kw: (
            m.conv_dynamic_routing(u, weight, bias=bias, **{"padding": 2, **kw}),
        ),
        1,
        {
            "2,5,6,3,33,4,5 K=5": (2, 5, 6, 3, 33, 4, 5, 5),
            "1,4,4,2,3,32,3 K=3": (1, 4, 4, 2, 3, 32, 3, 3),
        },
        {"segcaps 16x16 8->8 B=2": (2, 16, 16, 8, 8, 16, 16, 5)},
        ("segcaps 8->8", (2, 32, 32, 8, 8, 16, 16, 5), (16, 64, 64, 8, 8, 16, 16, 5)),
        "conv",
        draw=layer_conv_dynamic,
    ),
    # Efficient-CapsNet's class capsules: 16 primary capsules vote for 10 of 16D.
    OpCheck(
        "self_attention_routing",
        self_attention_inputs,
        lambda m, votes, coupling_bias, **kw: (
            m.self_attention_routing(votes, coupling_bias=coupling_bias, **kw),
        ),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"effcaps B=2": (2, 16, 10, 16)},
        ("effcaps", (256, 16, 10, 16), (4096, 16, 10, 16)),
        "attention",
        draw=_attention_layer(_self_attention_u, False, _coupling_bias),
    ),
    OpCheck(
        "inverted_attention_routing",
        inverted_attention_inputs,
        lambda m, votes, norm_weight, norm_bias, **kw: (
            m.inverted_attention_routing(votes, norm_weight=norm_weight, norm_bias=norm_bias, **kw),
        ),
        1,
        {"3,37,7,16": (3, 37, 7, 16), "2,65,33,4": (2, 65, 33, 4)},
        {"mnist B=2": (2, 1152, 10, 16)},
        ("mnist", (32, 1152, 10, 16), (512, 1152, 10, 16)),
        "attention",
        draw=_attention_layer(_inverted_attention_u, False, _norm_parameters),
    ),
    OpCheck(
        "dense_self_attention_routing",
        dense_self_attention_inputs,
        lambda m, u, weight, coupling_bias, **kw: (
            m.dense_self_attention_routing(u, weight, coupling_bias=coupling_bias, **kw),
        ),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"effcaps B=2": (2, 16, 10, 16, 8)},
        ("effcaps", (256, 16, 10, 16, 8), (4096, 16, 10, 16, 8)),
        "dense-attention",
        draw=_attention_layer(_self_attention_u, True, _coupling_bias),
    ),
    OpCheck(
        "dense_inverted_attention_routing",
        dense_inverted_attention_inputs,
        lambda m, u, weight, norm_weight, norm_bias, **kw: (
            m.dense_inverted_attention_routing(
                u, weight, norm_weight=norm_weight, norm_bias=norm_bias, **kw
            ),
        ),
        1,
        {"3,37,7,16,8": (3, 37, 7, 16, 8), "2,19,33,4,3": (2, 19, 33, 4, 3)},
        {"mnist B=2": (2, 1152, 10, 16, 8)},
        ("mnist", (32, 1152, 10, 16, 8), (512, 1152, 10, 16, 8)),
        "dense-attention",
        draw=_attention_layer(_inverted_attention_u, True, _norm_parameters),
    ),
]
SAMPLES = {check.name: check for check in OPS}
