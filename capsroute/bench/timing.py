"""How a step is timed and its memory measured: the forward and forward+backward steps, the timer
(CUDA events or perf_counter), the GPU's busy time in a step (the profiler's kernels), the peak
memory of one call (CUDA allocator statistics, or on the CPU a replay of the profiler's allocation
events), and the out-of-memory helpers."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
from typing import Callable

import torch

os.environ.setdefault(
    "KINETO_LOG_LEVEL", "5"
)  # quiets kineto's "gpuGetDeviceCount failed" on GPU-less hosts

MiB = 2.0**20


def fwd_step(fn, inputs, iters):
    def step():
        return fn(*inputs, iters)

    return step


def fwd_bwd_step(fn, inputs, grad, iters):
    """Forward + backward; returns the (first) output. grad is a tensor or, for ops with several
    outputs (EM routing: pose, a_out), a tuple."""

    def step():
        out = fn(*inputs, iters)
        if isinstance(out, tuple):
            torch.autograd.backward(out, grad)
            return out[0]
        out.backward(grad)
        return out

    return step


def clear_grads(inputs):
    for t in inputs:
        t.grad = None


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples(
    step: Callable,
    device: torch.device,
    *,
    repeats: int,
    before: Callable | None = None,
    min_repeats: int = 3,
    max_seconds: float = float("inf"),
) -> list[float]:
    """Times `repeats` calls of step() (ms each). before() runs outside the clock before each call."""
    times = []
    started = time.perf_counter()
    synchronize(device)
    for k in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = step()
            times.append((time.perf_counter() - t0) * 1e3)
        del out
        if k + 1 >= min_repeats and time.perf_counter() - started > max_seconds:
            break
    return times


@contextlib.contextmanager
def _quiet_stderr():
    """Silences file descriptor 2 (kineto prints profiler_start/stop lines there) for the block."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _walk(nodes):
    stack = list(nodes)
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children)


def cpu_peak_bytes(step: Callable) -> int:
    """Peak of live CPU tensor bytes during step(), above what was live before it.

    torch has no CPU allocator statistics, so the call runs under torch.profiler with
    profile_memory=True and its allocation events (signed alloc_size: + allocate, - free) are
    replayed in time order; the running sum starts at 0. The profiler only reports frees of blocks it
    saw allocated, so freeing a tensor that existed before the call is not credited (the result is
    then an upper bound); the benchmark steps free nothing older than themselves (input grads are
    reset before the call). Checked on torch 2.14: allocate 10 MiB, allocate 4 MiB, free the 10,
    allocate 2 MiB gives 14 MiB.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    del out
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs = sorted(
        (n for n in _walk(tree) if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns
    )
    live = peak = 0
    for n in allocs:
        live += n.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


def gpu_activities(prof) -> list:
    """What a torch.profiler run put on the GPU: its kernels, copies and fills."""
    from torch.autograd import DeviceType

    return [e for e in prof.events() if e.device_type == DeviceType.CUDA]


def gpu_ms(activities: list, calls: int) -> float:
    """The GPU's busy time per call (ms) of `calls` profiled calls (one stream: none overlap)."""
    return sum(e.device_time_total for e in activities) / 1e3 / calls


def gpu_busy_ms(
    step: Callable, device: torch.device, before: Callable | None = None, calls: int = 10
):
    """The GPU's busy time per step() (ms), profiled over `calls` calls. A step's time less this is
    the time the GPU waited for the host."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            step()
        synchronize(device)
    return gpu_ms(gpu_activities(prof), calls)


def peak_memory_mb(step: Callable, device: torch.device, before: Callable | None = None) -> float:
    """Peak memory (MiB) of one step() above what was allocated before it."""
    if before is not None:
        before()
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = step()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return peak / MiB
    return cpu_peak_bytes(step) / MiB


def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())) or isinstance(e, MemoryError):
        return True
    msg = str(e)
    return "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg


def free_memory(device: torch.device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
