"""Microbenchmarks of capsroute's routing ops, and of training steps of the two capsule networks,
against plain PyTorch (DESIGN.md section 4).

For each op x shape x batch size, three implementations are measured in the same run on the same
device, on the same random inputs:

  capsroute  the fused op (capsroute.dynamic_routing / capsroute.dense_capsules)
  eager      the plain PyTorch reference (capsroute.reference), run eagerly
  compiled   torch.compile(reference fn), default mode; torch._dynamo is reset before each case so
             every case gets its own static-shape compile. Compile time is excluded from the timings
             (it happens in the warm-up) and reported on its own as compile_s (wall time of the first
             forward+backward call, which compiles both graphs).

What is measured (per implementation):

  fwd_ms       median wall time of one forward call with inputs that require grad (as in training:
               the autograd graph is recorded, then dropped; no backward).
  fwd_bwd_ms   median wall time of forward + v.backward(grad) with a fixed random grad; input .grad
               are reset to None (outside the clock) before each call, so they are freshly allocated.
  peak_mb      peak memory of one forward+backward call, in MiB, above what was allocated before it
               (inputs and the incoming grad). On CUDA: torch.cuda.reset_peak_memory_stats /
               max_memory_allocated. On CPU there is no allocator statistic in torch, so the call is
               run under torch.profiler with profile_memory=True and the allocation/free events
               (the profiler's event tree, each with a signed alloc_size) are replayed in time order;
               the peak of the running sum is the peak of live tensor bytes.
  fwd_infer_ms (with --inference) median forward time under torch.no_grad().

Timing: CUDA with CUDA events around each call, then synchronize (host launch overhead that the
GPU waits on is therefore included, as a user would see it); CPU with time.perf_counter. Warm-up
calls first. Each median is over --repeats calls, stopped early (after at least 3) once a
measurement has taken --max-seconds.

Floor model (per case; itemsize s bytes; "per element" = per batch element):

  bandwidth   measured in the same run: a large tensor copy, (bytes read + bytes written) / time,
              best of several.
  peak        measured in the same run: a large square matmul in the benchmark dtype, 2 N^3 / time,
              best of several (float32 matmuls follow torch's float32_matmul_precision, which is
              "highest", i.e. no TF32, by default).
  flops       routing, per element: iters weighted sums s_j = sum_i c_ij u_ij (2 I J D each) plus
              (iters - 1) agreements <u_ij, v_j> (2 I J D each): R = 2 I J D (2 iters - 1).
              Softmax and squash are O(I J) and O(J D) and are ignored.
              dynamic_routing forward: B R.
              dense_capsules forward:  B (2 I J D Din + R)  (the vote transform u_ij = W_ij u_i).
              em_routing forward: B I J H (5 iters + 4 (iters - 1)) (M-step mean and variance per
              iteration, E-step log densities but after the last); em_routing_pose adds 128 I J per
              element for the 4x4 products pose_i @ W_ij.
              forward+backward: 3 x forward (each multiply-add has two operands to differentiate);
              recomputation that an implementation chooses to do is not counted.
  bytes       what must cross memory at least once:
              dynamic_routing forward:  read votes (B I J D s), write v (B J D s).
              dense_capsules forward:   read u (B I Din s) and weight (I J D Din s), write v.
              forward+backward adds:    read grad_v (B J D s), write grad_votes (B I J D s), or
                                        grad_u (B I Din s) and grad_weight (I J D Din s).
              Inputs are counted once even though forward and backward are separate calls.
  floor       floor_fwd_ms = max(bytes_fwd / bandwidth, flops_fwd / peak) and
              floor_ms     = max(bytes_fwd_bwd / bandwidth, flops_fwd_bwd / peak),
              i.e. floor_ms (the field of DESIGN.md 4) is the floor of forward+backward;
              floor_x = fwd_bwd_ms / floor_ms and floor_fwd_x = fwd_ms / floor_fwd_ms.
              When the working set fits in cache (small cases on a CPU) a time below the DRAM
              floor (x < 1) is possible.

Model ops (capsnet, matrixcapsnet): a whole training step of capsroute.models.CapsNet /
MatrixCapsNet on random images in [0, 1) of shape (B, 1, 28, 28) and random labels, the same for
the three implementations, each starting from the same weights (one seed):

  capsroute  the model with backend="fused"
  eager      the same model with backend="reference" (capsroute.nn.set_backend)
  compiled   torch.compile(the reference-backend model): the whole forward, default mode, one graph
             (the loss, backward and optimizer step run as usual; compile_s as above)

  fwd_ms       median time of model(images, labels) in training mode with grad (graph dropped).
  fwd_bwd_ms   median time of one training step: forward, loss (CapsNet: margin + reconstruction;
               MatrixCapsNet: spread loss, margin 0.2), loss.backward() and Adam's step();
               optimizer.zero_grad(set_to_none=True) runs before each call, outside the clock.
  peak_mb      peak memory of one training step above what was allocated before it (parameters,
               Adam state and images, recorded as state_mb).
  images_per_s B / fwd_bwd_ms. floor_ms is null (no floor model).
  max_rel_err  the first two losses (before and after one Adam step) and strided samples of the
               first step's parameter gradients, against eager's (loss_rel_err, grad_rel_err); the
               warning threshold is 10x the routing ops' (rounding grows through a whole network).
  --dtype float16 / bfloat16 trains float32 parameters under torch.autocast (as `capsroute train
  --amp`, without a GradScaler); float64 casts the model.
  --max-batch (CUDA): model_max_batch finds, per model op and impl, the largest power-of-two batch
  up to a cap for which one training step fits in GPU memory (doubling from 1 until the first
  torch.OutOfMemoryError; memory is freed between tries).

Results are printed as a table and written as JSON (DESIGN.md section 4 fields plus extras) under
bench/results/<device-slug>-<date>-<shortsha>.json. A case that runs out of memory is skipped and
recorded with its reason instead of crashing the run.

The command `capsroute bench` (capsroute/cli.py) is add_arguments and run below. Library use:
run_benchmarks(...) returns the report dict; format_table(report) and write_report(report, out) print
and save it; make_inputs, get_impl, fwd_step/fwd_bwd_step, time_samples and peak_memory_mb are reused
by bench/test_bench_routing.py. bench_model_case, model_max_batch and find_max_batch are the model ops'.
"""
from __future__ import annotations

import os

os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # quiets kineto's "gpuGetDeviceCount failed" on GPU-less hosts

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

import capsroute
from capsroute import reference
from capsroute.losses import training_loss
from capsroute.nn import set_backend

OPS = {  # op -> the short name that `--op` also accepts
    "dynamic_routing": "dynamic",
    "dense_capsules": "dense",
    "em_routing": "em",
    "em_routing_pose": "em-pose",
}
EM_OPS = ("em_routing", "em_routing_pose")
MODEL_OPS = {  # a whole training step of a model of capsroute.models; the short name is the same
    "capsnet": "capsnet",
    "matrixcapsnet": "matrixcapsnet",
}
ALL_OPS = {**OPS, **MODEL_OPS}
IMPLS = ("capsroute", "eager", "compiled")
SHAPES = {  # DESIGN.md section 4; for EM ops D is the pose size H (16: 4x4 matrices)
    "mnist": dict(I=1152, J=10, D=16, Din=8),   # MNIST DigitCaps
    "large": dict(I=4608, J=100, D=16, Din=8),
    "em-class": dict(I=512, J=10, D=16, Din=16),   # EM class capsules
    "em-conv": dict(I=288, J=32, D=16, Din=16),    # EM conv capsules: 3*3*32 inputs, B = batch x 36 positions
    "scale-100": dict(I=16384, J=100, D=32, Din=8),   # far past MNIST: time should grow no faster than the work
    "scale-1000": dict(I=16384, J=1000, D=32, Din=8),
}
DEFAULT_BATCHES = {
    "cpu": {"mnist": [32], "large": [8], "em-class": [16], "em-conv": [2 * 36], None: [32]},
    "cuda": {"mnist": [32, 128, 512, 2048], "large": [32, 128, 512, 2048], "em-class": [64, 256],
             "em-conv": [64 * 36], None: [32, 128, 512, 2048]},
}
MODEL_BATCHES = {"cpu": [16], "cuda": [32, 128, 512]}
MODEL_IMAGE = (1, 28, 28)   # MNIST-sized images (C, H, W)
MODEL_SHAPE_NAME = "1x28x28"
MODEL_BACKENDS = {"capsroute": "fused", "eager": "reference", "compiled": "reference"}
MODEL_KERNELS = {"capsnet": ("squash", "dense_capsules"), "matrixcapsnet": ("em_routing_pose", "em_routing")}
MODEL_LR = 1e-3             # Adam, as `capsroute train`
SPREAD_MARGIN = 0.2         # MatrixCapsNet's spread loss at the start of its margin schedule
MAX_BATCH_CAP = 2 ** 15     # --max-batch without a value
MODEL_TOL_FACTOR = 10       # model ops warn at 10x the routing ops' max_rel_err tolerance (1e-2 for float32)
DEFAULT_SHAPES = {"cpu": ["mnist"], "cuda": ["mnist", "large"], "em": ["em-class", "em-conv"]}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}
VOTE_STD = 0.1      # dynamic_routing votes ~ N(0, 0.1^2): |s| ~ 1, so squash and the agreement matter
WEIGHT_STD = 0.05   # dense_capsules weight ~ N(0, 0.05^2); u = squash(N(0, 1)) like primary capsules
MiB = 2.0 ** 20


# ----------------------------------------------------------------------------- cases and inputs

@dataclass(frozen=True)
class Case:
    op: str
    shape_name: str          # "mnist", "large" or "I,J,D,Din"
    B: int
    I: int
    J: int
    D: int
    Din: int

    def shape(self) -> dict:
        if self.op in MODEL_OPS:
            return {"B": self.B, "model": self.op}
        if self.op in EM_OPS:
            return {"B": self.B, "I": self.I, "J": self.J, "H": self.D}
        s = {"B": self.B, "I": self.I, "J": self.J, "D": self.D}
        if self.op == "dense_capsules":
            s["Din"] = self.Din
        return s

    def label(self) -> str:
        return f"{self.op} {self.shape_name} B={self.B}"


def parse_shape(spec: str) -> tuple[str, dict]:
    """'mnist' | 'large' | 'I,J,D,Din' (Din may be left out: 8) -> (name, dict(I, J, D, Din))."""
    if spec in SHAPES:
        return spec, dict(SHAPES[spec])
    parts = [int(p) for p in re.split(r"[,x]", spec)] if re.fullmatch(r"\d+([,x]\d+){2,3}", spec) else []
    if not parts or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"shape must be one of {', '.join(SHAPES)} or I,J,D[,Din]; got {spec!r}")
    if len(parts) == 3:
        parts.append(8)
    return ",".join(map(str, parts)), dict(zip(("I", "J", "D", "Din"), parts))


def _op_list() -> str:
    return ", ".join(f"{op} ({short})" if short != op else op for op, short in ALL_OPS.items())


def op_name(name: str) -> str:
    """An op's name from its name or short name (OPS, MODEL_OPS)."""
    for op, short in ALL_OPS.items():
        if name in (op, short):
            return op
    raise argparse.ArgumentTypeError(f"unknown op {name!r}; choose from {_op_list()}")


def make_cases(ops, shapes, batches, device_type: str) -> list[Case]:
    """shapes: parse_shape results, or None for each op's default shapes. Model ops (MODEL_OPS) have
    no shape (MNIST-sized images): shapes do not apply to them, batches (else MODEL_BATCHES) do."""
    cases = []
    for op in ops:
        if op in MODEL_OPS:
            for B in batches or MODEL_BATCHES[device_type]:
                cases.append(Case(op, MODEL_SHAPE_NAME, B, 0, 0, 0, 0))
            continue
        if shapes is None:
            names = DEFAULT_SHAPES["em" if op in EM_OPS else device_type]
            op_shapes = [parse_shape(name) for name in names]
        else:
            op_shapes = shapes
        for name, dims in op_shapes:
            if op == "em_routing_pose" and dims["D"] != 16:
                raise argparse.ArgumentTypeError(f"em_routing_pose needs 4x4 poses (H = 16), got shape {name}")
            bs = batches or DEFAULT_BATCHES[device_type].get(name if name in SHAPES else None)
            for B in bs:
                cases.append(Case(op, name, B, **dims))
    return cases


def make_inputs(op: str, case: Case, dtype: torch.dtype, device, seed: int = 0):
    """Fresh random inputs (never zeros): (tuple of leaf tensors requiring grad, grad_v)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0, cast=True):
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).mul_(std)
        return x.to(dtype) if cast else x

    if op == "dynamic_routing":
        inputs = (randn(case.B, case.I, case.J, case.D, std=VOTE_STD),)
    elif op == "dense_capsules":
        u = reference.squash(randn(case.B, case.I, case.Din, cast=False)).to(dtype)
        inputs = (u, randn(case.I, case.J, case.D, case.Din, std=WEIGHT_STD))
    elif op in EM_OPS:
        activations = (torch.rand(case.B, case.I, generator=gen, device=device).to(dtype),
                       randn(case.J, std=0.5), randn(case.J, std=0.5))  # a_in, beta_u, beta_a
        if op == "em_routing":
            inputs = (randn(case.B, case.I, case.J, case.D),) + activations
        else:
            inputs = (randn(case.B, case.I, 4, 4), randn(case.I, case.J, 4, 4, std=0.5)) + activations
    else:
        raise ValueError(f"unknown op {op!r}")
    for t in inputs:
        t.requires_grad_(True)
    if op in EM_OPS:  # gradients of (pose, a_out)
        return inputs, (randn(case.B, case.J, case.D), randn(case.B, case.J))
    return inputs, randn(case.B, case.J, case.D)


def get_impl(op: str, impl: str) -> Callable:
    """The function to time, called as fn(*inputs, iters). 'compiled' gives a fresh torch.compile wrapper."""
    if impl == "capsroute":
        return getattr(capsroute, op)
    if impl == "eager":
        return getattr(reference, op)
    if impl == "compiled":
        return torch.compile(getattr(reference, op))
    raise ValueError(f"unknown impl {impl!r}")


def capsroute_supports(op: str, device: torch.device) -> bool:
    key = "CUDA" if device.type == "cuda" else "CPU"
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", key))
    except Exception:
        return True  # can't tell: try it


# ----------------------------------------------------------------------------- steps and timers

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


def time_samples(step: Callable, device: torch.device, *, repeats: int, before: Callable | None = None,
                 min_repeats: int = 3, max_seconds: float = float("inf")) -> list[float]:
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
    from torch.profiler import ProfilerActivity, profile
    from torch._C._profiler import _EventType

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = step()
    del out
    tree = prof.profiler.kineto_results.experimental_event_tree()
    allocs = sorted((n for n in _walk(tree) if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    live = peak = 0
    for n in allocs:
        live += n.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


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


def estimated_bytes(case: Case, impl: str, itemsize: int) -> int:
    """Rough upper estimate of what one fwd+bwd needs (inputs, grads, working set): used on CPU only,
    to skip a case rather than meet the OOM killer (CUDA raises OutOfMemoryError, which is caught)."""
    votes = case.B * case.I * case.J * case.D * itemsize
    if case.op in ("dynamic_routing", "em_routing"):
        inputs = votes
    else:
        inputs = (case.B * case.I * case.Din + case.I * case.J * case.D * case.Din) * itemsize
    if impl == "capsroute":  # dense never materialises votes; its backward keeps a few weight-sized buffers
        work = votes // 2 if case.op == "dynamic_routing" else 6 * case.I * case.J * case.D * case.Din * itemsize
    else:
        work = 8 * votes
    return 2 * inputs + work


# ----------------------------------------------------------------------------- the floor

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


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 10) -> float:
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
    times = time_samples(lambda: torch.mm(a, b), device, repeats=repeats,
                         max_seconds=5.0 if device.type == "cuda" else 3.0)
    return 2 * n ** 3 / (min(times) / 1e3) / 1e12


def floor_model(case: Case, itemsize: int, iters: int) -> dict:
    """Bytes that must move and flops that must be done (see the module docstring)."""
    B, I, J, D, Din = case.B, case.I, case.J, case.D, case.Din
    route = 2 * I * J * D * (2 * iters - 1)
    out = B * J * D * itemsize
    if case.op in EM_OPS:
        # per iteration: the mean (2 I J H) and variance (3 I J H) of the M-step, and but for the
        # last, the E-step's log densities (4 I J H); pose @ weight adds 2 * 64 per (i, j).
        em = I * J * D * (5 * iters + 4 * (iters - 1))
        if case.op == "em_routing":
            inp, flops_fwd = (B * I * J * D + B * I) * itemsize, B * em
        else:
            inp, flops_fwd = (B * I * 16 + I * J * 16 + B * I) * itemsize, B * (128 * I * J + em)
        out = B * J * (D + 1) * itemsize
    elif case.op == "dynamic_routing":
        inp = B * I * J * D * itemsize
        flops_fwd = B * route
    else:
        inp = (B * I * Din + I * J * D * Din) * itemsize
        flops_fwd = B * (2 * I * J * D * Din + route)
    return {"bytes_fwd": inp + out, "flops_fwd": flops_fwd,
            "bytes_fwd_bwd": inp + out + out + inp,  # + read grad_v, write input grads
            "flops_fwd_bwd": 3 * flops_fwd}


def floor_ms(nbytes: float, flops: float, bandwidth_gbs: float, peak_tflops: float) -> float:
    return max(nbytes / (bandwidth_gbs * 1e9), flops / (peak_tflops * 1e12)) * 1e3


# ----------------------------------------------------------------------------- one case

def _snapshot(v, inputs, max_elems: int = 1 << 20) -> dict:
    """Small copies of v and (strided samples of) the input grads, to check impls agree."""
    snap = {"v": v.detach().flatten()[:: max(1, v.numel() // max_elems)].to(torch.float64, copy=True)}
    for k, t in enumerate(inputs):
        if t.grad is not None:
            g = t.grad.flatten()
            snap[f"grad{k}"] = g[:: max(1, g.numel() // max_elems)].to(torch.float64, copy=True)
    return snap


def _max_rel_err(snap: dict, ref: dict) -> float | None:
    errs = []
    for k, r in ref.items():
        if k in snap and snap[k].shape == r.shape:
            errs.append(((snap[k] - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    return max(errs) if errs else None


def _dynamo_stats() -> dict:
    """What torch.compile did for the case: graphs, graph breaks, and whether inductor's on-disk cache
    served it (a warm cache makes compile_s much smaller than a cold compile)."""
    try:
        from torch._dynamo.utils import counters
        hits = counters["inductor"].get("fxgraph_cache_hit", 0) + counters["aot_autograd"].get("autograd_cache_hit", 0)
        return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values())),
                "compile_cache": "hit" if hits else "miss"}
    except Exception:  # noqa: BLE001  (private API: optional)
        return {}


def eager_first(impls) -> list[str]:
    """The impls in measuring order: eager first, its values being the reference the others are checked against."""
    return sorted(impls, key=("eager", "capsroute", "compiled").index)


def _reset_dynamo() -> None:
    """A fresh torch.compile state, so compile time and graph counts are this impl's own."""
    torch._dynamo.reset()
    try:
        from torch._dynamo.utils import counters
        counters.clear()
    except Exception:  # noqa: BLE001  (private API: optional)
        pass


def bench_impl(case: Case, impl: str, inputs, grad, *, iters: int, device: torch.device, repeats: int,
               warmup: int, max_seconds: float, inference: bool, ref_snap: dict | None) -> tuple[dict, dict | None]:
    """Measures one implementation on one case; returns (partial record, snapshot for checks)."""
    rec: dict = {}
    if impl == "compiled":
        _reset_dynamo()
    fn = get_impl(case.op, impl)
    fwd = fwd_step(fn, inputs, iters)
    fwd_bwd = fwd_bwd_step(fn, inputs, grad, iters)
    before = lambda: clear_grads(inputs)  # noqa: E731

    # Warm-up; the first call compiles (compiled) and gives the values checked against eager.
    before()
    t0 = time.perf_counter()
    v = fwd_bwd()
    synchronize(device)
    first_s = time.perf_counter() - t0
    snap = _snapshot(v, inputs)
    del v
    if impl == "compiled":
        rec["compile_s"] = round(first_s, 3)
        rec.update(_dynamo_stats())
    if ref_snap is not None and impl != "eager":
        rec["max_rel_err"] = _max_rel_err(snap, ref_snap)
    for _ in range(max(0, warmup - 1)):
        before()
        del_me = fwd_bwd()
        del del_me
    for _ in range(max(1, warmup)):
        del_me = fwd()
        del del_me
    clear_grads(inputs)

    _time_steps(rec, fwd, fwd_bwd, before, device, repeats, max_seconds)
    clear_grads(inputs)
    if inference:
        _time_inference(rec, fwd, impl, device, warmup, repeats, max_seconds)
    return rec, snap


def _time_steps(rec: dict, fwd: Callable, fwd_bwd: Callable, before: Callable, device: torch.device, repeats: int,
                max_seconds: float) -> None:
    """Median and min times of fwd() and of fwd_bwd(), and the peak memory of fwd_bwd(), into rec."""
    ft = time_samples(fwd, device, repeats=repeats, max_seconds=max_seconds)
    rec["fwd_ms"] = statistics.median(ft)
    rec["fwd_ms_min"] = min(ft)
    bt = time_samples(fwd_bwd, device, repeats=repeats, before=before, max_seconds=max_seconds)
    rec["fwd_bwd_ms"] = statistics.median(bt)
    rec["fwd_bwd_ms_min"] = min(bt)
    rec["repeats"] = [len(ft), len(bt)]
    rec["peak_mb"] = peak_memory_mb(fwd_bwd, device, before)


def _time_inference(rec: dict, fwd: Callable, impl: str, device: torch.device, warmup: int, repeats: int,
                    max_seconds: float) -> None:
    """fwd() under no_grad (compiled: a second graph, its compile time recorded): fwd_infer_ms."""
    with torch.no_grad():
        t0 = time.perf_counter()
        del_me = fwd()
        synchronize(device)
        if impl == "compiled":
            rec["compile_infer_s"] = round(time.perf_counter() - t0, 3)
        del del_me
        for _ in range(max(1, warmup)):
            del_me = fwd()
            del del_me
        it = time_samples(fwd, device, repeats=repeats, max_seconds=max_seconds)
    rec["fwd_infer_ms"] = statistics.median(it)


def bench_case(case: Case, impls, *, dtype: torch.dtype, iters: int, device: torch.device, repeats: int,
               warmup: int, max_seconds: float, inference: bool, bandwidth_gbs: float, peak_tflops: float,
               seed: int = 0, note: Callable[[str], None] = print, progress=None) -> list[dict]:
    """All implementations on one case: a list of records (skipped ones carry 'skipped': reason)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    fm = floor_model(case, itemsize, iters)
    f_fwd = floor_ms(fm["bytes_fwd"], fm["flops_fwd"], bandwidth_gbs, peak_tflops)
    f_all = floor_ms(fm["bytes_fwd_bwd"], fm["flops_fwd_bwd"], bandwidth_gbs, peak_tflops)
    bound = "memory" if fm["bytes_fwd_bwd"] / (bandwidth_gbs * 1e9) >= fm["flops_fwd_bwd"] / (peak_tflops * 1e12) \
        else "compute"

    def base(impl):
        return {"op": case.op, "shape": case.shape(), "dtype": str(dtype).replace("torch.", ""), "impl": impl,
                "fwd_ms": None, "fwd_bwd_ms": None, "peak_mb": None, "floor_ms": f_all,
                "shape_name": case.shape_name, "iters": iters, "floor_fwd_ms": f_fwd, "floor_bound": bound,
                **fm}

    def measure(impl, inputs, ref_snap):
        try:
            return bench_impl(case, impl, *inputs, iters=iters, device=device, repeats=repeats, warmup=warmup,
                              max_seconds=max_seconds, inference=inference, ref_snap=ref_snap)
        finally:
            clear_grads(inputs[0])

    unavailable = {} if capsroute_supports(case.op, device) else {"capsroute": _no_kernel(device, [case.op])}
    records = _bench_impls(case, impls, device, base=base, estimate=lambda impl: estimated_bytes(case, impl, itemsize),
                           make_inputs=lambda: make_inputs(case.op, case, dtype, device, seed), unavailable=unavailable,
                           measure=measure, note=note, progress=progress)
    for r in records:
        if "skipped" not in r:
            r["floor_x"] = r["fwd_bwd_ms"] / f_all if f_all > 0 else None
            r["floor_fwd_x"] = r["fwd_ms"] / f_fwd if f_fwd > 0 else None
    return records


def _bench_impls(case: Case, impls, device: torch.device, *, base: Callable[[str], dict],
                 estimate: Callable[[str], int], make_inputs: Callable[[], object], unavailable: dict[str, str],
                 measure: Callable, note: Callable[[str], None], progress) -> list[dict]:
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
                too_big[impl] = f"estimated {need / 2**30:.1f} GiB > 80% of the {avail / 2**30:.1f} GiB available"
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
            failure = _failure(e)
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
    _add_ratios(records)
    records.sort(key=lambda r: IMPLS.index(r["impl"]))
    return records


def _no_kernel(device: torch.device, ops) -> str:
    return f"capsroute has no {device.type.upper()} kernel for {'/'.join(ops)} in this build"


def _failure(e: BaseException) -> str:
    """The 'skipped' reason for an exception raised while measuring."""
    if is_oom(e):
        return "out of memory"
    return f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def _add_ratios(records: list[dict]):
    """vs_capsroute on each other impl's record, and the same numbers as 'ratios' on capsroute's."""
    caps = next((r for r in records if r["impl"] == "capsroute" and "skipped" not in r), None)
    if caps is not None:
        ratios = {}
        for r in records:
            if r["impl"] == "capsroute" or "skipped" in r:
                continue
            vs = {k: (r[k] / caps[k] if caps[k] else None) for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb")}
            r["vs_capsroute"] = {"fwd": vs["fwd_ms"], "fwd_bwd": vs["fwd_bwd_ms"], "peak_mb": vs["peak_mb"]}
            ratios.update({f"{r['impl']}_fwd": vs["fwd_ms"], f"{r['impl']}_fwd_bwd": vs["fwd_bwd_ms"],
                           f"{r['impl']}_peak_mb": vs["peak_mb"]})
        caps["ratios"] = ratios


# ----------------------------------------------------------------------------- model ops: a training step

def _model_precision(dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype of the parameters and images, autocast dtype or None): float32 / float64 train in that
    dtype; float16 / bfloat16 train float32 parameters under torch.autocast, as `capsroute train --amp`
    (without a GradScaler)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32, dtype
    return dtype, None


def _autocast(device: torch.device, amp: torch.dtype | None):
    return torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()


def make_model(op: str, *, iters: int = 3, seed: int = 0) -> torch.nn.Module:
    """The model of a model op (fused backend, training mode), initialised from `seed` on the CPU, so
    every impl and device starts from the same weights; the global RNG is left as it was."""
    from capsroute.models import MODELS

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MODELS[op](iters=iters, backend="fused")
    return model.train()


def make_model_inputs(B: int, device, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images in [0, 1) of shape (B, 1, 28, 28) and random labels in [0, 10)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    images = torch.rand(B, *MODEL_IMAGE, generator=gen, device=device).to(_model_precision(dtype)[0])
    labels = torch.randint(0, 10, (B,), generator=gen, device=device)
    return images, labels


def get_model_impl(base: torch.nn.Module, impl: str, device: torch.device, dtype: torch.dtype):
    """(model, fn, optimizer) for one impl: a copy of `base` (same weights) on the device with the impl's
    routing backend (MODEL_BACKENDS); fn is the model, or for 'compiled' torch.compile(model) (the whole
    forward, default mode); Adam over the model's parameters."""
    model = copy.deepcopy(base).to(device=device, dtype=_model_precision(dtype)[0])
    set_backend(model, MODEL_BACKENDS[impl])
    model.train()
    fn = torch.compile(model) if impl == "compiled" else model
    return model, fn, torch.optim.Adam(model.parameters(), lr=MODEL_LR)


def model_fwd_step(fn, images, labels, device: torch.device, amp=None):
    def step():
        with _autocast(device, amp):
            return fn(images, labels)
    return step


def train_step(fn, optimizer, images, labels, device: torch.device, amp=None):
    """One training step: forward, loss, backward, optimizer.step(); returns the loss (detached).
    Gradients are reset (optimizer.zero_grad(set_to_none=True)) before each call, outside the clock."""
    def step():
        with _autocast(device, amp):
            out = fn(images, labels)
            loss = training_loss(out, images, labels, SPREAD_MARGIN)
        loss.backward()
        optimizer.step()
        return loss.detach()
    return step


def model_supported(op: str, device: torch.device) -> bool:
    return all(capsroute_supports(k, device) for k in MODEL_KERNELS[op])


def compile_crash(op: str, device: torch.device, version: str = torch.__version__) -> str | None:
    """Why the compiled impl of a model op is not run here, where torch.compile is known to crash
    the whole process (so the run would lose every result), else None."""
    if op == "matrixcapsnet" and device.type == "cpu" and torch.torch_version.TorchVersion(version) < "2.14":
        return (f"torch.compile of the MatrixCapsNet step crashes on the CPU with torch {version} (a double free "
                "in inductor's generated C++, seen with 2.11 and 2.13; 2.14.1 runs it)")
    return None


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# Generous estimates of a training step's working set per image (float32; the CPU guard only): 1.5-5x the
# peaks measured on the CPU at B=8 and 64 (CapsNet ~2.5 MiB eager, ~0.7 fused; MatrixCapsNet ~38 eager,
# ~32 compiled, ~0.9 fused).
PER_IMAGE_MB = {
    ("capsnet", "capsroute"): 4, ("capsnet", "eager"): 12, ("capsnet", "compiled"): 12,
    ("matrixcapsnet", "capsroute"): 4, ("matrixcapsnet", "eager"): 60, ("matrixcapsnet", "compiled"): 60,
}


def model_estimated_bytes(case: Case, impl: str, itemsize: int, params: int) -> int:
    """Rough upper estimate of one training step's memory: parameters, gradients, Adam's two moments
    (4 copies of the parameters) and the working set (PER_IMAGE_MB per image)."""
    scale = max(itemsize, 4) / 4
    return int((4 * params * 4 + case.B * PER_IMAGE_MB[case.op, impl] * MiB) * scale)


def bench_model_impl(case: Case, impl: str, base: torch.nn.Module, images, labels, *, dtype: torch.dtype,
                     device: torch.device, repeats: int, warmup: int, max_seconds: float, inference: bool,
                     ref_snap: dict | None) -> tuple[dict, dict]:
    """Measures one impl of a model op at one batch size; returns (partial record, snapshot for checks).

    The first two training steps are warm-up calls whose losses (before and after one Adam step) and
    first-step parameter gradients are the snapshot compared with eager's."""
    rec: dict = {}
    if impl == "compiled":
        _reset_dynamo()
    amp = _model_precision(dtype)[1]
    model, fn, optimizer = get_model_impl(base, impl, device, dtype)
    fwd = model_fwd_step(fn, images, labels, device, amp)
    step = train_step(fn, optimizer, images, labels, device, amp)
    before = lambda: optimizer.zero_grad(set_to_none=True)  # noqa: E731

    before()
    t0 = time.perf_counter()
    loss0 = step()
    synchronize(device)
    first_s = time.perf_counter() - t0
    snap = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.flatten()
            snap[f"grad:{name}"] = g[:: max(1, g.numel() // (1 << 20))].to(torch.float64, copy=True)
    before()
    loss1 = step()
    losses = [loss0.item(), loss1.item()]
    del loss0, loss1
    snap["loss"] = torch.tensor(losses, dtype=torch.float64)
    rec["losses"] = losses
    if impl == "compiled":
        rec["compile_s"] = round(first_s, 3)
        rec.update(_dynamo_stats())
    if ref_snap is not None and impl != "eager":
        rec["max_rel_err"] = _max_rel_err(snap, ref_snap)
        rec["loss_rel_err"] = _max_rel_err({"loss": snap["loss"]}, {"loss": ref_snap["loss"]})
        rec["grad_rel_err"] = _max_rel_err({k: v for k, v in snap.items() if k != "loss"},
                                           {k: v for k, v in ref_snap.items() if k != "loss"})
    for _ in range(max(0, warmup - 2)):
        before()
        del_me = step()
        del del_me
    for _ in range(max(1, warmup)):
        del_me = fwd()
        del del_me
    before()

    _time_steps(rec, fwd, step, before, device, repeats, max_seconds)
    rec["images_per_s"] = case.B / (rec["fwd_bwd_ms"] / 1e3) if rec["fwd_bwd_ms"] > 0 else None
    before()
    # what is allocated before a step (and so not in peak_mb): parameters, Adam state, images and labels
    state = [t for st in optimizer.state.values() for t in st.values()]
    rec["state_mb"] = (_tensor_bytes(model.parameters()) + _tensor_bytes(state) + _tensor_bytes((images, labels))) / MiB
    if inference:
        model.eval()
        try:
            _time_inference(rec, fwd, impl, device, warmup, repeats, max_seconds)
        finally:
            model.train()
    return rec, snap


def bench_model_case(case: Case, impls, *, dtype: torch.dtype, iters: int, device: torch.device, repeats: int,
                     warmup: int, max_seconds: float, inference: bool, seed: int = 0,
                     note: Callable[[str], None] = print, progress=None) -> list[dict]:
    """All implementations of a model op at one batch size (bench_case for a whole training step)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    base_model = make_model(case.op, iters=iters, seed=seed)
    params = sum(p.numel() for p in base_model.parameters())
    amp = _model_precision(dtype)[1]

    def base(impl):
        return {"op": case.op, "shape": case.shape(), "dtype": str(dtype).replace("torch.", ""), "impl": impl,
                "fwd_ms": None, "fwd_bwd_ms": None, "peak_mb": None, "floor_ms": None,
                "shape_name": case.shape_name, "iters": iters, "floor_fwd_ms": None, "floor_x": None,
                "floor_fwd_x": None, "params": params,
                "optimizer": "Adam", "amp": None if amp is None else str(amp).replace("torch.", "")}

    def measure(impl, inputs, ref_snap):
        return bench_model_impl(case, impl, base_model, *inputs, dtype=dtype, device=device, repeats=repeats,
                                warmup=warmup, max_seconds=max_seconds, inference=inference, ref_snap=ref_snap)

    unavailable = {}
    if not model_supported(case.op, device):
        unavailable["capsroute"] = _no_kernel(device, MODEL_KERNELS[case.op])
    if (crash := compile_crash(case.op, device)) is not None:
        unavailable["compiled"] = crash
    return _bench_impls(case, impls, device, base=base,
                        estimate=lambda impl: model_estimated_bytes(case, impl, itemsize, params),
                        make_inputs=lambda: make_model_inputs(case.B, device, dtype, seed), unavailable=unavailable,
                        measure=measure, note=note, progress=progress)


def find_max_batch(step: Callable[[int], object], cap: int = MAX_BATCH_CAP, *,
                   free: Callable[[], None] = lambda: None) -> tuple[int | None, list[tuple[int, bool]]]:
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


def model_max_batch(op: str, impl: str, *, device: torch.device, dtype: torch.dtype, iters: int = 3, seed: int = 0,
                    cap: int = MAX_BATCH_CAP) -> dict:
    """find_max_batch for one training step (fresh Adam state each try, so its memory counts) of one
    impl of a model op. For 'compiled' one torch.compile wrapper serves every try (torch recompiles
    with a dynamic batch size after the second size, as it would for a training loop that changes it)."""
    if impl == "compiled":
        torch._dynamo.reset()
    amp = _model_precision(dtype)[1]
    model, fn, _ = get_model_impl(make_model(op, iters=iters, seed=seed), impl, device, dtype)

    def step(b):
        try:
            images, labels = make_model_inputs(b, device, dtype, seed)
            optimizer = torch.optim.Adam(model.parameters(), lr=MODEL_LR)
            train_step(fn, optimizer, images, labels, device, amp)()
            synchronize(device)
        finally:
            model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    try:
        best, tries = find_max_batch(step, cap, free=lambda: free_memory(device))
    finally:
        del model, fn
        free_memory(device)
    return {"op": op, "impl": impl, "dtype": str(dtype).replace("torch.", ""), "max_batch": best, "cap": cap,
            "capped": bool(tries and tries[-1][1]),  # every try fitted: the largest may be above the cap
            "tries": [b for b, _ in tries], "search_s": round(time.perf_counter() - t0, 1)}


# ----------------------------------------------------------------------------- the run and the report

def _git(*args, cwd=None) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str:
    """HEAD of the checkout capsroute is imported from, + "-dirty" when tracked files differ from it;
    "unknown" when capsroute is not imported from a checkout (a non-editable install)."""
    root = Path(capsroute.__file__).resolve().parent.parent
    if _git("rev-parse", "--show-toplevel", cwd=root) != str(root):
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=root)
    return _git("rev-parse", "HEAD", cwd=root) + ("-dirty" if dirty else "")


def short_commit(commit: str) -> str:
    """git_commit()'s value for titles: 7 hex digits, keeping "-dirty"."""
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def default_out() -> Path:
    """bench/results/ of the capsroute checkout the current directory is in, else ./bench-results."""
    top = _git("rev-parse", "--show-toplevel")
    if top and (Path(top) / "capsroute" / "bench.py").is_file():
        return Path(top) / "bench" / "results"
    return Path("bench-results")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def run_benchmarks(cases: list[Case], impls=IMPLS, *, device: torch.device, dtype=torch.float32, iters: int = 3,
                   repeats: int = 10, warmup: int = 2, max_seconds: float = 10.0, inference: bool = False,
                   seed: int = 0, progress: bool = True, on_case: Callable[[dict], None] | None = None,
                   max_batch: int | None = None) -> dict:
    """Runs the cases and returns the report (the JSON document). on_case(report) is called after each case.
    max_batch (CUDA, model ops): after the cases, search each model op's and impl's largest power-of-two
    batch up to this cap (model_max_batch) into report["max_batch"] and each matching record's "max_batch"."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional for library use
        tqdm = None
    bar = tqdm(total=len(cases), disable=not progress, file=sys.stderr, unit="case") if tqdm else None
    note = (bar.write if bar is not None else print)

    load = _loadavg()  # before this process adds its own
    bandwidth = peak = None
    if any(case.op not in MODEL_OPS for case in cases):  # model ops have no floor
        if bar is not None:
            bar.set_postfix_str("measuring the floor")
        bandwidth = measure_bandwidth(device)
        peak = measure_peak_tflops(device, dtype)
    report = {
        "kind": "bench", "device": device_name(device), "torch": torch.__version__, "commit": git_commit(),
        "date": datetime.date.today().isoformat(), "results": [],
        "complete": False, "dtype": str(dtype).replace("torch.", ""), "iters": iters,
        "threads": torch.get_num_threads(), "cpu": cpu_model(), "cuda": torch.version.cuda,
        "python": platform.python_version(), "capsroute": _build_info(),
        "bandwidth_gbs": bandwidth, "peak_tflops": peak,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "repeats": repeats, "warmup": warmup, "max_seconds": max_seconds, "seed": seed,
        "command": " ".join(sys.argv), "notes": [],
    }

    def record_note(msg):
        report["notes"].append(msg)
        note(msg)

    report["loadavg_start"] = load
    if device.type == "cpu" and load is not None and load > (os.cpu_count() or 1):
        record_note(f"load average {load:.1f} > {os.cpu_count()} cores at the start: other processes compete for "
                    f"the CPU; timings are unreliable, and biased against eager/compiled (many short parallel "
                    f"regions suffer most from oversubscription). Try --threads 1 or an idle machine.")
    model_ops = list(dict.fromkeys(case.op for case in cases if case.op in MODEL_OPS))
    if max_batch is not None:
        if device.type != "cuda":
            record_note(f"--max-batch is CUDA-only (it searches for the largest batch that fits in GPU memory); "
                        f"not run on {device.type}")
            max_batch = None
        elif not model_ops:
            record_note("--max-batch applies to the model ops (capsnet, matrixcapsnet) only; none was asked for")
            max_batch = None
    for n, case in enumerate(cases):
        if case.op in MODEL_OPS:
            # one seed per model op (not per case): every batch size trains the same initial weights
            recs = bench_model_case(case, impls, dtype=dtype, iters=iters, device=device, repeats=repeats,
                                    warmup=warmup, max_seconds=max_seconds, inference=inference,
                                    seed=seed, note=record_note, progress=bar)
        else:
            recs = bench_case(case, impls, dtype=dtype, iters=iters, device=device, repeats=repeats, warmup=warmup,
                              max_seconds=max_seconds, inference=inference, bandwidth_gbs=bandwidth,
                              peak_tflops=peak, seed=seed + n, note=record_note, progress=bar)
        for r in recs:
            err = r.get("max_rel_err")
            tol = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
            if case.op in MODEL_OPS:  # a whole network (three stacked EM layers) amplifies rounding differences
                tol *= MODEL_TOL_FACTOR
            if err is not None and err > tol:
                what = "loss / gradients differ" if case.op in MODEL_OPS else "differs"
                record_note(f"WARNING {case.label()} {r['impl']}: {what} from eager by {err:.2e} (relative)")
        report["results"].extend(recs)
        if bar is not None:
            bar.update(1)
        if on_case is not None:
            on_case(report)
    if max_batch is not None:
        add_max_batches(report, model_ops, impls, device=device, dtype=dtype, iters=iters, seed=seed, cap=max_batch,
                        note=record_note, progress=bar, on_case=on_case)
    if bar is not None:
        bar.close()
    report["loadavg_end"] = _loadavg()
    report["complete"] = True
    return report


def add_max_batches(report: dict, ops, impls, *, device: torch.device, dtype: torch.dtype, iters: int, seed: int,
                    cap: int, note: Callable[[str], None] = print, progress=None,
                    on_case: Callable[[dict], None] | None = None):
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
                found = model_max_batch(op, impl, device=device, dtype=dtype, iters=iters, seed=seed, cap=cap)
            except Exception as e:  # noqa: BLE001  (an error other than OOM: OOMs are the search)
                found = {"op": op, "impl": impl, "dtype": str(dtype).replace("torch.", ""), "max_batch": None,
                         "cap": cap, "error": _failure(e)}
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


def _fmt(x, spec=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _fmt_ms(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _fmt_max_batch(r: dict) -> str:
    if "max_batch" not in r:
        return "-"
    if r["max_batch"] is None:
        return "none"
    return f"{r['max_batch']}" + ("+" if r.get("max_batch_capped") else "")


def format_table(report: dict) -> str:
    """One row per op / shape / B / impl. 'vs caps' columns: this impl's time or memory / capsroute's.
    Runs with model ops add an img/s column (images per second of a training step), runs with
    --max-batch a max B column ('+': every batch up to the cap fitted)."""
    results = report["results"]
    models = any(r["op"] in MODEL_OPS for r in results)
    max_batch = any("max_batch" in r for r in results)
    head = ["op", "shape", "B", "impl", "fwd ms", "f+b ms", "peak MiB", "floor ms", "x floor",
            "fwd vs caps", "f+b vs caps", "mem vs caps", "compile s", "rel err"]
    head += ["img/s"] * models + ["max B"] * max_batch
    rows = []
    for r in report["results"]:
        s = r["shape"]
        shape = r.get("shape_name") or f"{s['I']},{s['J']},{s['D']}"
        row = [r["op"], shape, str(s["B"]), r["impl"]]
        if "skipped" in r:
            rows.append(row + [f"skipped: {r['skipped']}"])
            continue
        vs = r.get("vs_capsroute", {})
        peak = r["peak_mb"]
        row += [_fmt_ms(r["fwd_ms"]), _fmt_ms(r["fwd_bwd_ms"]), _fmt(peak, ".3f" if peak is not None and peak < 1 else ".1f"),
                _fmt_ms(r["floor_ms"]), _fmt(r.get("floor_x"), ".1f"),
                *(_fmt(vs.get(k), ".2f") + ("x" if vs.get(k) is not None else "") for k in ("fwd", "fwd_bwd", "peak_mb")),
                _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("max_rel_err"), ".0e")]
        if models:
            ips = r.get("images_per_s")
            row.append(_fmt(ips, ".1f" if ips is not None and ips < 100 else ".0f"))
        if max_batch:
            row.append(_fmt_max_batch(r))
        rows.append(row)
    # skipped rows (4 cells + the reason) size only the first 4 columns
    widths = [max([len(head[k])] + [len(row[k]) for row in rows if k < 4 or len(row) == len(head)])
              for k in range(len(head))]
    right = set(range(2, len(head)))

    def line(cells):
        out = []
        for k, c in enumerate(cells):
            if len(cells) != len(head) and k == len(cells) - 1 and k >= 4:
                out.append(c)
            else:
                out.append(c.rjust(widths[k]) if k in right else c.ljust(widths[k]))
        return "  ".join(out).rstrip()

    title = (f"device {report['device']}  torch {report['torch']}  commit {report['commit'][:12]}  "
             f"dtype {report['dtype']}  iters {report['iters']}  threads {report['threads']}"
             + (f"  load {report['loadavg_start']:.1f}" if report.get("loadavg_start") is not None else ""))
    if report.get("bandwidth_gbs") is not None:
        title += (f"\nfloor: copy bandwidth {report['bandwidth_gbs']:.1f} GB/s, matmul peak "
                  f"{report['peak_tflops']:.2f} TFLOP/s; floor ms and x floor are for forward+backward")
    if models:
        title += ("\nmodel ops (capsnet, matrixcapsnet): f+b ms is a whole training step (forward, loss, backward, "
                  "Adam step), img/s = B / f+b; no floor; rel err compares losses and gradients with eager")
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(head), sep] + [line(r) for r in rows])


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def report_path(report: dict, out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.suffix == ".json":
        return out
    sha = report["commit"]
    short = sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")
    return out / f"{slug(report['device'])}-{report['date']}-{short}.json"


def unique_path(path: Path) -> Path:
    if not path.exists():
        return path
    for k in range(1, 1000):
        p = path.with_name(f"{path.stem}-{k}{path.suffix}")
        if not p.exists():
            return p
    return path


def write_report(report: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)
    return path


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_arguments(p: argparse.ArgumentParser):
    """The options of `capsroute bench`."""
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default: auto)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--op", nargs="+", type=op_name, default=list(OPS),
                   help=f"ops to run, by name or short name: {_op_list()}; capsnet and matrixcapsnet time a whole "
                        "training step of the model (default: the four routing ops)")
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--shape", nargs="+", type=parse_shape, default=None, metavar="NAME|I,J,D[,Din]",
                   help=f"named shapes: {', '.join(SHAPES)} (for EM ops D is the pose size H); default: mnist on "
                        "CPU, mnist and large on CUDA for the dynamic-routing ops, em-class and em-conv for EM")
    p.add_argument("--batch", nargs="+", type=_positive, default=None,
                   help="batch sizes for every shape and model op (default: 32 on CPU (8 for large); 32 128 512 2048 "
                        "on CUDA; model ops: 16 on CPU, 32 128 512 on CUDA)")
    p.add_argument("--iters", type=_positive, default=3)
    p.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default: 10 CPU, 50 CUDA)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up calls (default: 2 CPU, 5 CUDA)")
    p.add_argument("--max-seconds", type=float, default=10.0,
                   help="stop a measurement after this long (at least 3 calls); default 10")
    p.add_argument("--no-compile", action="store_true", help="leave out the torch.compile baseline")
    p.add_argument("--max-batch", type=_positive, nargs="?", const=MAX_BATCH_CAP, default=None, metavar="CAP",
                   help="CUDA, model ops: also find the largest power-of-two batch (up to CAP, default "
                        f"{MAX_BATCH_CAP}) for which one training step of each impl fits in GPU memory")
    p.add_argument("--inference", action="store_true", help="also time the forward under torch.no_grad()")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None,
                   help="directory (file named <device>-<date>-<sha>.json) or a .json path (default: bench/results/ "
                        "of the capsroute checkout the current directory is in, else ./bench-results)")
    save = p.add_mutually_exclusive_group()
    save.add_argument("--no-save", action="store_true", help="print the table only")
    save.add_argument("--plot", action="store_true", help="also draw PNG figures next to the JSON (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    """`capsroute bench`: runs the cases, prints the table, writes the JSON (and with --plot the figures)."""
    if args.plot:
        from capsroute.plot import plot_report  # now rather than after the run if matplotlib is missing
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    impls = [i for i in args.impl if not (args.no_compile and i == "compiled")]
    shapes = args.shape  # None: each op's default shapes
    cases = make_cases(dict.fromkeys(args.op), shapes, args.batch, device.type)
    repeats = args.repeats or (50 if device.type == "cuda" else 10)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 2)

    path = None
    if not args.no_save:
        probe = {"device": device_name(device), "date": datetime.date.today().isoformat(), "commit": git_commit()}
        path = unique_path(report_path(probe, args.out or default_out()))
    save = (lambda rep: write_report(rep, path)) if path is not None else None
    report = run_benchmarks(cases, impls, device=device, dtype=dtype, iters=args.iters, repeats=repeats,
                            warmup=warmup, max_seconds=args.max_seconds, inference=args.inference,
                            seed=args.seed, progress=not args.no_progress, on_case=save, max_batch=args.max_batch)
    print(format_table(report))
    for msg in report["notes"]:
        print("note:", msg)
    if path is not None:
        write_report(report, path)
        print(f"wrote {path}")
    if args.plot:
        for png in plot_report(report, path):
            print(f"wrote {png}")
    errors = [r for r in report["results"] if str(r.get("skipped", "")).startswith("error")]
    return 1 if errors else 0
