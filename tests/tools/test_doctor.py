"""`capsroute doctor`. CI runs the doctor on the CPU through these tests; on a GPU the cuda-marked
one runs it on every CUDA path."""

import json
import re

import pytest
import torch

import capsroute
from capsroute import doctor, reference, testing
from helpers import HAS_CUDA


def result_rows(out: str) -> list[list[str]]:
    """The rows of the doctor's table (op, dtype, ...), split on runs of two or more spaces."""
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith("op "))
    rows = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


# The full run adds the canonical shapes (MNIST's I = 1152: several of the CPU kernels' row
# blocks), minutes on 2 cores; the quick one tests the reporting in the default loop.
@pytest.mark.parametrize("quick", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_doctor_on_the_cpu_passes_and_prints_what_ran(capsys, tmp_path, quick):
    json_path = tmp_path / "doctor.json"
    argv = ["--device", "cpu", "--no-progress", "--json", str(json_path)]
    assert doctor.main(argv + ["--quick"] * quick) == 0
    out = capsys.readouterr().out
    rows = result_rows(out)
    checks = [
        (check, dtype, label)
        for check in testing.OPS
        for dtype in testing.DTYPES
        for label in check.shapes(quick=quick)
    ]
    assert len(rows) == len(checks)
    assert {row[0] for row in rows} == set(capsroute.ops.OPS)
    assert {row[1] for row in rows} == {"float32", "float64", "float16", "bfloat16"}
    assert all(row[4] == "cpu" and row[-1] == "ok" for row in rows), rows
    for check in testing.OPS if not quick else ():  # a timing against eager for every op
        assert any(
            line.startswith(check.name) and " cpu/cpu" in line for line in out.splitlines()
        ), check.name
    assert "0 failed" in out
    report = json.loads(json_path.read_text())
    assert report["kind"] == "doctor" and len(report["results"]) == len(checks)


def test_a_mismatch_fails_the_doctor(monkeypatch, capsys):
    right = reference.em_routing_pose  # (no other reference op calls it)
    monkeypatch.setattr(
        reference, "em_routing_pose", lambda *args, **kw: tuple(o * 1.5 for o in right(*args, **kw))
    )
    assert doctor.main(["--device", "cpu", "--quick", "--no-progress"]) == 1
    rows = result_rows(capsys.readouterr().out)
    assert all(("FAIL: mismatch" in row[-1]) == (row[0] == "em_routing_pose") for row in rows), rows


def test_a_path_that_did_not_run_fails_the_doctor(monkeypatch, capsys):
    monkeypatch.setattr(capsroute, "last_kernel_path", lambda op, direction="forward": "v2-block")
    assert doctor.main(["--device", "cpu", "--quick", "--no-progress"]) == 1
    rows = result_rows(capsys.readouterr().out)
    assert rows and all(row[-1] == "FAIL: forced cpu, but another path ran" for row in rows), rows


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_doctor_on_cuda_runs_every_path(capsys):
    assert doctor.main(["--device", "cuda", "--quick", "--no-progress"]) == 0
    rows = result_rows(capsys.readouterr().out)
    ran = {path for row in rows for path in row[4].split("/")}
    expected = {
        "cuda",
        "v2-warp-rows",
        "v2-block",
        "dense-v2-gemm+v2-warp-rows",
        "dense-v2-gemm+v2-block",
        "em-row-ranges",
        "em-column-lanes",
        "conv-em-parent-child",
        "conv-gemm+v2-block",  # the quick conv_dynamic_routing shapes: J = 33, D = 32
    }
    if torch.cuda.get_device_capability() >= (9, 0):
        expected |= {"v2-cluster", "dense-v2-gemm+v2-cluster"}
    assert expected <= ran, expected - ran


def test_timing_table_aligns_long_cases_and_flags_slower_rows():
    rows = [
        dict(case="squash B=2", capsroute_ms=1.0, eager_ms=2.0, speedup=2.0, path="cpu/cpu"),
        dict(case="x" * 45, capsroute_ms=4.0, eager_ms=1.0, speedup=0.25, path="cpu/cpu"),
    ]
    header, fast, slow = doctor.format_timings(rows).splitlines()
    column_end = header.index("capsroute ms") + len("capsroute ms")  # right-aligned numbers
    assert fast.index("1.000") + 5 == slow.index("4.000") + 5 == column_end
    assert not fast.endswith("slower than eager") and slow.endswith("slower than eager")


def test_capsroute_doctor_is_a_command(capsys):
    from capsroute import cli

    assert cli.main(["doctor", "--device", "cpu", "--quick", "--no-progress"]) == 0
    assert "0 failed" in capsys.readouterr().out
