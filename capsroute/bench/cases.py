"""What `capsroute bench` runs: the ops and their shapes, the cases (op x shape x batch), and each
case's random inputs and implementations."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch

import capsroute
from capsroute import reference
from capsroute.nn import ConvCapsules
from capsroute.ops._fake import conv_output_size
from capsroute.testing import SAMPLES

OPS = {  # op -> the short name that `--op` also accepts
    "dynamic_routing": "dynamic",
    "dense_capsules": "dense",
    "em_routing": "em",
    "em_routing_pose": "em-pose",
    "self_attention_routing": "self-attention",
    "inverted_attention_routing": "inverted-attention",
    "dense_self_attention_routing": "dense-self-attention",
    "dense_inverted_attention_routing": "dense-inverted-attention",
}
EM_OPS = ("em_routing", "em_routing_pose")
ATTENTION_OPS = ("self_attention_routing", "inverted_attention_routing")
# The attention routings on votes made on the fly from u and a weight: the same shapes as the
# vote-input ops, and the same tensors (u, the weight and the parameters the votes of
# ATTENTION_OPS are made from), their baseline the reference's einsum votes then routing.
DENSE_ATTENTION_OPS = ("dense_self_attention_routing", "dense_inverted_attention_routing")
DENSE_OPS = ("dense_capsules", *DENSE_ATTENTION_OPS)  # (B, I, Din) and (I, J, D, Din) inputs
ONE_STEP_OPS = ("self_attention_routing", "dense_self_attention_routing")  # no iterations
CONV_OPS = {  # convolutional capsule layers: their shapes are ConvShape grids (CONV_SHAPES)
    "conv_em_routing": "conv-em",
    "conv_dynamic_routing": "conv-dynamic",
}
MODEL_OPS = {  # a whole training step of a model of capsroute.models; the short name is the same
    "capsnet": "capsnet",
    "matrixcapsnet": "matrixcapsnet",
    "efficientcapsnet": "efficientcapsnet",
}
ALL_OPS = {**OPS, **CONV_OPS, **MODEL_OPS}
IMPLS = ("capsroute", "eager", "compiled", "per-window")
# Impls of some ops only: per-window is nn.ConvCapsules(routing="window") (unfold +
# em_routing_pose), the fused layer conv_em_routing replaces. It routes each window on its own,
# another function than the op's: it is not checked against eager.
OP_IMPLS = {"per-window": ("conv_em_routing",)}
UNCHECKED_IMPLS = ("per-window",)
# The layouts of the first input (votes, u) the ops with a layout dimension are timed in; every
# implementation of a case gets the same tensors. The other ops run on contiguous inputs.
LAYOUTS = ("contiguous", "einsum")
LAYOUT_OPS = ("dynamic_routing", *DENSE_OPS, *ATTENTION_OPS)
SHAPES = {  # the canonical shapes (bench/README.md); for EM ops D is the pose size H (16: 4x4 matrices)
    "mnist": dict(I=1152, J=10, D=16, Din=8),  # MNIST DigitCaps
    "large": dict(I=4608, J=100, D=16, Din=8),
    "efficientcapsnet": dict(I=16, J=10, D=16, Din=8),  # Efficient-CapsNet's class capsules
    "large-16k": dict(I=16384, J=100, D=16, Din=8),  # the attention routings' large shape
    "em-class": dict(I=512, J=10, D=16, Din=16),  # EM class capsules
    "em-conv": dict(
        I=288, J=32, D=16, Din=16
    ),  # EM conv capsules: 3*3*32 inputs, B = batch x 36 positions
    "scale-100": dict(
        I=16384, J=100, D=32, Din=8
    ),  # far past MNIST: time should grow no faster than the work
    "scale-1000": dict(I=16384, J=1000, D=32, Din=8),
}
DEFAULT_BATCHES = {
    "cpu": {
        "mnist": [32],
        "large": [8],
        "large-16k": [2],
        "em-class": [16],
        "em-conv": [2 * 36],
        None: [32],
    },
    "cuda": {
        "mnist": [32, 128, 512, 2048],
        "large": [32, 128, 512, 2048],
        "large-16k": [8, 32, 128],  # votes 105 MB a batch element in float32
        "em-class": [64, 256],
        "em-conv": [64 * 36],
        None: [32, 128, 512, 2048],
    },
}


@dataclass(frozen=True)
class ConvShape:
    """A convolutional capsule layer: an H x W grid of C_in capsule types of Din values, K x K
    windows at `stride` with `padding`, C_out types of D values out (conv EM: D = Din = 16, 4x4 poses)."""

    H: int
    W: int
    C_in: int
    C_out: int
    D: int
    Din: int
    K: int
    stride: int = 1
    padding: int = 0

    def out_hw(self) -> tuple[int, int]:
        return tuple(
            conv_output_size(n, self.K, self.stride, self.padding) for n in (self.H, self.W)
        )


CONV_SHAPES = {  # bench/README.md, "Conv ops"
    "mcn-conv1": ConvShape(12, 12, 8, 16, 16, 16, K=3, stride=2),  # MatrixCapsNet ConvCaps1
    "mcn-conv2": ConvShape(5, 5, 16, 16, 16, 16, K=3, stride=1),  # MatrixCapsNet ConvCaps2
    "conv-image": ConvShape(64, 64, 32, 32, 16, 16, K=3),  # image scale
    "segcaps": ConvShape(64, 64, 8, 8, 16, 16, K=5, padding=2),  # SegCaps-like (conv dynamic)
}
DEFAULT_CONV_SHAPES = {
    "conv_em_routing": ["mcn-conv1", "mcn-conv2", "conv-image"],
    "conv_dynamic_routing": ["conv-image", "segcaps"],
}
CONV_BATCHES = {  # None: a conv shape given as HxW:...
    "cpu": {"mcn-conv1": [16], "mcn-conv2": [16], "conv-image": [1], "segcaps": [2], None: [2]},
    "cuda": {
        "mcn-conv1": [128, 512],
        "mcn-conv2": [128, 512],
        "conv-image": [1, 4],
        "segcaps": [4, 16],
        None: [8],
    },
}
MODEL_BATCHES = {"cpu": [16], "cuda": [32, 128, 512]}
MODEL_SHAPE_NAME = "1x28x28"  # model ops train on MNIST-sized images
DEFAULT_SHAPES = {"cpu": ["mnist"], "cuda": ["mnist", "large"], "em": ["em-class", "em-conv"]}
ATTENTION_SHAPES = {  # the attention routings' default shapes
    "cpu": ["efficientcapsnet", "mnist"],
    "cuda": ["efficientcapsnet", "mnist", "large-16k"],
}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class Case:
    op: str
    shape_name: str  # "mnist", "large", "I,J,D,Din", a CONV_SHAPES name or "HxW:..."
    B: int
    I: int = 0
    J: int = 0
    D: int = 0
    Din: int = 0
    layout: str = "contiguous"  # LAYOUTS
    conv: ConvShape | None = None  # the conv ops' shape (I, J, D, Din are then 0)

    def shape(self) -> dict:
        if self.op in MODEL_OPS:
            return {"B": self.B, "model": self.op}
        if self.conv is not None:
            return {"B": self.B, **dataclasses.asdict(self.conv)}
        if self.op in EM_OPS:
            return {"B": self.B, "I": self.I, "J": self.J, "H": self.D}
        s = {"B": self.B, "I": self.I, "J": self.J, "D": self.D}
        if self.op in DENSE_OPS:
            s["Din"] = self.Din
        return s

    def label(self) -> str:
        return f"{self.op} {self.shape_name} B={self.B}" + (
            f" {self.layout}" if self.layout != "contiguous" else ""
        )


def parse_shape(spec: str) -> tuple[str, dict]:
    """'mnist' | 'large' | 'I,J,D,Din' (Din may be left out: 8) -> (name, dict(I, J, D, Din));
    a CONV_SHAPES name or 'HxW:C_in,C_out,D,Din,K[,stride[,padding]]' -> (name, dict(conv=ConvShape))."""
    if spec in SHAPES:
        return spec, dict(SHAPES[spec])
    if spec in CONV_SHAPES:
        return spec, {"conv": CONV_SHAPES[spec]}
    conv = re.fullmatch(r"(\d+)x(\d+):(\d+(,\d+){4,6})", spec)
    if conv:
        sizes = [int(conv[1]), int(conv[2])] + [int(p) for p in conv[3].split(",")]
        shape = ConvShape(*sizes)
        if min(sizes[:7]) < 1 or shape.stride < 1 or min(shape.out_hw()) < 1:
            raise argparse.ArgumentTypeError(f"conv shape {spec!r}: no output position")
        return spec, {"conv": shape}
    parts = (
        [int(p) for p in re.split(r"[,x]", spec)]
        if re.fullmatch(r"\d+([,x]\d+){2,3}", spec)
        else []
    )
    if not parts or min(parts) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be one of {', '.join([*SHAPES, *CONV_SHAPES])}, I,J,D[,Din] or "
            f"HxW:C_in,C_out,D,Din,K[,stride[,padding]]; got {spec!r}"
        )
    if len(parts) == 3:
        parts.append(8)
    return ",".join(map(str, parts)), dict(zip(("I", "J", "D", "Din"), parts))


def op_list() -> str:
    return ", ".join(f"{op} ({short})" if short != op else op for op, short in ALL_OPS.items())


def op_name(name: str) -> str:
    """An op's name from its name or short name (OPS, MODEL_OPS)."""
    for op, short in ALL_OPS.items():
        if name in (op, short):
            return op
    raise argparse.ArgumentTypeError(f"unknown op {name!r}; choose from {op_list()}")


def make_cases(ops, shapes, batches, device_type: str, layouts=("contiguous",)) -> list[Case]:
    """shapes: parse_shape results, or None for each op's default shapes; the conv ops (CONV_OPS)
    take the conv shapes of the list, the others the rest. Model ops (MODEL_OPS) have no shape
    (MNIST-sized images): shapes do not apply to them, batches (else MODEL_BATCHES) do.
    layouts (LAYOUTS): a case per layout for the ops of LAYOUT_OPS, contiguous only for the rest."""
    cases = []
    for op in ops:
        if op in MODEL_OPS:
            for B in batches or MODEL_BATCHES[device_type]:
                cases.append(Case(op, MODEL_SHAPE_NAME, B))
            continue
        if shapes is None:
            if op in CONV_OPS:
                names = DEFAULT_CONV_SHAPES[op]
            elif op in ATTENTION_OPS + DENSE_ATTENTION_OPS:
                names = ATTENTION_SHAPES[device_type]
            else:
                names = DEFAULT_SHAPES["em" if op in EM_OPS else device_type]
            op_shapes = [parse_shape(name) for name in names]
        else:
            op_shapes = [(n, dims) for n, dims in shapes if ("conv" in dims) == (op in CONV_OPS)]
            if not op_shapes:
                kind = "conv shape (HxW:...)" if op in CONV_OPS else "shape I,J,D[,Din]"
                raise argparse.ArgumentTypeError(f"{op} needs a {kind}; none was given")
        for name, dims in op_shapes:
            pose = dims["conv"].D == dims["conv"].Din == 16 if "conv" in dims else dims["D"] == 16
            if op in ("em_routing_pose", "conv_em_routing") and not pose:
                raise argparse.ArgumentTypeError(f"{op} needs 4x4 poses (H = 16), got shape {name}")
            if op in CONV_OPS:
                bs = batches or CONV_BATCHES[device_type].get(name if name in CONV_SHAPES else None)
            else:
                defaults = DEFAULT_BATCHES[device_type]  # a shape without its own: None's
                bs = batches or defaults.get(name, defaults[None])
            for B in bs:
                for layout in layouts if op in LAYOUT_OPS else ("contiguous",):
                    cases.append(Case(op, name, B, **dims, layout=layout))
    return cases


def lay_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """x's values in `layout`: "contiguous", or "einsum" input-capsule-major: votes (B, I, J, D) at
    strides (J*D, B*J*D, D, 1), as torch.einsum("bik,ijdk->bijd", u, W) returns them, and u
    (B, I, Din) at (Din, B*Din, 1), as a permute of (I, B, Din) capsules (or a matmul over them) gives."""
    if layout == "contiguous":
        return x.contiguous()
    if layout == "einsum":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    raise ValueError(f"unknown layout {layout!r}")


def sample_shape(case: Case) -> tuple:
    """The case's shape as the op table's samplers take it (capsroute.testing): the attention
    routings' with Din, their votes made by a layer from u."""
    if case.op == "conv_em_routing":
        c = case.conv
        return case.B, c.H, c.W, c.C_in, c.C_out, c.K
    if case.op == "conv_dynamic_routing":
        c = case.conv
        return case.B, c.H, c.W, c.C_in, c.C_out, c.D, c.Din, c.K
    if case.op == "em_routing_pose":
        return case.B, case.I, case.J
    if case.op in DENSE_OPS + ATTENTION_OPS:
        return case.B, case.I, case.J, case.D, case.Din
    return case.B, case.I, case.J, case.D


def make_inputs(op: str, case: Case, dtype: torch.dtype, device, seed: int = 0):
    """Fresh random inputs (never zeros), what a layer feeds the op (the op table's draw), the
    first in the case's layout: (tuple of leaf tensors requiring grad, grad_v)."""
    if op not in SAMPLES or SAMPLES[op].draw is None:
        raise ValueError(f"unknown op {op!r}")
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = SAMPLES[op].draw(sample_shape(case), device, dtype, gen)
    inputs = (lay_out(inputs[0], case.layout), *inputs[1:])
    for t in inputs:
        t.requires_grad_(True)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if case.conv is not None:
        out = (case.B, *case.conv.out_hw(), case.conv.C_out)
        if op == "conv_em_routing":  # gradients of (pose, a_out)
            return inputs, (randn(*out, 16), randn(*out))
        return inputs, randn(*out, case.conv.D)
    if op in EM_OPS:  # gradients of (pose, a_out)
        return inputs, (randn(case.B, case.J, case.D), randn(case.B, case.J))
    return inputs, randn(case.B, case.J, case.D)


def impls_for(op: str, impls) -> list[str]:
    """The impls of `impls` that `op` has (OP_IMPLS)."""
    return [i for i in impls if op in OP_IMPLS.get(i, (op,))]


def get_impl(case: Case, impl: str) -> Callable:
    """The function to time, called as fn(*inputs, iters). 'compiled' gives a fresh torch.compile wrapper."""
    if impl == "per-window":
        return per_window_conv_em(case.conv)
    fn = {"capsroute": capsroute, "eager": reference, "compiled": reference}[impl]
    fn = getattr(fn, case.op)
    if case.op in ATTENTION_OPS + DENSE_ATTENTION_OPS:
        fn = attention_call(case.op, fn)
    if case.conv is not None:
        fn = functools.partial(fn, stride=case.conv.stride, padding=case.conv.padding)
    return torch.compile(fn) if impl == "compiled" else fn


def attention_call(op: str, fn: Callable) -> Callable:
    """An attention routing (capsroute's or the reference's) called as the bench calls ops,
    fn(*inputs, iters): self_attention_routing(votes, coupling_bias) has no iterations (iters is
    not used; its default squash, Efficient-CapsNet's), inverted_attention_routing(votes,
    norm_weight, norm_bias) routes iters times; their dense forms take (u, weight) for votes."""
    if op in ("self_attention_routing", "dense_self_attention_routing"):

        def call(*args):
            *operands, coupling_bias, iters = args
            return fn(*operands, coupling_bias=coupling_bias)

    else:

        def call(*args):
            *operands, norm_weight, norm_bias, iters = args
            return fn(*operands, iters, norm_weight=norm_weight, norm_bias=norm_bias)

    return call


def per_window_conv_em(conv: ConvShape) -> Callable:
    """nn.ConvCapsules(routing="window") (unfold, then em_routing_pose per window; fused backend) run
    with conv_em_routing's inputs as its parameters: fn(pose, a_in, weight, beta_u, beta_a, iters).
    Its weight rows are (ky, kx, c), as the op's (K, K, C_in, C_out, 4, 4) weight flattens."""
    with torch.device("meta"):  # its parameters are replaced at every call
        layer = ConvCapsules(conv.C_in, conv.C_out, conv.K, conv.stride, routing="window")

    def fn(pose, a_in, weight, beta_u, beta_a, iters):
        layer.iters = iters
        params = {"weight": weight.flatten(0, 2), "beta_u": beta_u, "beta_a": beta_a}
        return torch.func.functional_call(layer, params, (pose, a_in))

    return fn


def unavailable_impls(case: Case, device: torch.device) -> dict[str, str]:
    """{impl: why it cannot run this case here}: no capsroute kernel for the op (or for the
    per-window layer's em_routing_pose) on the device; per-window with padding."""
    why = {}
    if not capsroute_supports(case.op, device):
        why["capsroute"] = no_kernel(device, [case.op])
    if case.op in OP_IMPLS["per-window"]:
        if not capsroute_supports("em_routing_pose", device):
            why["per-window"] = no_kernel(device, ["em_routing_pose"])
        elif case.conv.padding:
            why["per-window"] = "nn.ConvCapsules has no padding"
    return why


def no_kernel(device: torch.device, ops) -> str:
    return f"capsroute has no {device.type.upper()} kernel for {'/'.join(ops)} in this build"


def capsroute_supports(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", key))
    except Exception:
        return True  # can't tell: try it
