"""scripts/ncu_profile.py: its cases are benchmark cases, and its summary reads ncu's raw page (two
header rows, units that vary by column) into a table a case, split at the spin kernels."""

import csv

import pytest

from capsroute.bench.cases import make_cases, parse_shape
from helpers import HAS_CUDA, load_script

ncu_profile = load_script("ncu_profile")


@pytest.mark.parametrize("spec", ncu_profile.CASES)
def test_every_case_is_a_benchmark_case(spec):
    op, shape, B, env = ncu_profile.parse_case(spec)
    (case,) = make_cases([op], [parse_shape(shape)], [B], "cuda")
    assert (case.op, case.B) == (op, B)
    assert all(name.startswith("CAPSROUTE_") for name, _ in env)


def test_switches_of_a_case_are_parsed():
    assert ncu_profile.parse_case("em_routing|em-conv|2304|CAPSROUTE_EM_LANES=capsule,A=1=2") == (
        "em_routing",
        "em-conv",
        2304,
        [["CAPSROUTE_EM_LANES", "capsule"], ["A", "1=2"]],
    )


def write_raw_page(path):
    metrics = {  # metric: (unit, spin kernel's value, routing kernel's value)
        "launch__grid_size": ("", "1", "4,096"),
        "gpu__time_duration.sum": ("ms", "0.002", "1.5"),
        "dram__bytes_read.sum": ("Gbyte", "0", "0.377"),
        "dram__bytes_write.sum": ("Mbyte", "0", "3.5"),
        **{m: ("%", "1", "25") for _, m in ncu_profile.COLUMNS},
        "smsp__inst_executed.sum": ("inst", "151", "267,500,000"),
        "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": ("sector", "0", "640"),
        "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": ("", "0", "20"),
        "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": ("sector", "0", "8"),
        "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": ("", "0", "2"),
        f"{ncu_profile.STALL}wait_per_issue_active.ratio": ("", "0", "2.75"),
        f"{ncu_profile.STALL}barrier_per_issue_active.ratio": ("", "0", "0.9"),
    }
    kernels = [
        ("0", "at::cuda::spin_kernel(long)", 1),
        ("1", "void capsroute::cuda::routing_forward_cluster_kernel<float>(float const*)", 2),
        ("2", "void at::native::vectorized_elementwise_kernel<4>(int)", 2),
    ]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["ID", "Kernel Name", *metrics])
        w.writerow(["", "", *(unit for unit, *_ in metrics.values())])
        for kid, name, which in kernels:
            w.writerow([kid, name, *(values[which] for values in metrics.values())])


def test_summary_reads_the_raw_page(tmp_path, capsys):
    write_raw_page(tmp_path / "raw.csv")
    (tmp_path / "run.log").write_text(
        "==PROF== Connected\nncu case: dynamic_routing|mnist|512 (v2-cluster / v2-cluster)\n"
    )
    assert ncu_profile.summary(tmp_path / "raw.csv", tmp_path / "run.log") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "### dynamic_routing|mnist|512 (v2-cluster / v2-cluster)"
    (row,) = [line for line in lines if line.startswith("| routing")]  # torch's kernels left out
    assert row == (
        "| routing_forward_cluster_kernel | 4,096 | 1500.0 | 377 / 4 | 25 | 25 | 25 | 25 | 267.5 "
        "| 32.0 / 4.0 | wait 2.8, barrier 0.9 |"
    )


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is here")
def test_run_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="no GPU"):
        ncu_profile.main(["run", "dynamic_routing|mnist|2"])
