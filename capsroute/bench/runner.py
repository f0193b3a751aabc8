"""A benchmark run: the floor probes, every case in turn with a progress bar, the checks against
eager, --max-batch, and the report (the JSON document) with the run's metadata."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Callable

import torch

import capsroute

from .._runinfo import cpu_id, cpu_model, device_name, dtype_name, git_commit
from .cases import IMPLS, MODEL_OPS, Case
from .floor import measure_bandwidth, measure_peak_tflops
from .measure import failure_reason
from .model_bench import MODEL_TOL_FACTOR, bench_model_case, model_max_batch, model_supported
from .op_bench import bench_case
from .timing import free_memory


def run_benchmarks(
    cases: list[Case],
    impls=IMPLS,
    *,
    device: torch.device,
    dtype=torch.float32,
    iters: int = 3,
    repeats: int = 10,
    warmup: int = 2,
    max_seconds: float = 10.0,
    inference: bool = False,
    seed: int = 0,
    progress: bool = True,
    on_case: Callable[[dict], None] | None = None,
    max_batch: int | None = None,
) -> dict:
    """Runs the cases and returns the report (the JSON document). on_case(report) is called after each case.
    max_batch (CUDA, model ops): after the cases, search each model op's and impl's largest power-of-two
    batch up to this cap (model_max_batch) into report["max_batch"] and each matching record's "max_batch"."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional for library use
        tqdm = None
    bar = (
        tqdm(total=len(cases), disable=not progress, file=sys.stderr, unit="case") if tqdm else None
    )
    note = bar.write if bar is not None else print

    load = _loadavg()  # before this process adds its own
    bandwidth = peak = None
    if any(case.op not in MODEL_OPS for case in cases):  # model ops have no floor
        if bar is not None:
            bar.set_postfix_str("measuring the floor")
        bandwidth = measure_bandwidth(device)
        peak = measure_peak_tflops(device, dtype)
    report = {
        "kind": "bench",
        "device": device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "results": [],
        "complete": False,
        "dtype": dtype_name(dtype),
        "iters": iters,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "capsroute": _build_info(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("CAPSROUTE_")},
        "bandwidth_gbs": bandwidth,
        "peak_tflops": peak,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "repeats": repeats,
        "warmup": warmup,
        "max_seconds": max_seconds,
        "seed": seed,
        "command": " ".join(sys.argv),
        "notes": [],
    }

    def record_note(msg):
        report["notes"].append(msg)
        note(msg)

    report["loadavg_start"] = load
    if device.type == "cpu" and load is not None and load > (os.cpu_count() or 1):
        record_note(
            f"load average {load:.1f} > {os.cpu_count()} cores at the start: other processes compete for "
            f"the CPU; timings are unreliable, and biased against eager/compiled (many short parallel "
            f"regions suffer most from oversubscription). Try --threads 1 or an idle machine."
        )
    model_ops = list(dict.fromkeys(case.op for case in cases if case.op in MODEL_OPS))
    if max_batch is not None:
        if device.type != "cuda":
            record_note(
                f"--max-batch is CUDA-only (it searches for the largest batch that fits in GPU memory); "
                f"not run on {device.type}"
            )
            max_batch = None
        elif not model_ops:
            record_note(
                "--max-batch applies to the model ops (capsnet, matrixcapsnet) only; none was asked for"
            )
            max_batch = None
    for n, case in enumerate(cases):
        if case.op in MODEL_OPS:
            # one seed per model op (not per case): every batch size trains the same initial weights
            recs = bench_model_case(
                case,
                impls,
                dtype=dtype,
                iters=iters,
                device=device,
                repeats=repeats,
                warmup=warmup,
                max_seconds=max_seconds,
                inference=inference,
                seed=seed,
                note=record_note,
                progress=bar,
            )
        else:
            recs = bench_case(
                case,
                impls,
                dtype=dtype,
                iters=iters,
                device=device,
                repeats=repeats,
                warmup=warmup,
                max_seconds=max_seconds,
                inference=inference,
                bandwidth_gbs=bandwidth,
                peak_tflops=peak,
                seed=seed + n,
                note=record_note,
                progress=bar,
            )
        for r in recs:
            err = r.get("max_rel_err")
            tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
            if (
                case.op in MODEL_OPS
            ):  # a whole network (three stacked EM layers) amplifies rounding differences
                tol *= MODEL_TOL_FACTOR
            if err is not None and err > tol:
                what = "loss / gradients differ" if case.op in MODEL_OPS else "differs"
                record_note(
                    f"WARNING {case.label()} {r['impl']}: {what} from eager by {err:.2e} (relative)"
                )
        report["results"].extend(recs)
        if bar is not None:
            bar.update(1)
        if on_case is not None:
            on_case(report)
    if max_batch is not None:
        add_max_batches(
            report,
            model_ops,
            impls,
            device=device,
            dtype=dtype,
            iters=iters,
            seed=seed,
            cap=max_batch,
            note=record_note,
            progress=bar,
            on_case=on_case,
        )
    if bar is not None:
        bar.close()
    report["loadavg_end"] = _loadavg()
    report["complete"] = True
    return report


def add_max_batches(
    report: dict,
    ops,
    impls,
    *,
    device: torch.device,
    dtype: torch.dtype,
    iters: int,
    seed: int,
    cap: int,
    note: Callable[[str], None] = print,
    progress=None,
    on_case: Callable[[dict], None] | None = None,
):
    """--max-batch: model_max_batch for each model op and impl, into report["max_batch"] (a list) and the
    "max_batch" / "max_batch_capped" fields of the op's and impl's records (every batch size)."""
    report["max_batch"] = []
    for op in ops:
        for impl in sorted(impls, key=IMPLS.index):
            if progress is not None:
                progress.set_postfix_str(f"--max-batch {op} {impl}")
            if impl == "capsroute" and not model_supported(op, device):
                continue
            try:
                found = model_max_batch(
                    op, impl, device=device, dtype=dtype, iters=iters, seed=seed, cap=cap
                )
            except Exception as e:  # noqa: BLE001  (an error other than OOM: OOMs are the search)
                found = {
                    "op": op,
                    "impl": impl,
                    "dtype": dtype_name(dtype),
                    "max_batch": None,
                    "cap": cap,
                    "error": failure_reason(e),
                }
                note(f"--max-batch {op} {impl}: {found['error']}")
                del e
                free_memory(device)
            report["max_batch"].append(found)
            for r in report["results"]:
                if (r["op"], r["impl"]) == (op, impl):
                    r["max_batch"] = found["max_batch"]
                    r["max_batch_capped"] = found.get("capped", False)
            if on_case is not None:
                on_case(report)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _build_info() -> dict:
    try:
        return capsroute.build_info()
    except Exception:  # noqa: BLE001
        return {"version": getattr(capsroute, "__version__", "?")}
