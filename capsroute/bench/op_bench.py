"""The routing ops' bench: every implementation of one (op, shape, batch) case on the same random
inputs, with the case's floor."""

from __future__ import annotations

from typing import Callable

import torch

from .._runinfo import dtype_name
from .cases import Case, capsroute_supports, get_impl, make_inputs
from .floor import floor_model, floor_ms
from .measure import (
    bench_impls,
    first_call,
    max_rel_err,
    no_kernel,
    reset_dynamo,
    sample,
    time_inference,
    time_steps,
    warm_up,
)
from .timing import clear_grads, fwd_bwd_step, fwd_step


def estimated_bytes(case: Case, impl: str, itemsize: int) -> int:
    """Rough upper estimate of what one fwd+bwd needs (inputs, grads, working set): used on CPU only,
    to skip a case rather than meet the OOM killer (CUDA raises OutOfMemoryError, which is caught)."""
    votes = case.B * case.I * case.J * case.D * itemsize
    if case.op in ("dynamic_routing", "em_routing"):
        inputs = votes
    else:
        inputs = (case.B * case.I * case.Din + case.I * case.J * case.D * case.Din) * itemsize
    if (
        impl == "capsroute"
    ):  # dense never materialises votes; its backward keeps a few weight-sized buffers
        work = (
            votes // 2
            if case.op == "dynamic_routing"
            else 6 * case.I * case.J * case.D * case.Din * itemsize
        )
    else:
        work = 8 * votes
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
    fn = get_impl(case.op, impl)
    fwd = fwd_step(fn, inputs, iters)
    fwd_bwd = fwd_bwd_step(fn, inputs, grad, iters)
    before = lambda: clear_grads(inputs)  # noqa: E731

    v, rec = first_call(fwd_bwd, before, impl, device)
    snap = {"v": sample(v)}
    snap.update({f"grad{k}": sample(t.grad) for k, t in enumerate(inputs) if t.grad is not None})
    del v
    if ref_snap is not None and impl != "eager":
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
            "iters": iters,
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

    unavailable = (
        {} if capsroute_supports(case.op, device) else {"capsroute": no_kernel(device, [case.op])}
    )
    records = bench_impls(
        case,
        impls,
        device,
        base=base,
        estimate=lambda impl: estimated_bytes(case, impl, itemsize),
        make_inputs=lambda: make_inputs(case.op, case, dtype, device, seed),
        unavailable=unavailable,
        measure=measure,
        note=note,
        progress=progress,
    )
    for r in records:
        if "skipped" not in r:
            r["floor_x"] = r["fwd_bwd_ms"] / f_all if f_all > 0 else None
            r["floor_fwd_x"] = r["fwd_ms"] / f_fwd if f_fwd > 0 else None
    return records
