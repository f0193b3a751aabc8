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

from .._utils.runinfo import (
    command_line,
    cpu_machine,
    device_name,
    dtype_name,
    git_commit,
    loadavg,
    precision_modes,
)
from .cases import CONV_OPS, IMPLS, MODEL_OPS, Case, impls_for, unavailable_impls
from .floor import measure_bandwidth, measure_peak_tflops
from .measure import failure_reason
from .model_bench import MODEL_TOL_FACTOR, bench_model_case, model_max_batch, model_unavailable
from .op_bench import MAX_BATCH_BUDGET_GB, bench_case, op_max_batch
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
    max_batch_budget_gb: float = MAX_BATCH_BUDGET_GB,
    command: str | None = None,
) -> dict:
    """Runs the cases and returns the report (the JSON document). on_case(report) is called after each case.
    command: the command line recorded (default: the program's name and its arguments).
    max_batch: after the cases, search the largest power-of-two batch up to this cap of each impl of
    each model op (CUDA; model_max_batch) and conv op shape (op_max_batch; on the CPU within
    max_batch_budget_gb) into report["max_batch"] and each matching record's "max_batch"."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional for library use
        tqdm = None
    bar = (
        tqdm(total=len(cases), disable=not progress, file=sys.stderr, unit="case") if tqdm else None
    )
    note = bar.write if bar is not None else print

    load = loadavg()  # before this process adds its own
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
        **cpu_machine(_build_info().get("cpu_arch", "unknown")),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "capsroute": _build_info(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("CAPSROUTE_")},
        "bandwidth_gbs": bandwidth,
        "peak_tflops": peak,
        **precision_modes(),
        "repeats": repeats,
        "warmup": warmup,
        "max_seconds": max_seconds,
        "seed": seed,
        "command": command or command_line(os.path.basename(sys.argv[0]), None),
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
    if max_batch is not None:
        searches = max_batch_searches(cases, device, record_note)
        report["max_batch_budget_gb"] = max_batch_budget_gb if device.type == "cpu" else None
    for n, case in enumerate(cases):
        if case.op in MODEL_OPS:
            # one seed per model op (not per case): every batch size trains the same initial weights
            recs = bench_model_case(
                case,
                impls_for(case.op, impls),
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
            searches,
            impls,
            device=device,
            dtype=dtype,
            iters=iters,
            seed=seed,
            cap=max_batch,
            budget_gb=max_batch_budget_gb,
            note=record_note,
            progress=bar,
            on_case=on_case,
        )
    if bar is not None:
        bar.close()
    report["loadavg_end"] = loadavg()
    report["complete"] = True
    return report


def max_batch_searches(cases: list[Case], device: torch.device, note) -> list[Case]:
    """What --max-batch searches: each model op (CUDA only) and each conv op's shape, as a Case (its B
    unused); notes what it leaves out."""
    searches, cpu_models = {}, []
    for case in cases:
        if case.op in MODEL_OPS and device.type != "cuda":
            cpu_models.append(case.op)
        elif case.op in MODEL_OPS or case.op in CONV_OPS:
            searches.setdefault((case.op, case.shape_name), case)
    for op in dict.fromkeys(cpu_models):
        note(
            f"--max-batch of the model ops is CUDA-only (it tries training steps until one runs out of "
            f"GPU memory); not run for {op} on {device.type}"
        )
    if not searches and not cpu_models:
        note(
            f"--max-batch applies to the model ops ({', '.join(MODEL_OPS)}) and the conv ops only; "
            "none was asked for"
        )
    return list(searches.values())


def add_max_batches(
    report: dict,
    searches: list[Case],
    impls,
    *,
    device: torch.device,
    dtype: torch.dtype,
    iters: int,
    seed: int,
    cap: int,
    budget_gb: float = MAX_BATCH_BUDGET_GB,
    note: Callable[[str], None] = print,
    progress=None,
    on_case: Callable[[dict], None] | None = None,
):
    """--max-batch: for each search (max_batch_searches) and impl, model_max_batch (model ops) or
    op_max_batch (conv ops), into report["max_batch"] (a list) and the "max_batch" /
    "max_batch_capped" fields of the matching records (same op, shape and impl; every batch size)."""
    report["max_batch"] = []
    for case in searches:
        for impl in sorted(impls_for(case.op, impls), key=IMPLS.index):
            if progress is not None:
                progress.set_postfix_str(f"--max-batch {case.op} {case.shape_name} {impl}")
            model = case.op in MODEL_OPS
            if impl in (
                model_unavailable(case.op, device) if model else unavailable_impls(case, device)
            ):
                continue
            try:
                if model:
                    found = model_max_batch(
                        case.op, impl, device=device, dtype=dtype, iters=iters, seed=seed, cap=cap
                    )
                else:
                    found = op_max_batch(
                        case,
                        impl,
                        device=device,
                        dtype=dtype,
                        iters=iters,
                        seed=seed,
                        cap=cap,
                        budget_gb=budget_gb,
                    )
            except Exception as e:  # noqa: BLE001  (an error other than OOM: OOMs are the search)
                found = {
                    "op": case.op,
                    "shape_name": case.shape_name,
                    "impl": impl,
                    "dtype": dtype_name(dtype),
                    "max_batch": None,
                    "cap": cap,
                    "error": failure_reason(e),
                }
                note(f"--max-batch {case.op} {impl}: {found['error']}")
                del e
                free_memory(device)
            report["max_batch"].append(found)
            for r in report["results"]:
                if (r["op"], r.get("shape_name"), r["impl"]) == (case.op, case.shape_name, impl):
                    r["max_batch"] = found["max_batch"]
                    r["max_batch_capped"] = found.get("capped", False)
                    if "max_side" in found:
                        r["max_side"] = found["max_side"]
            if on_case is not None:
                on_case(report)


def _build_info() -> dict:
    try:
        return capsroute.build_info()
    except Exception:  # noqa: BLE001
        return {"version": getattr(capsroute, "__version__", "?")}
