"""GPU correctness sweep: every capsroute op against capsroute.reference in float64, on the device,
at the sizes the test suite can't afford on a CPU (MNIST B = 1, 7, 512, 2048; I = 16384 and J = 100;
EM at the conv-capsule shape B = 64 x 36; the conv ops at SegCaps' and MatrixCapsNet's conv1
shapes), forward and every gradient; then float32 against the same float64 reference; then bitwise
determinism (two float32 runs, outputs and gradients equal).

    python scripts/gpu_sweep.py [--device cuda] [--quick] [--match TEXT ...] [--out DIR]

--quick shrinks every case (for a CPU check that the script itself works); --match runs only the
cases whose name contains one of the TEXTs. Writes gpu-sweep.json (one record per case and dtype:
relative errors, pass/fail, determinism, and the kernel path that ran forward/backward,
capsroute.last_kernel_path) to --out, prints a line per case, and exits 1 if any case fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import capsroute
from capsroute import reference
from capsroute.testing import OPS, SAMPLES, tolerance

ATTENTION_OPS = [check.name for check in OPS if check.family in ("attention", "dense-attention")]

# em_routing and em_routing_pose: every 7th input capsule without mass takes the guarded paths
MASSLESS_OPS, MASSLESS_EVERY = ("em_routing", "em_routing_pose"), 7


def cases(quick: bool):
    """(name, op, shape, options) for every case of the sweep: shapes as the op table's samplers
    take them (capsroute.testing), options to the op."""
    I, J, D = (1152, 10, 16) if not quick else (40, 10, 16)
    large_I, large_J = (16384, 100) if not quick else (300, 33)
    batches = (1, 7, 512, 2048) if not quick else (1, 7)
    em_class = (64, 512, 10) if not quick else (4, 24, 10)
    em_conv = (64 * 36, 288, 32) if not quick else (2 * 3, 18, 8)
    em = dict(final_lambda=0.5)

    def vector_shape(op, B, I, J):  # the dense forms take u (B, I, Din = 8) and a weight
        return (B, I, J, D, 8) if op.startswith("dense") else (B, I, J, D)

    for B in batches:
        yield f"squash B={B}", "squash", (B, J, D), {}
        for op in ("dynamic_routing", "dense_capsules", *ATTENTION_OPS):
            yield f"{op} MNIST B={B}", op, vector_shape(op, B, I, J), {}
    for op, options in [
        ("dynamic_routing", dict(leaky=True)),
        ("dynamic_routing", dict(detach=True)),
        ("dense_capsules", dict(leaky=True, detach=True)),
        ("self_attention_routing", dict(squash="sabour")),
        ("inverted_attention_routing", dict(iters=1)),
        ("dense_self_attention_routing", dict(squash="sabour")),
        ("dense_inverted_attention_routing", dict(iters=1)),
    ]:
        label = " ".join(f"{k}={v}" if v is not True else k for k, v in options.items())
        yield f"{op} MNIST B=7 {label}", op, vector_shape(op, 7, I, J), options
    for B in (1, 2):
        for op in (*ATTENTION_OPS, "dynamic_routing", "dense_capsules"):
            shape = vector_shape(op, B, large_I, large_J)
            yield f"{op} I={large_I} J={large_J} B={B}", op, shape, {}
    for op in ("em_routing", "em_routing_pose"):
        for kind, (B, I_em, J_em) in (("class", em_class), ("conv", em_conv)):
            shape = (B, I_em, J_em, 16) if op == "em_routing" else (B, I_em, J_em)
            yield f"{op} {kind} B={B}", op, shape, em
    # SegCaps-like (padding 2, the op table's call): rows of an image a chunk (64 x 64, B = 2),
    # whole images (32 x 32, B = 16)
    for B, side in ((2, 64), (16, 32)) if not quick else ((1, 6), (2, 4)):
        shape = (B, side, side, 8, 8, 16, 16, 5)
        yield f"conv_dynamic_routing segcaps {side}x{side} B={B}", "conv_dynamic_routing", shape, {}
    conv1 = (8, 12, 12, 8, 16, 3) if not quick else (2, 4, 5, 2, 3, 3)
    options = dict(stride=1, padding=0, **em)
    yield f"conv_em_routing mcn-conv1 B={conv1[0]}", "conv_em_routing", conv1, options


def case_inputs(op, shape, options):
    """run(impl, *inputs) -> the op's outputs, and its float64 inputs on the CPU (the op table's
    sampler; for MASSLESS_OPS every MASSLESS_EVERY-th input capsule without mass)."""
    check = SAMPLES[op]
    inputs = [t.detach() for t in check.make(shape)]
    if op in MASSLESS_OPS:
        a_in = inputs[check.activation]
        a_in.view(a_in.shape[0], -1)[:, ::MASSLESS_EVERY] = 0
    return (lambda impl, *xs: check.call(impl, *xs, **options)), inputs


def outputs_and_grads(run, impl, inputs, cotangents):
    """The op's outputs and the gradients of sum(out * cotangent) w.r.t. every input."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = run(impl, *leaves)
    loss = sum((o.double() * g).sum() for o, g in zip(outs, cotangents))
    return [o.detach() for o in outs] + list(torch.autograd.grad(loss, leaves))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def sweep_case(name, op, shape, options, device) -> list[dict]:
    run, inputs = case_inputs(op, shape, options)
    inputs = [t.to(device) for t in inputs]
    with torch.no_grad():
        outs = run(reference, *inputs)
    cotangents = [torch.randn(o.shape, dtype=torch.float64).to(device) for o in outs]
    del outs
    expected = outputs_and_grads(run, reference, inputs, cotangents)
    records = []
    for dtype in (torch.float64, torch.float32):
        tol = tolerance(op, dtype, gpu_check=True)
        cast = [t.to(dtype) for t in inputs]
        start = time.perf_counter()
        got = outputs_and_grads(run, capsroute, cast, cotangents)
        again = outputs_and_grads(run, capsroute, cast, cotangents)
        seconds = time.perf_counter() - start
        path = "/".join(
            capsroute.last_kernel_path(op, direction) for direction in ("forward", "backward")
        )
        errors = [rel_err(a, b) for a, b in zip(got, expected)]
        deterministic = all(torch.equal(a, b) for a, b in zip(got, again))
        records.append(
            {
                "case": name,
                "dtype": str(dtype).removeprefix("torch."),
                "rel_errors": errors,
                "max_rel_error": max(errors),
                "tolerance": tol,
                "deterministic": deterministic,
                "passed": max(errors) <= tol and deterministic,
                "seconds": round(seconds, 3),
                "kernel_path": path,
            }
        )
    del expected
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--quick", action="store_true", help="small shapes (checks the script, not the kernels)"
    )
    p.add_argument(
        "--match",
        nargs="+",
        default=[""],
        help="only the cases whose name contains one of these texts",
    )
    p.add_argument("--out", default=".", help="folder for gpu-sweep.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    records = []
    for name, op, shape, options in cases(args.quick):
        if not any(text in name for text in args.match):
            continue
        for r in sweep_case(name, op, shape, options, device):
            records.append(r)
            print(
                f"{'ok  ' if r['passed'] else 'FAIL'} {r['case']:45s} {r['dtype']:8s} "
                f"max rel err {r['max_rel_error']:.2e} (tol {r['tolerance']:.0e}) "
                f"deterministic={r['deterministic']} {r['seconds']:.1f} s {r['kernel_path']}",
                flush=True,
            )
    failed = [r for r in records if not r["passed"]]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "kind": "gpu-sweep",
        "device": device_name,
        "torch": torch.__version__,
        "build": capsroute.build_info(),
        "quick": args.quick,
        "match": args.match,
        "results": records,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-sweep.json").write_text(json.dumps(report, indent=1))
    print(f"{len(records) - len(failed)} of {len(records)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
