"""The floor: bytes that must move / measured copy bandwidth, flops / measured matmul peak
(bench/README.md, "The floor")."""

from __future__ import annotations

import torch

from .cases import DTYPES, EM_OPS, Case, ConvShape
from .timing import time_samples


def measure_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> float:
    """Copy bandwidth in GB/s (1e9 bytes/s): (bytes read + bytes written) / time, best of `repeats`."""
    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    times = time_samples(lambda: dst.copy_(src), device, repeats=repeats, max_seconds=5.0)
    return 2 * nbytes / (min(times) / 1e3) / 1e9


def measure_peak_tflops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 10
) -> float:
    """Matmul throughput in TFLOP/s in `dtype`: 2 n^3 / time, best of `repeats`."""
    if n is None:
        if device.type == "cuda":
            n = 8192
        else:
            n = 2048 if dtype in (torch.float32, torch.float64) else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        torch.mm(a, b)
    times = time_samples(
        lambda: torch.mm(a, b),
        device,
        repeats=repeats,
        max_seconds=5.0 if device.type == "cuda" else 3.0,
    )
    return 2 * n**3 / (min(times) / 1e3) / 1e12


def _route_flops(I: int, J: int, D: int, iters: int) -> int:
    """Dynamic routing's flops per element: iters weighted sums and iters - 1 agreements."""
    return 2 * I * J * D * (2 * iters - 1)


def _self_attention_flops(I: int, J: int, D: int) -> int:
    """Self-attention routing's flops per element: the sum of the votes for each output (I J D
    adds), the agreements with it and the weighted sum (2 I J D each)."""
    return 5 * I * J * D


def _em_flops(I: int, J: int, H: int, iters: int) -> int:
    """EM routing's flops per element: per iteration the mean (2 I J H) and variance (3 I J H) of
    the M-step, and but for the last, the E-step's log densities (4 I J H)."""
    return I * J * H * (5 * iters + 4 * (iters - 1))


def conv_elements(case: Case) -> tuple[int, int]:
    """(input elements, output elements) of a conv op's call: conv EM reads pose (16 values) and
    a_in per input capsule, the weight and the two betas, and writes pose and a_out; conv dynamic
    reads u and the weight and writes v."""
    c = case.conv
    capsules, parents = (
        case.B * c.H * c.W * c.C_in,
        case.B * c.out_hw()[0] * c.out_hw()[1] * c.C_out,
    )
    if case.op == "conv_em_routing":
        return capsules * 17 + c.K * c.K * c.C_in * c.C_out * 16 + 2 * c.C_out, parents * 17
    return capsules * c.Din + c.K * c.K * c.C_in * c.C_out * c.D * c.Din, parents * c.D


def floor_model(case: Case, itemsize: int, iters: int) -> dict:
    """Bytes that must move and flops that must be done by one call (bench/README.md, "The floor")."""
    B, I, J, D, Din = case.B, case.I, case.J, case.D, case.Din
    route = _route_flops(I, J, D, iters)
    out = B * J * D * itemsize
    if case.conv is not None:
        # one window (K K C_in children, C_out parents) per output position; the votes are
        # GEMMs: conv EM a 4x4 @ 4x4 product per (child, parent), conv dynamic a (D, Din) @ Din
        # per (window offset, child type, parent type)
        c = case.conv
        positions = B * c.out_hw()[0] * c.out_hw()[1]
        children = c.K * c.K * c.C_in
        if case.op == "conv_em_routing":
            flops_fwd = positions * (
                128 * children * c.C_out + _em_flops(children, c.C_out, 16, iters)
            )
        else:
            votes = 2 * children * c.C_out * c.D * c.Din
            flops_fwd = positions * (votes + _route_flops(c.C_in, c.C_out, c.D, iters))
        inp, out = (n * itemsize for n in conv_elements(case))
    elif case.op in EM_OPS:
        # pose @ weight adds 2 * 64 flops per (i, j) to em_routing's
        em = _em_flops(I, J, D, iters)
        if case.op == "em_routing":
            inp, flops_fwd = (B * I * J * D + B * I) * itemsize, B * em
        else:
            inp, flops_fwd = (B * I * 16 + I * J * 16 + B * I) * itemsize, B * (128 * I * J + em)
        out = B * J * (D + 1) * itemsize
    elif case.op == "dynamic_routing":
        inp = B * I * J * D * itemsize
        flops_fwd = B * route
    elif case.op == "self_attention_routing":  # votes and the coupling bias (I, J)
        inp = (B * I * J * D + I * J) * itemsize
        flops_fwd = B * _self_attention_flops(I, J, D)
    elif case.op == "inverted_attention_routing":  # votes, norm_weight and norm_bias (D,)
        inp = (B * I * J * D + 2 * D) * itemsize
        flops_fwd = B * route
    else:  # the dense ops: the vote transform, then their routing and its parameters
        dense_self_attention = case.op == "dense_self_attention_routing"
        rule = _self_attention_flops(I, J, D) if dense_self_attention else route
        params = {"dense_self_attention_routing": I * J, "dense_inverted_attention_routing": 2 * D}
        inp = (B * I * Din + I * J * D * Din + params.get(case.op, 0)) * itemsize
        flops_fwd = B * (2 * I * J * D * Din + rule)
    return {
        "bytes_fwd": inp + out,
        "flops_fwd": flops_fwd,
        # the backward reads the output gradients and the inputs again (the forward and the
        # backward are separate calls), and writes the input gradients
        "bytes_fwd_bwd": (inp + out) + (out + inp) + inp,
        "flops_fwd_bwd": 3 * flops_fwd,
    }


def case_of_row(row: dict) -> Case:
    """The case a benchmark record's row was measured on, from its op, shape and layout."""
    shape = dict(row["shape"])
    B = shape.pop("B")
    layout = row.get("layout", "contiguous")
    if "K" in shape:
        return Case(row["op"], row["shape_name"], B, layout=layout, conv=ConvShape(**shape))
    if "H" in shape:
        shape["D"] = shape.pop("H")
    return Case(row["op"], row["shape_name"], B, layout=layout, **shape)


def row_floor_ms(row: dict, record: dict) -> float | None:
    """A routing row's forward+backward floor by today's model, from its case and the bandwidth
    and peak its record measured: rows recorded before the model counted the inputs' second read
    are compared with the same floor as new ones. None where the row or record has no floor."""
    bandwidth, peak = record.get("bandwidth_gbs"), record.get("peak_tflops")
    if row.get("floor_ms") is None or not bandwidth or not peak or "shape_name" not in row:
        return None
    iters = row["iters"] or 1  # None for the one-step ops, whose floor takes no iteration count
    fm = floor_model(case_of_row(row), DTYPES[row["dtype"]].itemsize, iters)
    return floor_ms(fm["bytes_fwd_bwd"], fm["flops_fwd_bwd"], bandwidth, peak)


def floor_ms(nbytes: float, flops: float, bandwidth_gbs: float, peak_tflops: float) -> float:
    return max(nbytes / (bandwidth_gbs * 1e9), flops / (peak_tflops * 1e12)) * 1e3
