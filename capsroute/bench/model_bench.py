"""The model ops' bench: a whole training step of CapsNet or MatrixCapsNet per implementation (fused
backend, reference backend eager, and compiled), and --max-batch, the largest batch whose training
step fits in GPU memory."""

from __future__ import annotations

import contextlib
import copy
import time
from typing import Callable

import torch

from .._utils.runinfo import dtype_name
from ..models import build_model
from ..nn import set_backend
from ..train.metrics import training_loss
from .cases import Case, capsroute_supports, no_kernel
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
from .timing import MiB, free_memory, synchronize, tensor_bytes

MODEL_IMAGE = (1, 28, 28)  # MNIST-sized images (C, H, W)
MODEL_BACKENDS = {"capsroute": "fused", "eager": "reference", "compiled": "reference"}
MODEL_KERNELS = {
    "capsnet": ("squash", "dense_capsules"),
    "matrixcapsnet": ("em_routing_pose", "em_routing"),
    "efficientcapsnet": ("dense_self_attention_routing",),
}
MODEL_ITERATIVE = ("capsnet", "matrixcapsnet")  # built with --iters (EfficientCapsNet routes once)
MODEL_LR = 1e-3  # as `capsroute train`
SPREAD_MARGIN = 0.2  # MatrixCapsNet's spread loss at the start of its margin schedule
MODEL_TOL_FACTOR = (
    10  # model ops warn at 10x the routing ops' max_rel_err tolerance (1e-2 for float32)
)


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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(op, "fused", {"iters": iters} if op in MODEL_ITERATIVE else {})
    return model.train()


def make_model_inputs(
    B: int, device, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images in [0, 1) of shape (B, 1, 28, 28) and random labels in [0, 10)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    images = torch.rand(B, *MODEL_IMAGE, generator=gen, device=device).to(
        _model_precision(dtype)[0]
    )
    labels = torch.randint(0, 10, (B,), generator=gen, device=device)
    return images, labels


def get_model_impl(base: torch.nn.Module, impl: str, device: torch.device, dtype: torch.dtype):
    """(model, fn, optimizer) for one impl: a copy of `base` (same weights) on the device with the impl's
    routing backend (MODEL_BACKENDS); fn is the model, or for 'compiled' torch.compile(model) (the whole
    forward, default mode); make_optimizer's Adam over the model's parameters."""
    model = copy.deepcopy(base).to(device=device, dtype=_model_precision(dtype)[0])
    set_backend(model, MODEL_BACKENDS[impl])
    model.train()
    fn = torch.compile(model) if impl == "compiled" else model
    return model, fn, make_optimizer(model)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Adam:
    """Adam as `capsroute train` makes it: fused, one pass over all the parameters."""
    return torch.optim.Adam(model.parameters(), lr=MODEL_LR, fused=True)


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


def model_unavailable(op: str, device: torch.device) -> dict[str, str]:
    """{impl: why it cannot run here}: capsroute without a kernel its model needs on the device;
    compiled where torch.compile is known to crash (compile_crash)."""
    why = {}
    if not all(capsroute_supports(k, device) for k in MODEL_KERNELS[op]):
        why["capsroute"] = no_kernel(device, MODEL_KERNELS[op])
    if (crash := compile_crash(op, device)) is not None:
        why["compiled"] = crash
    return why


def compile_crash(op: str, device: torch.device, version: str = torch.__version__) -> str | None:
    """Why the compiled impl of a model op is not run here, where torch.compile is known to crash
    the whole process (so the run would lose every result), else None."""
    if (
        op == "matrixcapsnet"
        and device.type == "cpu"
        and torch.torch_version.TorchVersion(version) < "2.14"
    ):
        return (
            f"torch.compile of the MatrixCapsNet step crashes on the CPU with torch {version} (a double free "
            "in inductor's generated C++, seen with 2.11 and 2.13; 2.14.1 runs it)"
        )
    return None


# Generous estimates of a training step's working set per image (float32; the CPU guard only): 1.5-5x the
# peaks measured on the CPU at B=8 and 64 (CapsNet ~2.5 MiB eager, ~0.7 fused; MatrixCapsNet ~38 eager,
# ~32 compiled, ~0.9 fused; EfficientCapsNet ~0.9 either backend).
PER_IMAGE_MB = {
    ("capsnet", "capsroute"): 4,
    ("capsnet", "eager"): 12,
    ("capsnet", "compiled"): 12,
    ("matrixcapsnet", "capsroute"): 4,
    ("matrixcapsnet", "eager"): 60,
    ("matrixcapsnet", "compiled"): 60,
    ("efficientcapsnet", "capsroute"): 4,
    ("efficientcapsnet", "eager"): 4,
    ("efficientcapsnet", "compiled"): 4,
}


def model_estimated_bytes(case: Case, impl: str, itemsize: int, params: int) -> int:
    """Rough upper estimate of one training step's memory: parameters, gradients, Adam's two moments
    (4 copies of the parameters) and the working set (PER_IMAGE_MB per image)."""
    scale = max(itemsize, 4) / 4
    return int((4 * params * 4 + case.B * PER_IMAGE_MB[case.op, impl] * MiB) * scale)


def bench_model_impl(
    case: Case,
    impl: str,
    base: torch.nn.Module,
    images,
    labels,
    *,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int,
    warmup: int,
    max_seconds: float,
    inference: bool,
    ref_snap: dict | None,
) -> tuple[dict, dict]:
    """Measures one impl of a model op at one batch size; returns (partial record, snapshot for checks).

    The first two training steps are warm-up calls whose losses (before and after one Adam step) and
    first-step parameter gradients are the snapshot compared with eager's."""
    if impl == "compiled":
        reset_dynamo()
    amp = _model_precision(dtype)[1]
    model, fn, optimizer = get_model_impl(base, impl, device, dtype)
    fwd = model_fwd_step(fn, images, labels, device, amp)
    step = train_step(fn, optimizer, images, labels, device, amp)
    before = lambda: optimizer.zero_grad(set_to_none=True)  # noqa: E731

    loss0, compile_info = first_call(step, before, impl, device)
    snap = {
        f"grad:{name}": sample(p.grad) for name, p in model.named_parameters() if p.grad is not None
    }
    before()
    losses = [loss0.item(), step().item()]
    del loss0
    snap["loss"] = torch.tensor(losses, dtype=torch.float64)
    rec = {"losses": losses, **compile_info}
    if ref_snap is not None and impl != "eager":
        grads = {k: v for k, v in snap.items() if k != "loss"}
        rec["max_rel_err"] = max_rel_err(snap, ref_snap)
        rec["loss_rel_err"] = max_rel_err({"loss": snap["loss"]}, {"loss": ref_snap["loss"]})
        rec["grad_rel_err"] = max_rel_err(grads, {k: v for k, v in ref_snap.items() if k != "loss"})
    warm_up(step, fwd, before, fwd_bwd_calls=max(0, warmup - 2), fwd_calls=max(1, warmup))
    before()

    time_steps(rec, fwd, step, before, device, repeats, max_seconds)
    rec["images_per_s"] = case.B / (rec["fwd_bwd_ms"] / 1e3) if rec["fwd_bwd_ms"] > 0 else None
    before()
    # what is allocated before a step (and so not in peak_mb): parameters, Adam state, images and labels
    state = [t for st in optimizer.state.values() for t in st.values()]
    rec["state_mb"] = (
        tensor_bytes(model.parameters()) + tensor_bytes(state) + tensor_bytes((images, labels))
    ) / MiB
    if inference:
        model.eval()
        try:
            time_inference(rec, fwd, impl, device, warmup, repeats, max_seconds)
        finally:
            model.train()
    return rec, snap


def bench_model_case(
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
    seed: int = 0,
    note: Callable[[str], None] = print,
    progress=None,
) -> list[dict]:
    """All implementations of a model op at one batch size (bench_case for a whole training step)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    base_model = make_model(case.op, iters=iters, seed=seed)
    params = sum(p.numel() for p in base_model.parameters())
    amp = _model_precision(dtype)[1]

    def base(impl):
        return {
            "op": case.op,
            "shape": case.shape(),
            "dtype": dtype_name(dtype),
            "impl": impl,
            "fwd_ms": None,
            "fwd_bwd_ms": None,
            "peak_mb": None,
            "floor_ms": None,
            "shape_name": case.shape_name,
            "iters": iters,
            "floor_fwd_ms": None,
            "floor_x": None,
            "floor_fwd_x": None,
            "params": params,
            "optimizer": "Adam (fused)",
            "amp": None if amp is None else dtype_name(amp),
        }

    def measure(impl, inputs, ref_snap):
        return bench_model_impl(
            case,
            impl,
            base_model,
            *inputs,
            dtype=dtype,
            device=device,
            repeats=repeats,
            warmup=warmup,
            max_seconds=max_seconds,
            inference=inference,
            ref_snap=ref_snap,
        )

    return bench_impls(
        case,
        impls,
        device,
        base=base,
        estimate=lambda impl: model_estimated_bytes(case, impl, itemsize, params),
        make_inputs=lambda: make_model_inputs(case.B, device, dtype, seed),
        unavailable=model_unavailable(case.op, device),
        measure=measure,
        note=note,
        progress=progress,
    )


def model_max_batch(
    op: str,
    impl: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    iters: int = 3,
    seed: int = 0,
    cap: int = MAX_BATCH_CAP,
) -> dict:
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
            optimizer = make_optimizer(model)
            train_step(fn, optimizer, images, labels, device, amp)()
            synchronize(device)
        finally:
            model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    try:
        best, tries = find_max_batch(step, cap, free=lambda: free_memory(device))
    finally:
        model = fn = None  # frees them before free_memory; step() is not called again
        free_memory(device)
    return {
        "op": op,
        "impl": impl,
        "dtype": dtype_name(dtype),
        "max_batch": best,
        "cap": cap,
        "capped": bool(
            tries and tries[-1][1]
        ),  # every try fitted: the largest may be above the cap
        "tries": [b for b, _ in tries],
        "search_s": round(time.perf_counter() - t0, 1),
    }
