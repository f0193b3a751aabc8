"""What `capsroute bench` runs: the ops and their shapes, the cases (op x shape x batch), and each
case's random inputs and implementations."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Callable

import torch

import capsroute
from capsroute import reference

OPS = {  # op -> the short name that `--op` also accepts
    "dynamic_routing": "dynamic",
    "dense_capsules": "dense",
    "em_routing": "em",
    "em_routing_pose": "em-pose",
}
EM_OPS = ("em_routing", "em_routing_pose")
MODEL_OPS = {  # a whole training step of a model of capsroute.models; the short name is the same
    "capsnet": "capsnet",
    "matrixcapsnet": "matrixcapsnet",
}
ALL_OPS = {**OPS, **MODEL_OPS}
IMPLS = ("capsroute", "eager", "compiled")
# The layouts of the first input (votes, u) the ops with a layout dimension are timed in; every
# implementation of a case gets the same tensors. The other ops run on contiguous inputs.
LAYOUTS = ("contiguous", "einsum")
LAYOUT_OPS = ("dynamic_routing", "dense_capsules")
SHAPES = {  # the canonical shapes (bench/README.md); for EM ops D is the pose size H (16: 4x4 matrices)
    "mnist": dict(I=1152, J=10, D=16, Din=8),  # MNIST DigitCaps
    "large": dict(I=4608, J=100, D=16, Din=8),
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
    "cpu": {"mnist": [32], "large": [8], "em-class": [16], "em-conv": [2 * 36], None: [32]},
    "cuda": {
        "mnist": [32, 128, 512, 2048],
        "large": [32, 128, 512, 2048],
        "em-class": [64, 256],
        "em-conv": [64 * 36],
        None: [32, 128, 512, 2048],
    },
}
MODEL_BATCHES = {"cpu": [16], "cuda": [32, 128, 512]}
MODEL_SHAPE_NAME = "1x28x28"  # model ops train on MNIST-sized images
DEFAULT_SHAPES = {"cpu": ["mnist"], "cuda": ["mnist", "large"], "em": ["em-class", "em-conv"]}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
VOTE_STD = 0.1  # dynamic_routing votes ~ N(0, 0.1^2): |s| ~ 1, so squash and the agreement matter
WEIGHT_STD = 0.05  # dense_capsules weight ~ N(0, 0.05^2); u = squash(N(0, 1)) like primary capsules


@dataclass(frozen=True)
class Case:
    op: str
    shape_name: str  # "mnist", "large" or "I,J,D,Din"
    B: int
    I: int
    J: int
    D: int
    Din: int
    layout: str = "contiguous"  # LAYOUTS

    def shape(self) -> dict:
        if self.op in MODEL_OPS:
            return {"B": self.B, "model": self.op}
        if self.op in EM_OPS:
            return {"B": self.B, "I": self.I, "J": self.J, "H": self.D}
        s = {"B": self.B, "I": self.I, "J": self.J, "D": self.D}
        if self.op == "dense_capsules":
            s["Din"] = self.Din
        return s

    def label(self) -> str:
        return f"{self.op} {self.shape_name} B={self.B}" + (
            f" {self.layout}" if self.layout != "contiguous" else ""
        )


def parse_shape(spec: str) -> tuple[str, dict]:
    """'mnist' | 'large' | 'I,J,D,Din' (Din may be left out: 8) -> (name, dict(I, J, D, Din))."""
    if spec in SHAPES:
        return spec, dict(SHAPES[spec])
    parts = (
        [int(p) for p in re.split(r"[,x]", spec)]
        if re.fullmatch(r"\d+([,x]\d+){2,3}", spec)
        else []
    )
    if not parts or min(parts) < 1:
        raise argparse.ArgumentTypeError(
            f"shape must be one of {', '.join(SHAPES)} or I,J,D[,Din]; got {spec!r}"
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
    """shapes: parse_shape results, or None for each op's default shapes. Model ops (MODEL_OPS) have
    no shape (MNIST-sized images): shapes do not apply to them, batches (else MODEL_BATCHES) do.
    layouts (LAYOUTS): a case per layout for the ops of LAYOUT_OPS, contiguous only for the rest."""
    cases = []
    for op in ops:
        if op in MODEL_OPS:
            for B in batches or MODEL_BATCHES[device_type]:
                cases.append(Case(op, MODEL_SHAPE_NAME, B, 0, 0, 0, 0))
            continue
        if shapes is None:
            names = DEFAULT_SHAPES["em" if op in EM_OPS else device_type]
            op_shapes = [parse_shape(name) for name in names]
        else:
            op_shapes = shapes
        for name, dims in op_shapes:
            if op == "em_routing_pose" and dims["D"] != 16:
                raise argparse.ArgumentTypeError(
                    f"em_routing_pose needs 4x4 poses (H = 16), got shape {name}"
                )
            bs = batches or DEFAULT_BATCHES[device_type].get(name if name in SHAPES else None)
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


def make_inputs(op: str, case: Case, dtype: torch.dtype, device, seed: int = 0):
    """Fresh random inputs (never zeros), the first in the case's layout: (tuple of leaf tensors
    requiring grad, grad_v)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0, cast=True):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).mul_(std)
        return x.to(dtype) if cast else x

    if op == "dynamic_routing":
        inputs = (randn(case.B, case.I, case.J, case.D, std=VOTE_STD),)
    elif op == "dense_capsules":
        u = reference.squash(randn(case.B, case.I, case.Din, cast=False)).to(dtype)
        inputs = (u, randn(case.I, case.J, case.D, case.Din, std=WEIGHT_STD))
    elif op in EM_OPS:
        activations = (
            torch.rand(case.B, case.I, generator=gen, device=device).to(dtype),
            randn(case.J, std=0.5),
            randn(case.J, std=0.5),
        )  # a_in, beta_u, beta_a
        if op == "em_routing":
            inputs = (randn(case.B, case.I, case.J, case.D),) + activations
        else:
            inputs = (
                randn(case.B, case.I, 4, 4),
                randn(case.I, case.J, 4, 4, std=0.5),
            ) + activations
    else:
        raise ValueError(f"unknown op {op!r}")
    inputs = (lay_out(inputs[0], case.layout), *inputs[1:])
    for t in inputs:
        t.requires_grad_(True)
    if op in EM_OPS:  # gradients of (pose, a_out)
        return inputs, (randn(case.B, case.J, case.D), randn(case.B, case.J))
    return inputs, randn(case.B, case.J, case.D)


def get_impl(op: str, impl: str) -> Callable:
    """The function to time, called as fn(*inputs, iters). 'compiled' gives a fresh torch.compile wrapper."""
    if impl == "capsroute":
        return getattr(capsroute, op)
    if impl == "eager":
        return getattr(reference, op)
    if impl == "compiled":
        return torch.compile(getattr(reference, op))
    raise ValueError(f"unknown impl {impl!r}")


def capsroute_supports(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", key))
    except Exception:
        return True  # can't tell: try it
