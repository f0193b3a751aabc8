"""The benchmark's conv ops (capsroute/bench): their shapes and cases, inputs, the per-window row,
the floor, the CPU's --max-batch and a tiny end-to-end run. Checks the machinery, not speed."""

import argparse

import pytest
import torch

from capsroute import bench, reference
from capsroute.bench import cases, runner

CPU = torch.device("cpu")
TINY_EM = "6x6:2,3,16,16,3"  # H' = W' = 4
TINY_EM_NO_OVERLAP = "6x6:2,3,16,16,3,3"  # stride = K: no window overlaps another
TINY_DYNAMIC = "5x5:2,3,8,4,3,1,1"  # padding 1: H' = W' = 5


def test_default_conv_cases():
    got = bench.make_cases(["conv_em_routing", "conv_dynamic_routing"], None, None, "cpu")
    assert [(c.op, c.shape_name, c.B) for c in got] == [
        ("conv_em_routing", "mcn-conv1", 16),
        ("conv_em_routing", "mcn-conv2", 16),
        ("conv_em_routing", "conv-image", 1),
        ("conv_dynamic_routing", "conv-image", 1),
        ("conv_dynamic_routing", "segcaps", 2),
    ]
    assert got[0].shape() == {
        "B": 16,
        **dict(H=12, W=12, C_in=8, C_out=16, D=16, Din=16, K=3, stride=2, padding=0),
    }
    # MatrixCapsNet's conv layers: 12x12 primary capsules -> 5x5 -> 3x3
    assert bench.CONV_SHAPES["mcn-conv1"].out_hw() == (5, 5)
    assert bench.CONV_SHAPES["mcn-conv2"].out_hw() == (3, 3)
    assert bench.CONV_SHAPES["segcaps"].out_hw() == (64, 64)


def test_conv_shapes_go_to_the_conv_ops_only():
    shapes = [bench.parse_shape(s) for s in ("mnist", TINY_EM)]
    got = bench.make_cases(["dynamic_routing", "conv_em_routing"], shapes, [2], "cpu")
    assert [(c.op, c.shape_name) for c in got] == [
        ("dynamic_routing", "mnist"),
        ("conv_em_routing", TINY_EM),
    ]
    assert got[0].conv is None and got[1].conv == bench.ConvShape(6, 6, 2, 3, 16, 16, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="needs a conv shape"):
        bench.make_cases(["conv_dynamic_routing"], shapes[:1], None, "cpu")
    with pytest.raises(argparse.ArgumentTypeError, match="4x4 poses"):
        bench.make_cases(["conv_em_routing"], [bench.parse_shape(TINY_DYNAMIC)], None, "cpu")
    for bad in ("6x6:2,3,16", "2x2:1,1,16,16,3", "6x6:2,3,16,16,3,0"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_shape(bad)
    assert bench.op_name("conv-em") == "conv_em_routing"
    assert bench.op_name("conv-dynamic") == "conv_dynamic_routing"


@pytest.mark.parametrize(
    "op, spec", [("conv_em_routing", TINY_EM), ("conv_dynamic_routing", TINY_DYNAMIC)]
)
def test_inputs_and_grads_fit_the_op(op, spec):
    name, dims = bench.parse_shape(spec)
    case = bench.Case(op, name, 2, **dims)
    inputs, grad = bench.make_inputs(op, case, torch.float32, CPU, seed=1)
    assert all(t.requires_grad and t.is_leaf and t.abs().sum() > 0 for t in inputs)
    out = bench.get_impl(case, "eager")(*inputs, 2)
    outs, grads = (out, grad) if isinstance(out, tuple) else ((out,), (grad,))
    assert [o.shape for o in outs] == [g.shape for g in grads]
    assert outs[0].shape[:4] == (2, *case.conv.out_hw(), case.conv.C_out)
    again, _ = bench.make_inputs(op, case, torch.float32, CPU, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(inputs, again))


def test_per_window_is_the_window_layer():
    """per-window runs nn.ConvCapsules(routing="window") with the op's tensors: without overlap it is
    conv_em_routing (ConvCapsules' docstring), and its gradients reach every input."""
    name, dims = bench.parse_shape(TINY_EM_NO_OVERLAP)
    case = bench.Case("conv_em_routing", name, 2, **dims)
    inputs, _ = bench.make_inputs(case.op, case, torch.float64, CPU)
    pose, a = bench.get_impl(case, "per-window")(*inputs, 3)
    ref_pose, ref_a = reference.conv_em_routing(*inputs, 3, stride=3)
    torch.testing.assert_close(pose, ref_pose)
    torch.testing.assert_close(a, ref_a)
    (pose.sum() + a.sum()).backward()
    assert all(t.grad is not None for t in inputs)
    assert "per-window" in cases.UNCHECKED_IMPLS
    assert cases.impls_for("em_routing", bench.IMPLS) == ["capsroute", "eager", "compiled"]
    padded = bench.Case(
        "conv_em_routing", "p", 1, conv=bench.ConvShape(6, 6, 2, 3, 16, 16, 3, 1, 1)
    )
    assert cases.unavailable_impls(padded, CPU)["per-window"] == "nn.ConvCapsules has no padding"


def test_floor_of_the_conv_ops():
    name, dims = bench.parse_shape(TINY_DYNAMIC)
    fm = bench.floor_model(bench.Case("conv_dynamic_routing", name, 2, **dims), 4, 3)
    positions = 2 * 5 * 5
    votes = 2 * 3 * 3 * 2 * 3 * 8 * 4  # 2 flops per multiply-add of (D, Din) @ Din, K K C_in C_out
    route = 2 * 2 * 3 * 8 * 5  # 3 weighted sums and 2 agreements over C_in x C_out x D
    assert fm["flops_fwd"] == positions * (votes + route)
    inputs = (2 * 25 * 2 * 4 + 3 * 3 * 2 * 3 * 8 * 4) * 4
    assert fm["bytes_fwd"] == inputs + positions * 3 * 8 * 4
    assert fm["flops_fwd_bwd"] == 3 * fm["flops_fwd"]
    name, dims = bench.parse_shape(TINY_EM)
    fm = bench.floor_model(bench.Case("conv_em_routing", name, 1, **dims), 4, 2)
    children = 3 * 3 * 2
    assert fm["flops_fwd"] == 16 * (128 * children * 3 + children * 3 * 16 * (5 * 2 + 4))


@pytest.mark.parametrize(
    "estimates, measured, cap, want",
    [
        # 10 MiB + 3 MiB a batch element, budget 100: b = 30 fits the line, the power of two is 16
        (
            {1: 13, 2: 16},
            {1: 13, 2: 16},
            2**15,
            dict(max_batch=16, capped=False, probes=[(1, 13), (2, 16)]),
        ),
        # B = 2 estimated over the budget: the line through 0 and B = 1's peak
        ({1: 40, 2: 101}, {1: 30}, 2**15, dict(max_batch=2, probes=[(1, 30)], mb_fixed=0.0)),
        # even B = 1 estimated over the budget: nothing allocated, none fits
        ({1: 200, 2: 400}, {}, 2**15, dict(max_batch=None, method="estimate", probes=[])),
        # every batch up to the cap fits
        ({1: 1, 2: 2}, {1: 1, 2: 2}, 8, dict(max_batch=8, capped=True)),
    ],
)
def test_cpu_max_batch(estimates, measured, cap, want):
    probed = []

    def measure(b):
        probed.append(b)
        return measured[b]

    found = bench.cpu_max_batch(estimates.get, measure, cap=cap, budget_mb=100)
    assert {k: found[k] for k in want} == want
    assert probed == sorted(measured)


@pytest.mark.parametrize(
    "estimates, measured, want",
    [
        # 4 MiB + 0.01 MiB an input position, budget 100: side^2 <= 9600, side 97
        (
            {12: 5, 24: 10},
            {12: 4 + 1.44, 24: 4 + 5.76},
            dict(max_side=97, capped=False, method="extrapolated"),
        ),
        # side 24 estimated over the budget: the line through 0 and side 12's peak (0.5 a position)
        ({12: 80, 24: 320}, {12: 72}, dict(max_side=14, mb_fixed=0.0, probes=[(12, 72)])),
        # even side 12 estimated over the budget: nothing allocated
        ({12: 200, 24: 800}, {}, dict(max_side=None, method="estimate", probes=[])),
        # a line that never leaves the budget below the cap
        ({12: 1, 24: 1}, {12: 1, 24: 1}, dict(max_side=256, capped=True)),
    ],
)
def test_cpu_max_side(estimates, measured, want):
    probed = []

    def measure(side):
        probed.append(side)
        return measured[side]

    found = bench.cpu_max_side(estimates.get, measure, probes=[12, 24], cap=256, budget_mb=100)
    assert {k: found[k] for k in want} == want
    assert probed == sorted(measured)


def test_tiny_conv_run_with_max_batch(monkeypatch):
    """run_benchmarks on both conv ops at tiny shapes, without torch.compile: the records, the
    per-window row, the checks against eager, and --max-batch on the CPU on a tiny budget."""
    monkeypatch.setattr(runner, "measure_bandwidth", lambda device: 10.0)
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda device, dtype: 0.1)
    got = [
        *bench.make_cases(["conv_em_routing"], [bench.parse_shape(TINY_EM)], [2], "cpu"),
        *bench.make_cases(["conv_dynamic_routing"], [bench.parse_shape(TINY_DYNAMIC)], [2], "cpu"),
    ]
    report = bench.run_benchmarks(
        got,
        ["capsroute", "eager", "per-window"],
        device=CPU,
        iters=2,
        repeats=3,
        warmup=1,
        max_seconds=1.0,
        progress=False,
        max_batch=64,
        max_batch_budget_gb=0.01,
    )
    rows = [(r["op"], r["impl"]) for r in report["results"]]
    assert rows == [
        ("conv_em_routing", "capsroute"),
        ("conv_em_routing", "eager"),
        ("conv_em_routing", "per-window"),
        ("conv_dynamic_routing", "capsroute"),
        ("conv_dynamic_routing", "eager"),
    ]
    for r in report["results"]:
        assert "skipped" not in r, r
        assert all(r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb", "floor_ms"))
        assert r["shape"]["H"] in (5, 6) and r["shape"]["B"] == 2
        assert ("max_rel_err" in r) == (r["impl"] == "capsroute"), r["impl"]
        if r["impl"] == "capsroute":
            assert r["max_rel_err"] < 1e-3 and r["op"] in r["kernel_paths"]
    caps = report["results"][0]
    assert {"per-window_fwd_bwd", "eager_peak_mb"} <= caps["ratios"].keys()
    searched = {(m["op"], m["impl"]): m for m in report["max_batch"]}
    assert searched.keys() == set(rows)
    for m in searched.values():
        assert m["method"] == "extrapolated" and m["budget_mb"] == pytest.approx(10.24)
        assert [b for b, _ in m["probes"]] == [1, 2] and m["max_batch"] >= 1
        line = [m["mb_fixed"] + m["mb_per_batch"] * b for b in (m["max_batch"], 2 * m["max_batch"])]
        assert line[0] <= m["budget_mb"] and (m["capped"] or m["budget_mb"] < line[1])
        side = m["side_search"]
        assert [s for s, _ in side["probes"]] in ([12], [12, 24]) and m["max_side"] >= 1
        line = [
            side["mb_fixed"] + side["mb_per_position"] * s**2
            for s in (m["max_side"], m["max_side"] + 1)
        ]
        assert line[0] <= m["budget_mb"] < line[1]
    assert all(
        (r["max_batch"], r["max_side"])
        == (searched[r["op"], r["impl"]]["max_batch"], searched[r["op"], r["impl"]]["max_side"])
        for r in report["results"]
    )
    assert bench.format_table(report).splitlines()[2].endswith("max B  max side")
