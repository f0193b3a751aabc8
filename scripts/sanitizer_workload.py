"""A small CUDA workload for compute-sanitizer: every capsroute op, forward and backward, on odd
shapes, every storage dtype and option (the shapes are small so memcheck/racecheck stay fast).
Exits non-zero if an output is not finite or disagrees with the CPU backend, or if a kernel path
never ran (capsroute.last_kernel_path: a forced switch that silently fell back would leave its
kernels unchecked).

    python scripts/sanitizer_workload.py [--device cuda] [SECTION...]
        (sections: routing, em, conv, attention; default all)

Sections let a sanitizer that is slow (racecheck) cover the workload in parts; each reports its
time as it ends. The inputs are the op table's (capsroute.testing), the tolerances the op
table's for the GPU checks.
--device cpu checks the script itself (the CPU backend against itself in float64; no kernel paths)."""

import argparse
import itertools
import os
import sys
import time

import torch

import capsroute
from capsroute.testing import SAMPLES, tolerance

failures = []
covered = set()  # the kernel paths the device calls ran
DEVICE = torch.device("cuda")  # main() sets it
CLUSTERS = False  # sm_90: the cluster kernels can run (main() sets it)


def note_paths(op):
    for direction in ("forward", "backward"):
        covered.add(capsroute.last_kernel_path(op, direction))


def check(name, cuda_out, cpu_out, tol, vanishing=()):
    """Relative errors, but absolute ones for the outputs in `vanishing`: those whose exact value
    is 0, where both sides return rounding noise (the inputs are of order 1)."""
    for k, (a, b) in enumerate(zip(cuda_out, cpu_out)):
        # Where the exact value is past the storage dtype's range, inf is its correct rounding (the
        # gradient w.r.t. an input without mass is large: docs/ops.md, em_routing).
        overflow = b.abs() > torch.finfo(a.dtype).max
        a, b = a.double().cpu(), b.double()
        a, b = a[~overflow], b[~overflow]
        if not b.numel():  # every exact value past the range (one input, without mass)
            continue
        scale = 1.0 if k in vanishing else b.abs().max().clamp_min(1e-30).item()
        err = (a - b).abs().max().item() / scale
        if not torch.isfinite(a).all() or err > tol:
            failures.append(f"{name} output {k}: relative error {err:.2e}")


def run(fn, inputs, grads):
    """fn's outputs and its gradients w.r.t. every input, backward from one gradient per output
    (grads: float64 on the CPU, moved to the outputs' device)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    loss = sum((out.double() * g.to(out.device)).sum() for out, g in zip(outputs, grads))
    return [out.detach() for out in outputs] + list(torch.autograd.grad(loss, leaves))


def check_op(op, label, fn, inputs, grads, dtype):
    """An op on the device in `dtype` against the CPU backend in float64 on the same rounded values."""
    cuda_out = run(fn, [t.to(DEVICE, dtype) for t in inputs], grads)
    note_paths(op)
    cpu_out = run(fn, [t.to(dtype).double() for t in inputs], grads)
    check(f"{op} {label}", cuda_out, cpu_out, tolerance(op, dtype, gpu_check=True))


def sample(op, shape):
    """The op table's float64 inputs of op at shape, detached."""
    return [t.detach() for t in SAMPLES[op].make(shape)]


ROUTING_SHAPES = [(3, 37, 7, 16, 8), (2, 65, 33, 5, 3), (1, 1, 1, 1, 1), (4, 70, 10, 32, 8)]


def check_routing_ops(
    dtype, shape, leaky, detach, label, ops=("dynamic_routing", "dense_capsules", "squash")
):
    B, I, J, D, Din = shape
    label = f"{dtype} B={B} I={I} J={J} D={D} leaky={leaky} detach={detach} {label}"
    votes, bias = sample("dynamic_routing", (B, I, J, D))
    u, weight, _ = sample("dense_capsules", (B, I, J, D, Din))
    grad = torch.randn(B, J, D, dtype=torch.float64)
    routing = lambda x, b: capsroute.dynamic_routing(x, 3, bias=b, leaky=leaky, detach=detach)  # noqa: E731
    dense = lambda x, w, b: capsroute.dense_capsules(x, w, 3, bias=b, leaky=leaky, detach=detach)  # noqa: E731
    for name, fn, inputs in [
        ("dynamic_routing", routing, (votes, bias)),
        ("dense_capsules", dense, (u, weight, bias)),
        ("squash", capsroute.squash, (votes[:, 0],)),
    ]:
        if name not in ops:
            continue
        g = grad if name != "squash" else torch.randn_like(votes[:, 0])
        check_op(name, label, fn, inputs, (g,), dtype)


def check_routing():
    # The kernels the dispatch picks, every storage dtype, with the rows of each element in one range
    # and (CAPSROUTE_ROUTING_SPLITS) in 3, more ranges than rows included.
    for dtype, shape, leaky, detach, splits in itertools.product(
        [torch.float32, torch.float64, torch.float16, torch.bfloat16],
        ROUTING_SHAPES,
        [False, True],
        [False, True],
        ["1", "3"],
    ):
        os.environ["CAPSROUTE_ROUTING_SPLITS"] = splits
        check_routing_ops(dtype, shape, leaky, detach, f"splits={splits}")
    os.environ.pop("CAPSROUTE_ROUTING_SPLITS", None)

    # Each path forced: dynamic_routing's rows a warp per part of an element where the capsules fit
    # (J = 7, D = 16 and 1 x 1 here; J = 33, D = 5 and D = 32 take the block kernels), in one range per
    # element with (sm_90) the forward an element per cluster of 8 blocks and the backward an element
    # per cluster of 16 (CAPSROUTE_ROUTING_CLUSTER=force, whatever the batch), and
    # (CAPSROUTE_ROUTING_SPLITS) in 3 ranges on the warp rows both ways (CAPSROUTE_ROUTING_CLUSTER=0),
    # the vote gradient then a tile of rows per block; and
    # dense_capsules' votes of a chunk of the batch as one batched GEMM: the whole batch in one chunk
    # and (CAPSROUTE_DENSE_CHUNK) chunks of 2 elements, an uneven last one included; float32 and
    # float16 storage (dense_capsules' votes in float32 either way, bfloat16 as float16).
    for dtype, shape, detach, splits, chunk in itertools.product(
        [torch.float32, torch.float16], ROUTING_SHAPES, [False, True], ["1", "3"], [None, "2"]
    ):
        os.environ["CAPSROUTE_ROUTING_SPLITS"] = splits
        os.environ["CAPSROUTE_ROUTING_CLUSTER"] = "force" if splits == "1" and CLUSTERS else "0"
        if chunk is None:
            os.environ.pop("CAPSROUTE_DENSE_CHUNK", None)
        else:
            os.environ["CAPSROUTE_DENSE_CHUNK"] = chunk
        ops = (
            ("dynamic_routing", "dense_capsules") if chunk is None else ("dense_capsules",)
        )  # the chunk is dense's alone
        check_routing_ops(dtype, shape, True, detach, f"splits={splits} chunk={chunk}", ops=ops)
    for name in (
        "CAPSROUTE_DENSE_CHUNK",
        "CAPSROUTE_ROUTING_SPLITS",
        "CAPSROUTE_ROUTING_CLUSTER",
    ):
        os.environ.pop(name, None)


# The EM kernels' switches: as the dispatch picks (row ranges, and a warp lane per (j, h) entry where
# H divides 32) on every storage dtype; 3 row ranges (CAPSROUTE_EM_SPLITS; more ranges than rows at
# I = 1) on float32 and float16; and those with a lane per capsule (CAPSROUTE_EM_LANES) on float32.
EM_SWITCHES = ("CAPSROUTE_EM_SPLITS", "CAPSROUTE_EM_LANES")
EM_RUNS = [
    (switches, dtype)
    for switches, dtypes in [
        ({}, [torch.float32, torch.float64, torch.float16, torch.bfloat16]),
        ({"CAPSROUTE_EM_SPLITS": "3"}, [torch.float32, torch.float16]),
    ]
    for dtype in dtypes
]
# Drawn after the others, which keep their inputs whether or not these run.
EM_CAPSULE_LANES = [({"CAPSROUTE_EM_SPLITS": "3", "CAPSROUTE_EM_LANES": "capsule"}, torch.float32)]


def use_em_switches(switches):
    for name in EM_SWITCHES:
        os.environ.pop(name, None)
    os.environ.update(switches)


def check_em():
    check_em_runs(EM_RUNS)
    check_em_runs(EM_CAPSULE_LANES)


def check_em_runs(runs):
    # EM routing: gradients of (pose, a_out) w.r.t. votes, a_in and both betas.
    for (switches, dtype), (B, I, J, H), iters in itertools.product(
        runs, [(3, 37, 7, 16), (2, 9, 32, 16), (1, 1, 1, 4), (4, 70, 10, 5)], [1, 3]
    ):
        use_em_switches(switches)
        votes, a_in, *betas = sample("em_routing", (B, I, J, H))
        a_in[:, ::4] = 0  # inputs without mass take the guarded paths
        grads = torch.randn(B, J, H, dtype=torch.float64), torch.randn(B, J, dtype=torch.float64)

        def em(*xs):
            return capsroute.em_routing(*xs, iters, final_lambda=0.5)

        inputs = (votes, a_in, *betas)
        label = f"{switches} {dtype} B={B} I={I} J={J} H={H} iters={iters}"
        check_op("em_routing", label, em, inputs, grads, dtype)

    # EM routing over votes pose_i @ weight_ij: gradients w.r.t. pose, weight, a_in and both betas. The
    # backward runs the batch in chunks: the default (one chunk at these sizes) and chunks of 2 elements.
    for (switches, dtype), (B, I, J), iters, chunk in itertools.product(
        runs, [(3, 37, 7), (2, 9, 32), (1, 1, 1), (5, 70, 10)], [1, 3], [None, "2"]
    ):
        use_em_switches(switches)
        pose, weight, a_in, *betas = sample("em_routing_pose", (B, I, J))
        a_in[:, ::4] = 0  # inputs without mass take the guarded paths
        grads = torch.randn(B, J, 16, dtype=torch.float64), torch.randn(B, J, dtype=torch.float64)

        def em_pose(*xs):
            return capsroute.em_routing_pose(*xs, iters, final_lambda=0.5)

        if chunk is None:
            os.environ.pop("CAPSROUTE_EM_POSE_BACKWARD_CHUNK", None)
        else:
            os.environ["CAPSROUTE_EM_POSE_BACKWARD_CHUNK"] = chunk
        inputs = (pose, weight, a_in, *betas)
        label = f"{switches} {dtype} B={B} I={I} J={J} iters={iters} chunk={chunk}"
        check_op("em_routing_pose", label, em_pose, inputs, grads, dtype)
    for name in ("CAPSROUTE_EM_POSE_BACKWARD_CHUNK", *EM_SWITCHES):
        os.environ.pop(name, None)


def check_conv():
    # conv_em_routing: gradients w.r.t. pose, a_in, weight and both betas, every storage dtype, against
    # the CPU kernel in float64 on the same rounded values. Shapes: overlapping windows with padding,
    # stride 2 (K = 1 there: children no window contains), one iteration.
    for dtype, (B, H, W, C_in, C_out, K, stride, padding), iters in itertools.product(
        [torch.float32, torch.float64, torch.float16, torch.bfloat16],
        [(2, 5, 4, 3, 5, 3, 1, 1), (1, 6, 5, 4, 3, 1, 2, 0), (3, 4, 4, 2, 7, 3, 2, 1)],
        [1, 3],
    ):
        pose, a_in, weight, *betas = sample("conv_em_routing", (B, H, W, C_in, C_out, K))
        Ho, Wo = (H + 2 * padding - K) // stride + 1, (W + 2 * padding - K) // stride + 1
        grads = (
            torch.randn(B, Ho, Wo, C_out, 16, dtype=torch.float64),
            torch.randn(B, Ho, Wo, C_out, dtype=torch.float64),
        )

        def conv_em(*xs):
            return capsroute.conv_em_routing(
                *xs, iters, stride=stride, padding=padding, final_lambda=0.5
            )

        inputs = (pose, a_in, weight, *betas)
        label = (
            f"{dtype} B={B} {H}x{W} C_in={C_in} C_out={C_out} K={K} stride={stride} "
            f"padding={padding} iters={iters}"
        )
        check_op("conv_em_routing", label, conv_em, inputs, grads, dtype)

    # conv_dynamic_routing: gradients w.r.t. u, weight and bias, every storage dtype, against the CPU
    # backend in float64 on the same rounded values. Shapes: padding; stride 2 with padding >= K
    # (windows on padding alone) and J = 33 (the block kernels); whole images a chunk and
    # (CAPSROUTE_CONV_CHUNK) rows of one image, a short last chunk included (the warp rows).
    for dtype, (B, H, W, C_in, C_out, D, Din, K, stride, padding), chunk in itertools.product(
        [torch.float32, torch.float64, torch.float16, torch.bfloat16],
        [
            (2, 6, 5, 3, 4, 8, 5, 3, 1, 1),
            (1, 5, 7, 2, 33, 4, 3, 3, 2, 4),
            (3, 7, 8, 2, 3, 16, 4, 3, 2, 1),
        ],
        [None, "5"],
    ):
        Ho, Wo = (H + 2 * padding - K) // stride + 1, (W + 2 * padding - K) // stride + 1
        inputs = sample("conv_dynamic_routing", (B, H, W, C_in, C_out, D, Din, K))
        grad = torch.randn(B, Ho, Wo, C_out, D, dtype=torch.float64)

        def conv_dynamic(u, weight, bias):
            return capsroute.conv_dynamic_routing(
                u, weight, bias=bias, stride=stride, padding=padding
            )

        if chunk is None:
            os.environ.pop("CAPSROUTE_CONV_CHUNK", None)
        else:
            os.environ["CAPSROUTE_CONV_CHUNK"] = chunk
        label = (
            f"{dtype} B={B} {H}x{W} C_in={C_in} C_out={C_out} D={D} K={K} stride={stride} "
            f"padding={padding} chunk={chunk}"
        )
        check_op("conv_dynamic_routing", label, conv_dynamic, inputs, (grad,), dtype)
    os.environ.pop("CAPSROUTE_CONV_CHUNK", None)


# The attention routings (dynamic routing's block kernels under their rules), on given votes and
# on votes made from u and a weight (the dense forms: GEMM-made chunks), every storage dtype, with
# and without their parameters, the rows of each element in one range (and in 3: float32 and
# float16), against capsroute.reference in float64 on the CPU (the same rounded values).
def attention_fn(op, n, kind):
    """op called on its n capsule operands, then the parameters given (none, or all of them):
    kind 0 a coupling bias, kind 1 a LayerNorm's weight and bias (3 iterations)."""

    def fn(*t):
        given = t[n:]
        if kind == 0:
            return op(*t[:n], coupling_bias=given[0] if given else None)
        norm = dict(norm_weight=given[0], norm_bias=given[1]) if given else {}
        return op(*t[:n], 3, **norm)

    return fn


def check_attention_ops(dtype, shape, with_parameters, label):
    B, I, J, D, Din = shape
    label = f"{dtype} B={B} I={I} J={J} D={D} parameters={with_parameters} {label}"
    votes, coupling_bias = sample("self_attention_routing", (B, I, J, D))
    u, weight, *norm = sample("dense_inverted_attention_routing", (B, I, J, D, Din))
    grad = torch.randn(B, J, D, dtype=torch.float64)
    params = ([coupling_bias], norm) if with_parameters else ([], [])
    routings = (  # name, its capsule operands, its parameters (params' index)
        ("self_attention_routing", [votes], 0),
        ("inverted_attention_routing", [votes], 1),
        ("dense_self_attention_routing", [u, weight], 0),
        ("dense_inverted_attention_routing", [u, weight], 1),
    )
    for name, operands, kind in routings:
        n = len(operands)
        for module in (capsroute, capsroute.reference):
            fn = attention_fn(getattr(module, name), n, kind)
            inputs = [*operands, *params[kind]]
            if module is capsroute:
                cuda_out = run(fn, [t.to(DEVICE, dtype) for t in inputs], (grad,))
                note_paths(name)
            else:
                want = run(fn, [t.to(dtype).double() for t in inputs], (grad,))
        # LayerNorm over D = 1 value is constant (its bias): the exact gradients w.r.t. the capsule
        # operands and norm_weight are 0.
        vanishing = range(1, n + 1 + with_parameters) if kind == 1 and D == 1 else ()
        check(f"{name} {label}", cuda_out, want, tolerance(name, dtype, gpu_check=True), vanishing)


ATTENTION_DTYPES = {
    "1": [torch.float32, torch.float64, torch.float16, torch.bfloat16],
    "3": [torch.float32, torch.float16],
}


def check_attention():
    for splits, dtypes in ATTENTION_DTYPES.items():
        os.environ["CAPSROUTE_ROUTING_SPLITS"] = splits
        for dtype, shape, with_parameters in itertools.product(
            dtypes, ROUTING_SHAPES, [False, True]
        ):
            check_attention_ops(dtype, shape, with_parameters, f"splits={splits}")
    os.environ.pop("CAPSROUTE_ROUTING_SPLITS", None)


# Each section: its checks and the kernel paths they must run. conv_dynamic_routing's chunks run
# the warp rows (5 positions) and the block kernels (J = 33).
SECTIONS = {
    "routing": (
        check_routing,
        {
            "cuda",
            "v2-warp-rows",
            "v2-block",
            "dense-v2-gemm+v2-warp-rows",
            "dense-v2-gemm+v2-block",
        },
    ),
    "em": (check_em, {"em-row-ranges", "em-column-lanes"}),
    "conv": (check_conv, {"conv-em-parent-child", "conv-gemm+v2-warp-rows", "conv-gemm+v2-block"}),
    "attention": (check_attention, {"v2-block", "dense-v2-gemm+v2-block"}),
}
CLUSTER_PATHS = {"routing": {"v2-cluster", "dense-v2-gemm+v2-cluster"}}  # sm_90 runs them too


def main(argv=None) -> int:
    global DEVICE, CLUSTERS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("sections", nargs="*", metavar="SECTION", help=f"of {', '.join(SECTIONS)}")
    args = p.parse_args(argv)
    unknown = [name for name in args.sections if name not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}")
    DEVICE = torch.device(args.device)
    on_gpu = DEVICE.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    CLUSTERS = on_gpu and torch.cuda.get_device_capability(DEVICE) >= (9, 0)
    expected_paths = set()
    for name in args.sections or list(SECTIONS):
        started = time.monotonic()
        torch.manual_seed(0)  # a section run alone draws the inputs it draws in a whole run
        check_section, paths = SECTIONS[name]
        check_section()
        if on_gpu:
            torch.cuda.synchronize()
            expected_paths |= paths | (CLUSTER_PATHS.get(name, set()) if CLUSTERS else set())
        print(
            f"{name}: done in {time.monotonic() - started:.0f} s, {len(failures)} failures so far"
        )
    if expected_paths - covered:
        failures.append(f"kernel paths never run: {sorted(expected_paths - covered)}")
    print(f"kernel paths run: {', '.join(sorted(covered))}")
    print(
        "\n".join(failures) or "all outputs finite and matching the CPU backend (or the reference)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
