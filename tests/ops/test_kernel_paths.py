"""The kernel-path record (capsroute.last_kernel_path) and where the benchmark reports it."""

import pytest
import torch

import capsroute
from capsroute.bench.cases import make_cases, parse_shape
from capsroute.bench.report import format_table, kernel_path_lines
from capsroute.bench.runner import run_benchmarks


def test_the_record_names_the_path_each_direction_ran():
    votes = torch.randn(2, 5, 3, 4, requires_grad=True)
    capsroute.clear_kernel_paths()
    assert capsroute.last_kernel_path("dynamic_routing") == ""
    v = capsroute.dynamic_routing(votes)
    assert capsroute.last_kernel_path("dynamic_routing", "forward") == "cpu"
    assert capsroute.last_kernel_path("dynamic_routing", "backward") == ""
    v.sum().backward()
    assert capsroute.last_kernel_path("dynamic_routing", "backward") == "cpu"
    with pytest.raises(ValueError, match="op must be one of"):
        capsroute.last_kernel_path("routing")
    with pytest.raises(ValueError, match="direction must be"):
        capsroute.last_kernel_path("squash", "sideways")


def test_the_benchmark_records_the_path_each_capsroute_row_ran():
    cases = make_cases(["dynamic_routing", "em_routing"], [parse_shape("20,3,4")], [2], "cpu")
    report = run_benchmarks(
        cases,
        ("capsroute", "eager"),
        device=torch.device("cpu"),
        repeats=2,
        warmup=1,
        progress=False,
    )
    for r in report["results"]:
        if r["impl"] == "capsroute":
            assert r["kernel_paths"] == {r["op"]: {"forward": "cpu", "backward": "cpu"}}
        else:
            assert "kernel_paths" not in r  # eager PyTorch runs no capsroute op
    assert "kernel paths of" not in format_table(report)  # the CPU's one path goes without saying


def test_the_table_says_which_cuda_path_each_row_ran():
    rows = [
        {
            "op": "dense_capsules",
            "shape_name": "mnist",
            "shape": {"B": 512},
            "impl": "capsroute",
            "kernel_paths": {
                "dense_capsules": {
                    "forward": "dense-v2-gemm+v2-cluster",
                    "backward": "dense-v2-gemm+v2-warp-rows",
                }
            },
        },
        {"op": "dense_capsules", "shape_name": "mnist", "shape": {"B": 512}, "impl": "eager"},
    ]
    assert kernel_path_lines(rows) == [
        "kernel paths of dense_capsules mnist B=512 capsroute: "
        "dense_capsules dense-v2-gemm+v2-cluster / dense-v2-gemm+v2-warp-rows"
    ]
