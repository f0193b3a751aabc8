"""`capsroute bench`: its options, and the run they ask for (cases, table, JSON, figures)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from .._utils.runinfo import device_name, git_commit, resolve_device, write_json_atomic
from .cases import (
    CONV_SHAPES,
    DTYPES,
    IMPLS,
    LAYOUT_OPS,
    LAYOUTS,
    OPS,
    SHAPES,
    make_cases,
    op_list,
    op_name,
    parse_shape,
)
from .measure import MAX_BATCH_CAP
from .op_bench import MAX_BATCH_BUDGET_GB
from .report import default_out, format_table, report_path, unique_path
from .runner import run_benchmarks


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser):
    """The options of `capsroute bench`."""
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default: auto)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--op",
        nargs="+",
        type=op_name,
        default=list(OPS),
        help=f"ops to run, by name or short name: {op_list()}; capsnet, matrixcapsnet and "
        "efficientcapsnet time a whole training step of the model (default: the routing ops, "
        "attention included; the conv and model ops run when named)",
    )
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument(
        "--shape",
        nargs="+",
        type=parse_shape,
        default=None,
        metavar="NAME|I,J,D[,Din]|HxW:C_in,C_out,D,Din,K[,stride[,padding]]",
        help=f"named shapes: {', '.join(SHAPES)} (for EM ops D is the pose size H); conv ops: "
        f"{', '.join(CONV_SHAPES)} or HxW:...; default: mnist on CPU, mnist and large on CUDA for the "
        "dynamic-routing ops, efficientcapsnet and mnist on CPU (and large-16k on CUDA) for the "
        "attention routings, em-class and em-conv for EM, mcn-conv1 mcn-conv2 conv-image for conv EM, "
        "conv-image segcaps for conv dynamic",
    )
    p.add_argument(
        "--batch",
        nargs="+",
        type=_positive,
        default=None,
        help="batch sizes for every shape and model op (default: 32 on CPU (8 for large, 2 for "
        "large-16k, 16 for em-class, 72 for em-conv); 32 128 512 2048 on CUDA (8 32 128 for large-16k, "
        "64 256 for em-class, 2304 for em-conv); model ops: 16 on CPU, 32 128 512 on CUDA; conv ops: "
        "bench/README.md)",
    )
    p.add_argument(
        "--layout",
        nargs="+",
        default=["contiguous"],
        choices=LAYOUTS,
        help=f"layouts of the first input of {' and '.join(LAYOUT_OPS)} (einsum: input-capsule-major, as "
        "torch.einsum or a permute returns it), a case each; every impl gets the same tensors; "
        "the other ops run contiguous (default: contiguous)",
    )
    p.add_argument("--iters", type=_positive, default=3)
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per measurement (default: 10 CPU, 50 CUDA)",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up calls (default: 2 CPU, 5 CUDA)"
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=10.0,
        help="stop a measurement after this long (at least 3 calls); default 10",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    p.add_argument(
        "--max-batch",
        type=_positive,
        nargs="?",
        const=MAX_BATCH_CAP,
        default=None,
        metavar="CAP",
        help="also find the largest power-of-two batch (up to CAP, default "
        f"{MAX_BATCH_CAP}) for which each impl fits: model ops on CUDA (a training step in GPU memory, "
        "tried); conv ops (forward+backward per shape): on CUDA tried, on the CPU extrapolated from the "
        "peaks at B = 1, 2 against --max-batch-budget",
    )
    p.add_argument(
        "--max-batch-budget",
        type=float,
        default=MAX_BATCH_BUDGET_GB,
        metavar="GB",
        help=f"the CPU memory budget (GiB) of --max-batch for conv ops (default {MAX_BATCH_BUDGET_GB:g})",
    )
    p.add_argument(
        "--inference", action="store_true", help="also time the forward under torch.no_grad()"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory (file named <device>-<date>-<sha>.json) or a .json path (default: bench/results/ "
        "of the capsroute checkout the current directory is in, else ./bench-results)",
    )
    save = p.add_mutually_exclusive_group()
    save.add_argument("--no-save", action="store_true", help="print the table only")
    save.add_argument(
        "--plot",
        action="store_true",
        help="also draw PNG figures next to the JSON (needs matplotlib)",
    )
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """`capsroute bench`: runs the cases, prints the table, writes the JSON (and with --plot the figures)."""
    if args.plot:
        from .plot import plot_report  # now rather than after the run if matplotlib is missing
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    impls = [i for i in args.impl if not (args.no_compile and i == "compiled")]
    shapes = args.shape  # None: each op's default shapes
    cases = make_cases(
        dict.fromkeys(args.op), shapes, args.batch, device.type, dict.fromkeys(args.layout)
    )
    repeats = args.repeats or (50 if device.type == "cuda" else 10)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 2)

    path = None
    if not args.no_save:
        probe = {
            "device": device_name(device),
            "date": datetime.date.today().isoformat(),
            "commit": git_commit(),
        }
        path = unique_path(report_path(probe, args.out or default_out()))
    save = (lambda rep: write_json_atomic(rep, path)) if path is not None else None
    report = run_benchmarks(
        cases,
        impls,
        device=device,
        dtype=dtype,
        iters=args.iters,
        repeats=repeats,
        warmup=warmup,
        max_seconds=args.max_seconds,
        inference=args.inference,
        seed=args.seed,
        progress=not args.no_progress,
        on_case=save,
        max_batch=args.max_batch,
        max_batch_budget_gb=args.max_batch_budget,
        command=args.invocation,
    )
    print(format_table(report))
    for msg in report["notes"]:
        print("note:", msg)
    if path is not None:
        write_json_atomic(report, path)
        print(f"wrote {path}")
    if args.plot:
        for png in plot_report(report, path):
            print(f"wrote {png}")
    errors = [r for r in report["results"] if str(r.get("skipped", "")).startswith("error")]
    return 1 if errors else 0
