"""scripts/gpu_profile.py runs on a GPU machine whose minutes are scarce: check here that its cases
exist and that a profile of small ones is written, a line per case with the paths it ran."""

import pytest
import torch

from capsroute.bench.model_bench import MODEL_KERNELS
from capsroute.bench.timing import gpu_busy_ms, time_samples
from helpers import HAS_CUDA, load_script


def test_every_gpu_case_is_a_benchmark_case():
    module = load_script("gpu_profile")
    for op, shape, B in module.CASES:
        case = module.make_case(op, shape, B, "cuda")
        assert (case.op, case.B) == (op, B)


def test_quick_profile_on_cpu(tmp_path):
    module = load_script("gpu_profile")
    assert module.main(["--device", "cpu", "--quick", "--steps", "1", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "profile.txt").read_text().splitlines()
    summaries = lines[: len(module.QUICK_CASES)]
    for (op, shape, B), line in zip(module.QUICK_CASES, summaries):
        label = module.make_case(op, shape, B, "cpu").label()
        paths = (
            ", ".join(f"{name} cpu/cpu" for name in MODEL_KERNELS[op])
            if op in MODEL_KERNELS
            else "cpu/cpu"
        )
        assert line.startswith(f"{label}: ") and line.endswith(f"path {paths}"), line
    assert sum(line.startswith("== ") for line in lines) == len(module.QUICK_CASES)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_gpu_busy_time_is_within_the_step():
    """The profiled kernel time of a step of matmuls is positive and within the step's time."""
    a = torch.randn(2048, 2048, device="cuda")

    def step():
        return a @ a @ a

    busy = gpu_busy_ms(step, torch.device("cuda"))
    wall = min(time_samples(step, torch.device("cuda"), repeats=10))
    assert 0 < busy <= wall * 1.05, (busy, wall)
