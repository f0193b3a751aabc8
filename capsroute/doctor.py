"""`capsroute doctor`: checks that this install computes what it should on a device.

Every op, on every kernel path the device has (each CUDA path forced in turn through its
environment switch), in every storage dtype, against the float64 plain-PyTorch reference
(capsroute.reference) on small odd shapes and the canonical ones: the outputs and every gradient.
Prints which kernel path each check ran (capsroute.last_kernel_path) and times each op against
eager PyTorch at one canonical shape. Exits 1 on a mismatch, a failed call, or a forced path that
did not run; a forced path that the device cannot schedule is reported as refused, with the reason.

  capsroute doctor [--device cpu|cuda] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import capsroute
from capsroute import reference

from ._utils.command import ArgumentParser, CommandError, refusing, whole_number
from ._utils.runinfo import (
    cpu_machine,
    describe_cpu,
    device_name,
    dtype_name,
    loadavg,
    resolve_device,
    write_json_atomic,
)
from .bench.timing import synchronize, time_samples
from .testing import DTYPES, OPS, OpCheck, randn

# The environment switches of the CUDA kernels (csrc/cuda/kernel_options.h and the launch files).
SWITCHES = (
    "CAPSROUTE_ROUTING_SPLITS",
    "CAPSROUTE_ROUTING_CLUSTER",
    "CAPSROUTE_EM_SPLITS",
    "CAPSROUTE_EM_LANES",
    "CAPSROUTE_DENSE_CHUNK",
    "CAPSROUTE_EM_POSE_BACKWARD_CHUNK",
    "CAPSROUTE_CONV_CHUNK",
)
REFUSED = "CAPSROUTE_ROUTING_CLUSTER=force, but"  # a forced cluster path refusing to run
WARP_ROW_MAX_J, WARP_ROW_MAX_D = 32, 16  # warp_rows_fit (csrc/cuda/agreement_warp_rows_kernels.cuh)


@dataclass(frozen=True)
class KernelPath:
    """A kernel path forced through the switches; expect(shape) is the path it must record, or None
    where the dispatch chooses (automatic mode: any path is right)."""

    label: str
    switches: dict
    expect: Callable = lambda shape: None


def _routing_paths(
    prefix: str, with_clusters: bool, capsules=lambda shape: shape[2:4]
) -> list[KernelPath]:
    """dynamic_routing's (prefix "") paths, or those of an op that routes with its kernels
    (dense_capsules' "dense-v2-gemm+", conv_dynamic_routing's "conv-gemm+"); capsules(shape) gives
    the routing's J and D."""

    def path(cluster):
        def expect(shape):
            J, D = capsules(shape)
            if J > WARP_ROW_MAX_J or D > WARP_ROW_MAX_D:
                return prefix + "v2-block"  # the warp rows do not fit these capsules
            return prefix + ("v2-cluster" if cluster else "v2-warp-rows")

        return expect

    paths = [KernelPath("no clusters", {"CAPSROUTE_ROUTING_CLUSTER": "0"}, path(False))]
    if with_clusters:
        paths.append(
            KernelPath("clusters forced", {"CAPSROUTE_ROUTING_CLUSTER": "force"}, path(True))
        )
    paths.append(KernelPath("auto", {}))
    return paths


def kernel_paths(check: OpCheck, device: torch.device) -> list[KernelPath]:
    """The paths of an op on a device: one on the CPU; on CUDA every path."""
    if device.type == "cpu":
        return [KernelPath("-", {}, lambda shape: "cpu")]
    # The cluster kernels run on sm_90 and later only (elsewhere they refuse to be forced).
    clusters = torch.cuda.get_device_capability(device) >= (9, 0)
    if check.family == "squash":
        return [KernelPath("-", {}, lambda shape: "cuda")]
    if check.family == "conv-em":
        return [KernelPath("-", {}, lambda shape: "conv-em-parent-child")]
    if check.family == "routing":
        return _routing_paths("", clusters)
    if check.family == "dense":
        paths = _routing_paths("dense-v2-gemm+", clusters)
        # Chunks of 2 elements: the vote workspace reused across chunks.
        paths[-1] = KernelPath("auto chunk=2", {"CAPSROUTE_DENSE_CHUNK": "2"})
        return paths
    if check.family == "attention":  # the dispatch chooses: any path is right
        return [KernelPath("auto", {})]
    if check.family == "dense-attention":  # also with the vote workspace reused across chunks
        return [KernelPath("auto", {}), KernelPath("auto chunk=2", {"CAPSROUTE_DENSE_CHUNK": "2"})]
    if check.family == "conv":
        paths = _routing_paths("conv-gemm+", clusters, lambda shape: shape[4:6])
        # Chunks of 7 positions: rows of an image, the workspace reused across chunks.
        paths[-1] = KernelPath("auto chunk=7", {"CAPSROUTE_CONV_CHUNK": "7"})
        return paths
    return [
        KernelPath("splits=3", {"CAPSROUTE_EM_SPLITS": "3"}, _em_path),
        KernelPath("capsule lanes", {"CAPSROUTE_EM_LANES": "capsule"}, lambda s: "em-row-ranges"),
        KernelPath("auto", {}),
    ]


def _em_path(shape) -> str:
    """The EM ops' path: a warp lane per (j, h) entry where the capsule size H divides 32
    (em_routing's shape (B, I, J, H); em_routing_pose's 4 x 4 poses are 16), else per capsule."""
    H = shape[3] if len(shape) > 3 else 16
    return "em-column-lanes" if 32 % H == 0 else "em-row-ranges"


@contextlib.contextmanager
def switches(values: dict):
    """The kernel switches set to `values` (the others unset) for the block, then restored. The
    extension reads them at every call."""
    saved = {name: os.environ.get(name) for name in SWITCHES}
    try:
        for name in SWITCHES:
            os.environ.pop(name, None)
        os.environ.update(values)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in float64; inf where non-finite values differ."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if expected.numel() == 0:
        return 0.0
    if not torch.equal(torch.isfinite(actual), torch.isfinite(expected)):
        return float("inf")
    finite = torch.isfinite(expected)
    scale = expected[finite].abs().max().item() if finite.any() else 1.0
    return (actual[finite] - expected[finite]).abs().max().item() / max(scale, 1e-300)


def outputs_and_grads(
    check: OpCheck, module, tensors, cotangents=None, generator=None
) -> tuple[list, list]:
    """(the op's outputs, then the gradients of sum(output * cotangent) w.r.t. every input; the
    cotangents): random float64 ones from `generator` unless given."""
    outs = check.call(module, *tensors)
    diff = outs[: check.grad_outputs]
    if cotangents is None:
        cotangents = [randn(*o.shape, device=o.device, generator=generator) for o in diff]
    grads = torch.autograd.grad(diff, tensors, [c.to(o.dtype) for o, c in zip(diff, cotangents)])
    return [*outs, *grads], cotangents


@dataclass
class Result:
    op: str
    dtype: str
    shape: str
    switch: str
    expected: str | None
    forward: str = ""
    backward: str = ""
    error: float | None = None
    tolerance: float = 0.0
    status: str = "ok"  # ok | refused | FAIL
    note: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def check_one(
    check: OpCheck, label: str, shape: tuple, dtype, path: KernelPath, device: torch.device
) -> Result:
    generator = torch.Generator().manual_seed(0)
    inputs = check.make(shape, device, dtype, generator)
    # The reference gets the very values capsroute gets (rounded to dtype), in float64.
    ref_inputs = [t.detach().to(torch.float64, copy=True).requires_grad_() for t in inputs]
    result = Result(
        check.name,
        dtype_name(dtype),
        label,
        path.label,
        path.expect(shape),
        tolerance=check.tolerance(dtype),
    )
    try:
        expected, cotangents = outputs_and_grads(check, reference, ref_inputs, generator=generator)
        with switches(path.switches):
            capsroute.clear_kernel_paths()
            ours, _ = outputs_and_grads(check, capsroute, inputs, cotangents)
            synchronize(device)
            result.forward = capsroute.last_kernel_path(check.name, "forward")
            result.backward = capsroute.last_kernel_path(check.name, "backward")
    except Exception as e:  # noqa: BLE001  (every failure is a row of the table)
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        result.status, result.note = ("refused" if REFUSED in message else "FAIL"), message[:200]
        return result
    result.error = max(rel_err(a, b) for a, b in zip(ours, expected))
    ran = {result.forward, result.backward}
    if result.error > result.tolerance:
        result.status, result.note = "FAIL", "mismatch against the float64 reference"
    elif "" in ran:
        result.status, result.note = "FAIL", "no kernel path recorded"
    elif result.expected is not None and ran != {result.expected}:
        result.status, result.note = "FAIL", f"forced {result.expected}, but another path ran"
    return result


def time_op(check: OpCheck, device: torch.device, repeats: int) -> dict:
    """capsroute's and eager PyTorch's forward+backward (median ms, float32) at the op's timing
    shape: one warm-up call, then `repeats` timed ones (at least 3; fewer past 2 seconds)."""
    label, cpu_shape, cuda_shape = check.timing
    shape = cpu_shape if device.type == "cpu" else cuda_shape
    generator = torch.Generator().manual_seed(0)
    inputs = check.make(shape, device, torch.float32, generator)
    outs = check.call(reference, *inputs)[: check.grad_outputs]
    cotangents = [
        randn(*o.shape, dtype=torch.float32, device=device, generator=generator) for o in outs
    ]
    row = {"op": check.name, "case": f"{check.name} {label} B={shape[0]}", "shape": list(shape)}
    for impl, module in (("capsroute", capsroute), ("eager", reference)):

        def step():
            torch.autograd.grad(
                check.call(module, *inputs)[: check.grad_outputs], inputs, cotangents
            )

        step()  # warm-up
        times = time_samples(step, device, repeats=repeats, max_seconds=2.0)
        row[f"{impl}_ms"] = statistics.median(times)
        if impl == "capsroute":
            row["path"] = "/".join(
                capsroute.last_kernel_path(check.name, direction)
                for direction in ("forward", "backward")
            )
    row["speedup"] = row["eager_ms"] / row["capsroute_ms"] if row["capsroute_ms"] > 0 else None
    return row


def format_results(results: list[Result]) -> str:
    header = ("op", "dtype", "shape", "switch", "path (fwd/bwd)", "max err", "tol", "result")
    rows = [header]
    for r in results:
        path = r.forward if r.forward == r.backward else f"{r.forward}/{r.backward}"
        error = "-" if r.error is None else f"{r.error:.1e}"
        status = r.status + (f": {r.note}" if r.note else "")
        rows.append(
            (r.op, r.dtype, r.shape, r.switch, path or "-", error, f"{r.tolerance:.0e}", status)
        )
    widths = [max(len(row[k]) for row in rows) for k in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows
    )


def format_timings(rows: list[dict]) -> str:
    """The timing table; a row where capsroute is slower than eager says so."""
    width = max([len("case"), *(len(r["case"]) for r in rows)])
    lines = [
        f"{'case':<{width}} {'capsroute ms':>12} {'eager ms':>10} {'speedup':>8}  path (fwd/bwd)"
    ]
    for r in rows:
        slower = "  slower than eager" if r["speedup"] is not None and r["speedup"] < 1 else ""
        lines.append(
            f"{r['case']:<{width}} {r['capsroute_ms']:>12.3f} {r['eager_ms']:>10.3f} "
            f"{r['speedup']:>7.1f}x  {r['path']}{slower}"
        )
    return "\n".join(lines)


def plan(device: torch.device, quick: bool) -> list[tuple]:
    """Every (check, shape label, shape, dtype, path) the doctor runs on the device."""
    todo = []
    for check in OPS:
        for path in kernel_paths(check, device):
            for dtype in DTYPES:
                for label, shape in check.shapes(quick).items():
                    todo.append((check, label, shape, dtype, path))
    return todo


def add_arguments(p: argparse.ArgumentParser):
    """The options of `capsroute doctor`."""
    p.add_argument(
        "--device",
        default="auto",
        help="cpu | cuda | cuda:N | auto (default: auto, cuda where there is one)",
    )
    p.add_argument("--quick", action="store_true", help="the small odd shapes only, no timings")
    p.add_argument(
        "--repeats",
        type=whole_number(1),
        default=None,
        help="timed calls per measurement (default: 3 CPU, 20 CUDA)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the results and timings as JSON",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    device = resolve_device(args.device)
    if device.type == "cuda" and not capsroute.build_info()["cuda"]:
        raise CommandError(
            "--device cuda: this capsroute was built without its CUDA kernels; "
            "rebuild it with CAPSROUTE_FORCE_CUDA=1 where a CUDA toolkit is"
        )
    machine = cpu_machine(capsroute.build_info()["cpu_arch"])
    load_start = loadavg()
    print(f"capsroute {capsroute.__version__} on {device_name(device)}, torch {torch.__version__}")
    print(f"CPU: {describe_cpu(machine)}; load average {load_start}")
    todo = plan(device, args.quick)
    progress = tqdm(todo, desc="doctor", file=sys.stderr, disable=args.no_progress)
    results = [check_one(*item, device) for item in progress]
    print(format_results(results))
    timings = []
    if not args.quick:
        repeats = args.repeats or (3 if device.type == "cpu" else 20)
        with switches({}):
            timings = [time_op(check, device, repeats) for check in OPS]
        print(
            "\nforward+backward, float32, default switches, against eager PyTorch "
            "(capsroute.reference):"
        )
        print(format_timings(timings))
    failed = [r for r in results if r.failed]
    refused = sum(r.status == "refused" for r in results)
    passed = len(results) - len(failed) - refused
    print(
        f"\n{passed} passed, {len(failed)} failed, {refused} refused "
        "(a forced path this device cannot run)"
    )
    if args.json is not None:
        report = {
            "kind": "doctor",
            "device": device_name(device),
            "torch": torch.__version__,
            "build": capsroute.build_info(),
            "machine": machine,
            "loadavg_start": load_start,
            "loadavg_end": loadavg(),
            "results": [vars(r) for r in results],
            "timings": timings,
        }
        write_json_atomic(report, args.json)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = ArgumentParser(prog="capsroute doctor", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    with refusing("capsroute doctor"):
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
