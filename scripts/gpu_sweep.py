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
from capsroute.testing import SELF_ATTENTION_TOLERANCE_FACTOR

# Relative error (max |a - b| / max |b|) allowed against the float64 reference: the test suite's
# tolerances, float32's loosened for sums over up to 16384 inputs (routing) and for the log-variances
# of EM's M-step (as the EM tests loosen it).
FLOAT64_TOLERANCE = 1e-10
ROUTING_FLOAT32_TOLERANCE = 5e-5
EM_FLOAT32_TOLERANCE = 2e-4
# Self-attention's logits sum over every input capsule: the doctor's factor over the routing's.
SELF_ATTENTION_FLOAT32_TOLERANCE = (
    ROUTING_FLOAT32_TOLERANCE * SELF_ATTENTION_TOLERANCE_FACTOR[torch.float32]
)


def _randn(*shape, scale=1.0):
    return torch.randn(*shape, dtype=torch.float64) * scale


def routing_case(B, I, J, D, **options):
    """Each case: run(impl, *inputs) -> outputs, the float64 inputs, the output shapes, the float32 tolerance."""
    inputs = [_randn(B, I, J, D, scale=0.5), _randn(J, D, scale=0.1)]

    def run(impl, votes, bias):
        return (impl.dynamic_routing(votes, 3, bias=bias, **options),)

    return run, inputs, [(B, J, D)], ROUTING_FLOAT32_TOLERANCE


def dense_case(B, I, J, D, Din, **options):
    inputs = [_randn(B, I, Din), _randn(I, J, D, Din, scale=0.05), _randn(J, D, scale=0.1)]

    def run(impl, u, weight, bias):
        return (impl.dense_capsules(u, weight, 3, bias=bias, **options),)

    return run, inputs, [(B, J, D)], ROUTING_FLOAT32_TOLERANCE


def squash_case(B, J, D):
    def run(impl, s):
        return (impl.squash(s),)

    return run, [_randn(B, J, D)], [(B, J, D)], ROUTING_FLOAT32_TOLERANCE


def self_attention_case(B, I, J, D, **options):
    inputs = [_randn(B, I, J, D, scale=0.5), _randn(I, J, scale=0.05)]

    def run(impl, votes, coupling_bias):
        return (impl.self_attention_routing(votes, coupling_bias=coupling_bias, **options),)

    return run, inputs, [(B, J, D)], SELF_ATTENTION_FLOAT32_TOLERANCE


def inverted_attention_case(B, I, J, D, iters=3):
    inputs = [_randn(B, I, J, D, scale=0.5), 1 + _randn(D, scale=0.1), _randn(D, scale=0.1)]

    def run(impl, votes, norm_weight, norm_bias):
        return (
            impl.inverted_attention_routing(
                votes, iters, norm_weight=norm_weight, norm_bias=norm_bias
            ),
        )

    return run, inputs, [(B, J, D)], ROUTING_FLOAT32_TOLERANCE


def dense_self_attention_case(B, I, J, D, Din=8, **options):
    inputs = [_randn(B, I, Din), _randn(I, J, D, Din, scale=0.3), _randn(I, J, scale=0.05)]

    def run(impl, u, weight, coupling_bias):
        return (
            impl.dense_self_attention_routing(u, weight, coupling_bias=coupling_bias, **options),
        )

    return run, inputs, [(B, J, D)], SELF_ATTENTION_FLOAT32_TOLERANCE


def dense_inverted_attention_case(B, I, J, D, Din=8, iters=3):
    inputs = [
        _randn(B, I, Din),
        _randn(I, J, D, Din, scale=0.3),
        1 + _randn(D, scale=0.1),
        _randn(D, scale=0.1),
    ]

    def run(impl, u, weight, norm_weight, norm_bias):
        return (
            impl.dense_inverted_attention_routing(
                u, weight, iters, norm_weight=norm_weight, norm_bias=norm_bias
            ),
        )

    return run, inputs, [(B, J, D)], ROUTING_FLOAT32_TOLERANCE


def _em_inputs(B, I, J):
    a_in = 0.1 + 0.9 * torch.rand(B, I, dtype=torch.float64)
    a_in[:, ::7] = 0  # inputs without mass take the guarded paths
    return a_in, _randn(J, scale=0.5), _randn(J, scale=0.5)


def em_case(B, I, J, H=16):
    inputs = [_randn(B, I, J, H), *_em_inputs(B, I, J)]

    def run(impl, votes, a_in, beta_u, beta_a):
        return impl.em_routing(votes, a_in, beta_u, beta_a, 3, final_lambda=0.5)

    return run, inputs, [(B, J, H), (B, J)], EM_FLOAT32_TOLERANCE


def em_pose_case(B, I, J):
    inputs = [_randn(B, I, 4, 4), _randn(I, J, 4, 4, scale=0.5), *_em_inputs(B, I, J)]

    def run(impl, pose, weight, a_in, beta_u, beta_a):
        return impl.em_routing_pose(pose, weight, a_in, beta_u, beta_a, 3, final_lambda=0.5)

    return run, inputs, [(B, J, 16), (B, J)], EM_FLOAT32_TOLERANCE


def conv_dynamic_case(B, H, W, C_in, C_out, D, Din, K, padding):
    inputs = [
        _randn(B, H, W, C_in, Din),
        _randn(K, K, C_in, C_out, D, Din, scale=(K * K * Din) ** -0.5),
        _randn(C_out, D, scale=0.1),
    ]
    Ho, Wo = H + 2 * padding - K + 1, W + 2 * padding - K + 1

    def run(impl, u, weight, bias):
        return (impl.conv_dynamic_routing(u, weight, 3, bias=bias, padding=padding),)

    return run, inputs, [(B, Ho, Wo, C_out, D)], ROUTING_FLOAT32_TOLERANCE


def conv_em_case(B, H, W, C_in, C_out, K):
    a_in = 0.1 + 0.9 * torch.rand(B, H, W, C_in, dtype=torch.float64)
    inputs = [
        _randn(B, H, W, C_in, 4, 4),
        a_in,
        _randn(K, K, C_in, C_out, 4, 4, scale=0.5),
        _randn(C_out, scale=0.5),
        _randn(C_out, scale=0.5),
    ]
    Ho, Wo = H - K + 1, W - K + 1

    def run(impl, pose, a_in, weight, beta_u, beta_a):
        return impl.conv_em_routing(pose, a_in, weight, beta_u, beta_a, 3, final_lambda=0.5)

    return run, inputs, [(B, Ho, Wo, C_out, 16), (B, Ho, Wo, C_out)], EM_FLOAT32_TOLERANCE


def cases(quick: bool):
    """(name, builder) for every case of the sweep."""
    mnist = dict(I=1152, J=10, D=16) if not quick else dict(I=40, J=10, D=16)
    batches = (1, 7, 512, 2048) if not quick else (1, 7)
    large = dict(I=16384, J=100, D=16) if not quick else dict(I=300, J=33, D=16)
    em_conv = dict(B=64 * 36, I=288, J=32) if not quick else dict(B=2 * 3, I=18, J=8)
    em_class = dict(B=64, I=512, J=10) if not quick else dict(B=4, I=24, J=10)
    for B in batches:
        yield f"squash B={B}", lambda B=B: squash_case(B, mnist["J"], mnist["D"])
        yield f"dynamic_routing MNIST B={B}", lambda B=B: routing_case(B, **mnist)
        yield f"dense_capsules MNIST B={B}", lambda B=B: dense_case(B, **mnist, Din=8)
        yield f"self_attention_routing MNIST B={B}", lambda B=B: self_attention_case(B, **mnist)
        yield (
            f"inverted_attention_routing MNIST B={B}",
            lambda B=B: inverted_attention_case(B, **mnist),
        )
        yield (
            f"dense_self_attention_routing MNIST B={B}",
            lambda B=B: dense_self_attention_case(B, **mnist),
        )
        yield (
            f"dense_inverted_attention_routing MNIST B={B}",
            lambda B=B: dense_inverted_attention_case(B, **mnist),
        )
    yield "dynamic_routing MNIST B=7 leaky", lambda: routing_case(7, **mnist, leaky=True)
    yield "dynamic_routing MNIST B=7 detach", lambda: routing_case(7, **mnist, detach=True)
    yield (
        "dense_capsules MNIST B=7 leaky detach",
        lambda: dense_case(7, **mnist, Din=8, leaky=True, detach=True),
    )
    yield (
        "self_attention_routing MNIST B=7 sabour",
        lambda: self_attention_case(7, **mnist, squash="sabour"),
    )
    yield (
        "inverted_attention_routing MNIST B=7 iters=1",
        lambda: inverted_attention_case(7, **mnist, iters=1),
    )
    yield (
        "dense_self_attention_routing MNIST B=7 sabour",
        lambda: dense_self_attention_case(7, **mnist, squash="sabour"),
    )
    yield (
        "dense_inverted_attention_routing MNIST B=7 iters=1",
        lambda: dense_inverted_attention_case(7, **mnist, iters=1),
    )
    for B in (1, 2):
        yield (
            f"self_attention_routing I={large['I']} J={large['J']} B={B}",
            lambda B=B: self_attention_case(B, **large),
        )
        yield (
            f"inverted_attention_routing I={large['I']} J={large['J']} B={B}",
            lambda B=B: inverted_attention_case(B, **large),
        )
        yield (
            f"dense_self_attention_routing I={large['I']} J={large['J']} B={B}",
            lambda B=B: dense_self_attention_case(B, **large),
        )
        yield (
            f"dense_inverted_attention_routing I={large['I']} J={large['J']} B={B}",
            lambda B=B: dense_inverted_attention_case(B, **large),
        )
        yield (
            f"dynamic_routing I={large['I']} J={large['J']} B={B}",
            lambda B=B: routing_case(B, **large),
        )
        yield (
            f"dense_capsules I={large['I']} J={large['J']} B={B}",
            lambda B=B: dense_case(B, **large, Din=8),
        )
    yield f"em_routing class B={em_class['B']}", lambda: em_case(**em_class)
    yield f"em_routing conv B={em_conv['B']}", lambda: em_case(**em_conv)
    yield f"em_routing_pose class B={em_class['B']}", lambda: em_pose_case(**em_class)
    yield f"em_routing_pose conv B={em_conv['B']}", lambda: em_pose_case(**em_conv)
    # SegCaps-like: rows of an image a chunk (64 x 64, B = 2), whole images (32 x 32, B = 16)
    segcaps = dict(C_in=8, C_out=8, D=16, Din=16, K=5, padding=2)
    grids = ((2, 64), (16, 32)) if not quick else ((1, 6), (2, 4))
    for B, side in grids:
        yield (
            f"conv_dynamic_routing segcaps {side}x{side} B={B}",
            lambda B=B, side=side: conv_dynamic_case(B, side, side, **segcaps),
        )
    conv1 = (
        dict(B=8, H=12, W=12, C_in=8, C_out=16, K=3)
        if not quick
        else dict(B=2, H=4, W=5, C_in=2, C_out=3, K=3)
    )
    yield f"conv_em_routing mcn-conv1 B={conv1['B']}", lambda: conv_em_case(**conv1)


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


def sweep_case(name, build, device) -> list[dict]:
    run, inputs, out_shapes, float32_tolerance = build()
    inputs = [t.to(device) for t in inputs]
    cotangents = [torch.randn(*s, dtype=torch.float64, device=device) for s in out_shapes]
    expected = outputs_and_grads(run, reference, inputs, cotangents)
    records = []
    for dtype, tol in ((torch.float64, FLOAT64_TOLERANCE), (torch.float32, float32_tolerance)):
        cast = [t.to(dtype) for t in inputs]
        start = time.perf_counter()
        got = outputs_and_grads(run, capsroute, cast, cotangents)
        again = outputs_and_grads(run, capsroute, cast, cotangents)
        seconds = time.perf_counter() - start
        op = name.split()[0]
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
    for name, build in cases(args.quick):
        if not any(text in name for text in args.match):
            continue
        for r in sweep_case(name, build, device):
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
