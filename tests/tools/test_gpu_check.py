"""scripts/gpu_check.sh, the check a user with a GPU runs: on the CPU, that it refuses what it cannot
do in one line, before building anything."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_help_names_every_stage():
    run = gpu_check("--help")
    assert run.returncode == 0
    stages = ("doctor", "tests", "sweep", "sanitizers", "bench", "profile", "ncu")
    for word in (*stages, "--time-limit"):
        assert word in run.stdout


@pytest.mark.parametrize(
    "args, words",
    [
        (["bench", "nope"], "unknown stage nope"),
        (["--time-limit", "soon"], "--time-limit must be whole seconds"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(args, words):
    run = gpu_check(*args)
    assert run.returncode == 2 and words in run.stderr and len(run.stderr.splitlines()) == 1


def test_no_gpu_is_refused_before_the_build(tmp_path):
    if subprocess.run(["sh", "-c", "nvidia-smi -L"], capture_output=True).returncode == 0:
        pytest.skip("a GPU is here")
    run = gpu_check("doctor", "--out", str(tmp_path / "out"))
    assert run.returncode == 1 and "no NVIDIA GPU" in run.stderr
    assert not (tmp_path / "out").exists()
