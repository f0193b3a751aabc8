"""The CUDA routing kernels' logic without a GPU: tests/emulator/routing_test.cpp runs the device
code of csrc/cuda/routing_kernels.cuh on the host (a std::thread per CUDA thread, barriers for
__syncthreads and the warp shuffles, see tests/emulator/emu.h) against the CPU backend's element
code, both launch paths (a block per element, and rows split over blocks). CI has no GPU, so this
is what checks the kernels' arithmetic and indexing there; the cuda-marked tests check them on a
GPU."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

EMULATOR = Path(__file__).parent / "emulator"


@pytest.fixture(scope="module")
def routing_test(tmp_path_factory):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (CXX or g++) on PATH")
    exe = tmp_path_factory.mktemp("emulator") / "routing_test"
    build = subprocess.run([compiler, "-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-unknown-pragmas",
                            str(EMULATOR / "routing_test.cpp"), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, f"compiling the emulator test failed:\n{build.stderr}"
    return exe


def test_cuda_routing_kernels_match_the_cpu_code(routing_test):
    run = subprocess.run([str(routing_test)], capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0 and run.stdout.strip().endswith("all passed"), run.stdout[-4000:] + run.stderr
