"""What the op benches and the model benches share: each implementation of a case measured in turn
(eager first, so the others are checked against its values), the first call (the compile, for
torch.compile), warm-up, the timed steps, the checks against eager, and the ratios to capsroute."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable

import torch

import capsroute

from ..ops import OPS
from .cases import IMPLS, Case
from .timing import (
    available_bytes,
    free_memory,
    gpu_busy_ms,
    is_oom,
    peak_memory_mb,
    synchronize,
    time_samples,
)

SAMPLE = 1 << 20  # elements of a tensor kept to check impls against eager
MAX_BATCH_CAP = 2**15  # --max-batch without a value


def sample(t: torch.Tensor, max_elems: int = SAMPLE) -> torch.Tensor:
    """At most about max_elems evenly strided elements of t, as a float64 copy."""
    flat = t.detach().flatten()
    return flat[:: max(1, flat.numel() // max_elems)].to(torch.float64, copy=True)


def max_rel_err(snap: dict, ref: dict) -> float | None:
    """The largest max |snap - ref| / max |ref| over the samples both have."""
    errs = []
    for k, r in ref.items():
        if k in snap and snap[k].shape == r.shape:
            errs.append(((snap[k] - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return max(errs) if errs else None


def dynamo_stats() -> dict:
    """What torch.compile did for the case: graphs, graph breaks, and whether inductor's on-disk cache
    served it (a warm cache makes compile_s much smaller than a cold compile)."""
    try:
        from torch._dynamo.utils import counters

        hits = counters["inductor"].get("fxgraph_cache_hit", 0) + counters["aot_autograd"].get(
            "autograd_cache_hit", 0
        )
        return {
            "graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "compile_cache": "hit" if hits else "miss",
        }
    except Exception:  # noqa: BLE001  (private API: optional)
        return {}


def eager_first(impls) -> list[str]:
    """The impls in measuring order: eager first, its values being the reference the others are checked against."""
    return sorted(impls, key=lambda impl: impl != "eager")


def reset_dynamo() -> None:
    """A fresh torch.compile state, so compile time and graph counts are this impl's own."""
    torch._dynamo.reset()
    try:
        from torch._dynamo.utils import counters

        counters.clear()
    except Exception:  # noqa: BLE001  (private API: optional)
        pass


def timed_call(step: Callable, device: torch.device) -> tuple[object, float]:
    """(step(), its wall time in seconds, the device synchronized)."""
    t0 = time.perf_counter()
    out = step()
    synchronize(device)
    return out, time.perf_counter() - t0


def first_call(
    step: Callable, before: Callable, impl: str, device: torch.device
) -> tuple[object, dict]:
    """The first call of step() after before(). For 'compiled' it is the call that compiles: its wall
    time is the record's compile_s (left out of the timings), beside what torch.compile did."""
    before()
    out, seconds = timed_call(step, device)
    return out, ({"compile_s": round(seconds, 3), **dynamo_stats()} if impl == "compiled" else {})


def warm_up(
    fwd_bwd: Callable, fwd: Callable, before: Callable, *, fwd_bwd_calls: int, fwd_calls: int
) -> None:
    for _ in range(fwd_bwd_calls):
        before()
        fwd_bwd()
    for _ in range(fwd_calls):
        fwd()


def kernel_paths_ran() -> dict:
    """{op: {"forward": path, "backward": path}} for every capsroute op that ran since
    capsroute.clear_kernel_paths(): the kernel paths a row actually ran (capsroute.last_kernel_path),
    fallbacks included, not only the switches it was run with."""
    paths = {}
    for op in OPS:
        ran = {
            direction: capsroute.last_kernel_path(op, direction)
            for direction in ("forward", "backward")
        }
        if any(ran.values()):
            paths[op] = ran
    return paths


def minor_faults() -> int:
    """The minor page faults this process has taken (every thread's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_steps(
    rec: dict,
    fwd: Callable,
    fwd_bwd: Callable,
    before: Callable,
    device: torch.device,
    repeats: int,
    max_seconds: float,
) -> None:
    """Median and min times of fwd() and of fwd_bwd(), the peak memory of fwd_bwd(), on CUDA the
    GPU's busy time in fwd_bwd() and the rest of its time (the host's), and the kernel paths the
    timed calls of capsroute's ops ran (kernel_paths, where any ran), into rec."""
    capsroute.clear_kernel_paths()
    ft = time_samples(fwd, device, repeats=repeats, max_seconds=max_seconds)
    rec["fwd_ms"] = statistics.median(ft)
    rec["fwd_ms_min"] = min(ft)
    faults = minor_faults()
    bt = time_samples(fwd_bwd, device, repeats=repeats, before=before, max_seconds=max_seconds)
    if device.type == "cpu":  # memory the allocator returned to the kernel and faults in again
        rec["faults_per_call"] = (minor_faults() - faults) / len(bt)
    rec["fwd_bwd_ms"] = statistics.median(bt)
    rec["fwd_bwd_ms_min"] = min(bt)
    rec["repeats"] = [len(ft), len(bt)]
    rec["peak_mb"] = peak_memory_mb(fwd_bwd, device, before)
    if device.type == "cuda":
        rec["gpu_busy_ms"] = gpu_busy_ms(fwd_bwd, device, before)
        rec["host_overhead_ms"] = rec["fwd_bwd_ms"] - rec["gpu_busy_ms"]
    paths = kernel_paths_ran()
    if paths:
        rec["kernel_paths"] = paths


def time_inference(
    rec: dict,
    fwd: Callable,
    impl: str,
    device: torch.device,
    warmup: int,
    repeats: int,
    max_seconds: float,
) -> None:
    """fwd() under no_grad (compiled: a second graph, its compile time recorded): fwd_infer_ms."""
    with torch.no_grad():
        seconds = timed_call(fwd, device)[1]
        if impl == "compiled":
            rec["compile_infer_s"] = round(seconds, 3)
        for _ in range(max(1, warmup)):
            fwd()
        it = time_samples(fwd, device, repeats=repeats, max_seconds=max_seconds)
    rec["fwd_infer_ms"] = statistics.median(it)


def bench_impls(
    case: Case,
    impls,
    device: torch.device,
    *,
    base: Callable[[str], dict],
    estimate: Callable[[str], int],
    make_inputs: Callable[[], object],
    unavailable: dict[str, str],
    measure: Callable,
    note: Callable[[str], None],
    progress,
) -> list[dict]:
    """The loop of bench_case and bench_model_case: each impl on one case, eager first, so that
    measure(impl, inputs, ref_snap) -> (record, snapshot) can check the others against eager's
    snapshot. An impl is skipped, with the reason in its record, where `unavailable` gives one
    (e.g. no capsroute kernel on this device), where on the CPU `estimate(impl)` bytes exceed 80%
    of the available memory (the OOM killer would end the run; CUDA raises OutOfMemoryError
    instead), or where it fails. Returns {**base(impl), **record} per impl with the ratios to
    capsroute, in IMPLS order."""
    records = []

    def skip(impl, reason):
        note(f"skipped {case.label()} {impl}: {reason}")
        records.append({**base(impl), "skipped": reason})

    avail = available_bytes(device)
    too_big = {}
    if device.type == "cpu" and avail is not None:
        for impl in impls:
            need = estimate(impl)
            if need > 0.8 * avail:
                too_big[impl] = (
                    f"estimated {need / 2**30:.1f} GiB > 80% of the {avail / 2**30:.1f} GiB available"
                )
        if len(too_big) == len(impls):
            for impl in impls:
                skip(impl, too_big[impl])
            return records
    try:
        inputs = make_inputs()
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        del e
        free_memory(device)
        for impl in impls:
            skip(impl, "out of memory creating the inputs")
        return records

    ref_snap = None
    for impl in eager_first(impls):
        if progress is not None:
            progress.set_postfix_str(f"{case.label()} {impl}")
        if impl in unavailable:
            skip(impl, unavailable[impl])
            continue
        if impl in too_big:
            skip(impl, too_big[impl])
            continue
        failure = None
        try:
            rec, snap = measure(impl, inputs, ref_snap)
        except Exception as e:  # noqa: BLE001
            failure = failure_reason(e)
            del e
        free_memory(device)
        if failure is not None:
            skip(impl, failure)
            continue
        if impl == "eager":
            ref_snap = snap
        del snap
        records.append({**base(impl), **rec})
    del inputs, ref_snap
    free_memory(device)
    add_ratios(records)
    records.sort(key=lambda r: IMPLS.index(r["impl"]))
    return records


def failure_reason(e: BaseException) -> str:
    """The 'skipped' reason for an exception raised while measuring."""
    if is_oom(e):
        return "out of memory"
    return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def add_ratios(records: list[dict]):
    """vs_capsroute on each other impl's record, and the same numbers as 'ratios' on capsroute's."""
    caps = next((r for r in records if r["impl"] == "capsroute" and "skipped" not in r), None)
    if caps is not None:
        ratios = {}
        for r in records:
            if r["impl"] == "capsroute" or "skipped" in r:
                continue
            vs = {
                k: (r[k] / caps[k] if caps[k] else None)
                for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb")
            }
            r["vs_capsroute"] = {
                "fwd": vs["fwd_ms"],
                "fwd_bwd": vs["fwd_bwd_ms"],
                "peak_mb": vs["peak_mb"],
            }
            ratios.update(
                {
                    f"{r['impl']}_fwd": vs["fwd_ms"],
                    f"{r['impl']}_fwd_bwd": vs["fwd_bwd_ms"],
                    f"{r['impl']}_peak_mb": vs["peak_mb"],
                }
            )
        caps["ratios"] = ratios


def find_max_batch(
    step: Callable[[int], object],
    cap: int = MAX_BATCH_CAP,
    *,
    free: Callable[[], None] = lambda: None,
) -> tuple[int | None, list[tuple[int, bool]]]:
    """The largest power of two b <= cap for which step(b) runs without running out of memory.

    Tries b = 1, 2, 4, ... and stops at the first that raises an out-of-memory error (is_oom:
    torch.OutOfMemoryError, MemoryError); free() runs after every try, whether it fit or not. Other
    errors propagate. Returns (b, or None when even 1 does not fit; the tries as (b, fitted))."""
    best, tries = None, []
    b = 1
    while b <= cap:
        try:
            step(b)
            fitted = True
        except Exception as e:  # noqa: BLE001
            if not is_oom(e):
                raise
            fitted = False
            del e
        free()
        tries.append((b, fitted))
        if not fitted:
            break
        best = b
        b *= 2
    return best, tries
