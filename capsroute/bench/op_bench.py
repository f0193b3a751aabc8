"""The routing ops' bench: every implementation of one (op, shape, batch) case on the same random
inputs, with the case's floor."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Callable

import torch

from .._utils.runinfo import dtype_name
from .cases import (
    ATTENTION_OPS,
    ONE_STEP_OPS,
    UNCHECKED_IMPLS,
    Case,
    get_impl,
    impls_for,
    make_inputs,
    unavailable_impls,
)
from .floor import conv_elements, floor_model, floor_ms
from .measure import (
    MAX_BATCH_CAP,
    bench_impls,
    find_max_batch,
    first_call,
    max_rel_err,
    reset_dynamo,
    sample,
    time_inference,
    time_steps,
    warm_up,
)
from .timing import (
    MiB,
    clear_grads,
    free_memory,
    fwd_bwd_step,
    fwd_step,
    peak_memory_mb,
    synchronize,
    tensor_bytes,
)


def estimated_bytes(case: Case, impl: str, itemsize: int) -> int:
    """Rough upper estimate of what one fwd+bwd needs (inputs, grads, working set): used on CPU only,
    to skip a case rather than meet the OOM killer (CUDA raises OutOfMemoryError, which is caught)."""
    if case.conv is not None:
        return conv_estimated_bytes(case, impl, itemsize)
    votes = case.B * case.I * case.J * case.D * itemsize
    routes_votes = case.op in ("dynamic_routing", *ATTENTION_OPS)  # the votes are the input
    if routes_votes or case.op == "em_routing":
        inputs = votes
    else:
        inputs = (case.B * case.I * case.Din + case.I * case.J * case.D * case.Din) * itemsize
    if (
        impl == "capsroute"
    ):  # dense never materialises votes; its backward keeps a few weight-sized buffers
        work = votes // 2 if routes_votes else 6 * case.I * case.J * case.D * case.Din * itemsize
    else:
        work = 8 * votes
    return 2 * inputs + work


def conv_estimated_bytes(case: Case, impl: str, itemsize: int) -> int:
    """estimated_bytes of a conv op, from the peaks measured on the CPU at small grids (float32, 3
    iterations): conv EM eager 14.3x the bytes of every window's votes (B H' W' K K C_in C_out 16),
    capsroute and per-window 0.4-0.55x; conv dynamic 5-10 MiB per MiB of the position votes
    (B H' W' C_in C_out D) and unfolded windows (B H' W' K K C_in Din) together, either impl."""
    c = case.conv
    positions = case.B * c.out_hw()[0] * c.out_hw()[1]
    inputs = conv_elements(case)[0] * itemsize
    if case.op == "conv_em_routing":
        votes = positions * c.K * c.K * c.C_in * c.C_out * 16 * itemsize
        work = 20 * votes if impl in ("eager", "compiled") else votes
    else:
        votes = positions * c.C_in * c.C_out * c.D * itemsize
        windows = positions * c.K * c.K * c.C_in * c.Din * itemsize
        work = 8 * votes + 3 * windows
    return 2 * inputs + work


def bench_impl(
    case: Case,
    impl: str,
    inputs,
    grad,
    *,
    iters: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    max_seconds: float,
    inference: bool,
    ref_snap: dict | None,
) -> tuple[dict, dict]:
    """Measures one implementation on one case; returns (partial record, snapshot for checks).

    The first forward+backward (which compiles, for 'compiled') gives the output and input gradients
    that are the snapshot compared with eager's."""
    if impl == "compiled":
        reset_dynamo()
    fn = get_impl(case, impl)
    fwd = fwd_step(fn, inputs, iters)
    fwd_bwd = fwd_bwd_step(fn, inputs, grad, iters)
    before = lambda: clear_grads(inputs)  # noqa: E731

    v, rec = first_call(fwd_bwd, before, impl, device)
    snap = {"v": sample(v)}
    snap.update({f"grad{k}": sample(t.grad) for k, t in enumerate(inputs) if t.grad is not None})
    del v
    if ref_snap is not None and impl != "eager" and impl not in UNCHECKED_IMPLS:
        rec["max_rel_err"] = max_rel_err(snap, ref_snap)
    warm_up(fwd_bwd, fwd, before, fwd_bwd_calls=max(0, warmup - 1), fwd_calls=max(1, warmup))
    clear_grads(inputs)

    time_steps(rec, fwd, fwd_bwd, before, device, repeats, max_seconds)
    clear_grads(inputs)
    if inference:
        time_inference(rec, fwd, impl, device, warmup, repeats, max_seconds)
    return rec, snap


def bench_case(
    case: Case,
    impls,
    *,
    dtype: torch.dtype,
    iters: int,
    device: torch.device,
    repeats: int,
    warmup: int,
    max_seconds: float,
    inference: bool,
    bandwidth_gbs: float,
    peak_tflops: float,
    seed: int = 0,
    note: Callable[[str], None] = print,
    progress=None,
) -> list[dict]:
    """All implementations on one case: a list of records (skipped ones carry 'skipped': reason)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fm = floor_model(case, itemsize, iters)
    f_fwd = floor_ms(fm["bytes_fwd"], fm["flops_fwd"], bandwidth_gbs, peak_tflops)
    f_all = floor_ms(fm["bytes_fwd_bwd"], fm["flops_fwd_bwd"], bandwidth_gbs, peak_tflops)
    bound = (
        "memory"
        if fm["bytes_fwd_bwd"] / (bandwidth_gbs * 1e9) >= fm["flops_fwd_bwd"] / (peak_tflops * 1e12)
        else "compute"
    )

    def base(impl):
        return {
            "op": case.op,
            "shape": case.shape(),
            "layout": case.layout,
            "dtype": dtype_name(dtype),
            "impl": impl,
            "fwd_ms": None,
            "fwd_bwd_ms": None,
            "peak_mb": None,
            "floor_ms": f_all,
            "shape_name": case.shape_name,
            "iters": None if case.op in ONE_STEP_OPS else iters,
            "floor_fwd_ms": f_fwd,
            "floor_bound": bound,
            **fm,
        }

    def measure(impl, inputs, ref_snap):
        try:
            return bench_impl(
                case,
                impl,
                *inputs,
                iters=iters,
                device=device,
                repeats=repeats,
                warmup=warmup,
                max_seconds=max_seconds,
                inference=inference,
                ref_snap=ref_snap,
            )
        finally:
            clear_grads(inputs[0])

    records = bench_impls(
        case,
        impls_for(case.op, impls),
        device,
        base=base,
        estimate=lambda impl: estimated_bytes(case, impl, itemsize),
        make_inputs=lambda: make_inputs(case.op, case, dtype, device, seed),
        unavailable=unavailable_impls(case, device),
        measure=measure,
        note=note,
        progress=progress,
    )
    for r in records:
        if "skipped" not in r:
            r["floor_x"] = r["fwd_bwd_ms"] / f_all if f_all > 0 else None
            r["floor_fwd_x"] = r["fwd_ms"] / f_fwd if f_fwd > 0 else None
    return records


MAX_BATCH_BUDGET_GB = 8.0  # --max-batch-budget: the CPU's memory budget of a conv op's fwd+bwd
MAX_SIDE_CAP = 4096  # the largest square input side --max-batch reports for a conv op
SIDE_PROBE = 12  # the CPU's side search measures B = 1 at sides max(SIDE_PROBE, K) and twice it


def at_side(case: Case, side: int) -> Case:
    """A conv case at batch 1 on a side x side input grid."""
    return replace(case, B=1, conv=replace(case.conv, H=side, W=side))


def op_max_batch(
    case: Case,
    impl: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    iters: int = 3,
    seed: int = 0,
    cap: int = MAX_BATCH_CAP,
    budget_gb: float = MAX_BATCH_BUDGET_GB,
) -> dict:
    """The largest power-of-two batch <= cap whose forward+backward of one impl of a conv op fits
    ("max_batch"), and the largest square input side at B = 1 ("max_side", <= MAX_SIDE_CAP): on
    CUDA, tried (find_max_batch) in GPU memory, sides 16 x 2^k; on the CPU, within budget_gb,
    extrapolated (cpu_max_batch, cpu_max_side) rather than tried, so that nothing near the budget
    is allocated on a shared machine."""
    t0 = time.perf_counter()
    found = {
        "op": case.op,
        "shape_name": case.shape_name,
        "shape": {k: v for k, v in case.shape().items() if k != "B"},
        "impl": impl,
        "dtype": dtype_name(dtype),
        "cap": cap,
    }
    if device.type == "cuda":
        fn = get_impl(case, impl)  # compiled: recompiles with a dynamic batch, as model_max_batch

        def step(c: Case):
            inputs, grad = make_inputs(case.op, c, dtype, device, seed)
            fwd_bwd_step(fn, inputs, grad, iters)()
            synchronize(device)

        free = lambda: free_memory(device)  # noqa: E731
        best, tries = find_max_batch(lambda b: step(replace(case, B=b)), cap, free=free)
        found.update(
            max_batch=best, capped=bool(tries and tries[-1][1]), tries=[b for b, _ in tries]
        )
        best, tries = find_max_batch(
            lambda m: step(at_side(case, 16 * m)), MAX_SIDE_CAP // 16, free=free
        )
        found["max_side"] = None if best is None else 16 * best
        found["side_search"] = {
            "capped": bool(tries and tries[-1][1]),
            "tries": [16 * m for m, _ in tries],
        }
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        budget_mb = budget_gb * 1024

        def estimate_mb(c: Case) -> float:
            return estimated_bytes(c, impl, itemsize) / MiB

        def measure_mb(c: Case) -> float:
            return measured_mb(c, impl, c.B, dtype=dtype, iters=iters, seed=seed)

        found.update(
            cpu_max_batch(
                lambda b: estimate_mb(replace(case, B=b)),
                lambda b: measure_mb(replace(case, B=b)),
                cap=cap,
                budget_mb=budget_mb,
            )
        )
        probe = max(SIDE_PROBE, case.conv.K)
        side = cpu_max_side(
            lambda s: estimate_mb(at_side(case, s)),
            lambda s: measure_mb(at_side(case, s)),
            probes=[probe, 2 * probe],
            cap=MAX_SIDE_CAP,
            budget_mb=budget_mb,
        )
        found["max_side"] = side.pop("max_side")
        found["side_search"] = side
    found["search_s"] = round(time.perf_counter() - t0, 1)
    return found


def measured_mb(case: Case, impl: str, B: int, *, dtype, iters: int, seed: int) -> float:
    """MiB that one forward+backward of an impl at batch B holds at its peak on the CPU: its inputs
    and output gradients, and the peak of the call above them (peak_memory_mb, after a first call).
    compiled: a static compile of its own, as the timed cases have (inductor's dynamic-batch
    recompile of the reference conv dynamic failed an assertion on torch 2.14.1)."""
    if impl == "compiled":
        reset_dynamo()
    fn = get_impl(case, impl)
    inputs, grad = make_inputs(case.op, replace(case, B=B), dtype, torch.device("cpu"), seed)
    step = fwd_bwd_step(fn, inputs, grad, iters)
    before = lambda: clear_grads(inputs)  # noqa: E731
    before()
    step()  # a first call: torch.compile compiles here, outside the measured peak
    held = tensor_bytes((*inputs, *(grad if isinstance(grad, tuple) else (grad,))))
    return held / MiB + peak_memory_mb(step, torch.device("cpu"), before)


def _line_through(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, slope) of the straight line through two (x, MiB) points, or through 0 and one."""
    if len(points) == 2:
        (x1, m1), (x2, m2) = points
        slope = (m2 - m1) / (x2 - x1)
        return m1 - slope * x1, slope
    ((x1, m1),) = points
    return 0.0, m1 / x1


def cpu_max_batch(
    estimate_mb: Callable[[int], float],
    measure_mb: Callable[[int], float],
    *,
    cap: int,
    budget_mb: float,
) -> dict:
    """The CPU's max batch of a conv op, whose memory is linear in B (every tensor but the weight
    and its gradient has a batch dimension): measure_mb(B) at B = 1 and 2, a straight line through
    the two, and the largest power of two b <= cap on which the line is within budget_mb. A probe
    runs only where estimate_mb (an upper estimate) is within the budget; with B = 1 alone the line
    goes through 0 (an upper bound at b >= 1); with neither, the estimate at B = 1 decides: then
    max_batch is None ("method": "estimate")."""
    probes = [(b, measure_mb(b)) for b in (1, 2) if estimate_mb(b) <= budget_mb]
    found = {"budget_mb": budget_mb, "probes": probes}
    if not probes:
        return {
            **found,
            "max_batch": None,
            "capped": False,
            "method": "estimate",
            "estimated_mb": estimate_mb(1),
        }
    fixed, slope = _line_through(probes)
    best, b = None, 1
    while b <= cap and fixed + slope * b <= budget_mb:
        best, b = b, 2 * b
    # the loop ended past the cap: every batch up to it fitted
    return {
        **found,
        "max_batch": best,
        "capped": b > cap,
        "method": "extrapolated",
        "mb_per_batch": slope,
        "mb_fixed": fixed,
    }


def cpu_max_side(
    estimate_mb: Callable[[int], float],
    measure_mb: Callable[[int], float],
    *,
    probes: list[int],
    cap: int,
    budget_mb: float,
) -> dict:
    """The CPU's largest square input side of a conv op at B = 1, whose memory is close to linear
    in the grid's area (every tensor but the weight and its gradient is per position): measure_mb
    at the probe sides, a straight line in side^2 through them, and the largest side <= cap on
    which it is within budget_mb. Probes run only where estimate_mb is within the budget, as
    cpu_max_batch's; with none, max_side is None ("method": "estimate")."""
    measured = [(s, measure_mb(s)) for s in probes if estimate_mb(s) <= budget_mb]
    found = {"budget_mb": budget_mb, "probes": measured}
    if not measured:
        return {
            **found,
            "max_side": None,
            "method": "estimate",
            "estimated_mb": estimate_mb(probes[0]),
        }
    fixed, slope = _line_through([(s * s, m) for s, m in measured])
    area = (budget_mb - fixed) / slope if slope > 0 else float("inf")
    side = None if area < 1 else cap if area >= cap * cap else math.isqrt(int(area))
    return {
        **found,
        "max_side": side,
        "capped": side == cap,
        "method": "extrapolated",
        "mb_per_position": slope,
        "mb_fixed": fixed,
    }
