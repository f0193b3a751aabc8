"""Where a capsroute op's forward+backward, or a model's training step, spends its time: the torch
profiler over a few steps of each case the GPU records show missing its target (bench/results), as
the benchmark feeds it.

Per case: wall time a step, the GPU's kernel time a step (busy = kernel / wall: far under 100%
means the host or launch gaps bound the step), kernels and copies a step, the kernel path, and
the operators and kernels by GPU time. Runs on the CPU too (no kernel rows there), for a dry check."""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import capsroute
from capsroute.bench.cases import MODEL_OPS, get_impl, make_cases, make_inputs, parse_shape
from capsroute.bench.model_bench import (
    MODEL_KERNELS,
    get_model_impl,
    make_model,
    make_model_inputs,
    train_step,
)
from capsroute.bench.timing import (
    clear_grads,
    fwd_bwd_step,
    gpu_activities,
    gpu_ms,
    synchronize,
    time_samples,
)

# (op, shape, B), shape None for a model's training step: the missed targets of the H100 records,
# and dynamic_routing at B = 32, whose warp-row and cluster paths took the same 0.43 ms (a floor
# that is not the kernels'); CapsNet at B = 128, whose MNIST epoch took 2.35 s (the target: 2 s).
CASES = [
    ("conv_dynamic_routing", "segcaps", 16),
    ("dynamic_routing", "mnist", 32),
    ("dynamic_routing", "mnist", 512),
    ("dense_capsules", "mnist", 512),
    ("dense_inverted_attention_routing", "mnist", 512),
    ("em_routing", "em-conv", 2304),
    ("capsnet", None, 128),
]
QUICK_CASES = [
    ("conv_dynamic_routing", "16x16:2,2,4,4,3,1,1", 2),
    ("dynamic_routing", "mnist", 2),
    ("capsnet", None, 2),
]


def make_case(op, shape, B, device_type):
    (case,) = make_cases([op], None if shape is None else [parse_shape(shape)], [B], device_type)
    return case


def case_step(op, shape, B, device):
    """(the case, a step as the benchmark times it, what resets the gradients after a step, the ops
    whose kernel paths the step reports)."""
    case = make_case(op, shape, B, device.type)
    if op in MODEL_OPS:
        _, fn, optimizer = get_model_impl(make_model(op), "capsroute", device, torch.float32)
        images, labels = make_model_inputs(B, device, torch.float32)
        step = train_step(fn, optimizer, images, labels, device)
        return (
            case,
            step,
            functools.partial(optimizer.zero_grad, set_to_none=True),
            MODEL_KERNELS[op],
        )
    inputs, grad = make_inputs(op, case, torch.float32, device)
    step = fwd_bwd_step(get_impl(case, "capsroute"), inputs, grad, 3)
    return case, step, functools.partial(clear_grads, inputs), (op,)


def profile_case(op, shape, B, device, steps, rows) -> tuple[str, str]:
    """(the case's report, its summary line)."""
    case, step, reset, path_ops = case_step(op, shape, B, device)

    def run_steps(n):
        for _ in range(n):
            step()
            reset()
        synchronize(device)

    run_steps(3)  # warm: cuBLAS handles, the caching allocator, Adam's state
    # The step's time as the benchmark takes it, without the profiler, whose own overhead per
    # operator would make the GPU look idler than it is.
    wall_ms = statistics.median(time_samples(step, device, repeats=steps, before=reset))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run_steps(steps)
    kernels = gpu_activities(prof)
    kernel_ms = gpu_ms(kernels, steps)
    paths = {
        name: "/".join(capsroute.last_kernel_path(name, d) for d in ("forward", "backward"))
        for name in path_ops
    }
    path = paths[op] if op in paths else ", ".join(f"{name} {p}" for name, p in paths.items())
    gpu = (
        f"kernels {kernel_ms:.3f} ms (busy {kernel_ms / wall_ms:.0%}), "
        f"{len(kernels) / steps:.0f} kernels and copies a step, "
        if device.type == "cuda"
        else ""
    )
    summary = f"{case.label()}: {wall_ms:.3f} ms a step (median), {gpu}path {path}"
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)
    return f"== {summary}\n{table}\n", summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rows", type=int, default=25, help="operators and kernels listed a case")
    p.add_argument("--quick", action="store_true", help="two small cases (a dry check)")
    p.add_argument("--out", type=Path, help="folder for profile.txt (else stdout only)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profile: no GPU visible to torch (--device cpu for a dry check)")
    report, summaries = [], []
    for op, shape, B in QUICK_CASES if args.quick else CASES:
        text, summary = profile_case(op, shape, B, device, args.steps, args.rows)
        print(summary, flush=True)
        report.append(text)
        summaries.append(summary)
        if args.out:  # written after each case: a call cut off keeps the cases done
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "profile.txt").write_text("\n".join(summaries) + "\n\n" + "".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
