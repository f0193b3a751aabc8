"""scripts/gpu_profile.py runs on a GPU machine whose minutes are scarce: check here that its cases
exist and that a profile of small ones is written, a line per case with the path it ran."""

from capsroute.bench.cases import make_cases, parse_shape
from helpers import load_script


def test_every_gpu_case_is_a_benchmark_case():
    for op, shape, B in load_script("gpu_profile").CASES:
        (case,) = make_cases([op], [parse_shape(shape)], [B], "cuda")
        assert (case.op, case.B) == (op, B)


def test_quick_profile_on_cpu(tmp_path):
    module = load_script("gpu_profile")
    assert module.main(["--device", "cpu", "--quick", "--steps", "1", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "profile.txt").read_text().splitlines()
    summaries = lines[: len(module.QUICK_CASES)]
    for (op, shape, B), line in zip(module.QUICK_CASES, summaries):
        assert line.startswith(f"{op} {shape} B={B}: ") and line.endswith("path cpu/cpu"), line
    assert sum(line.startswith("== ") for line in lines) == len(module.QUICK_CASES)
