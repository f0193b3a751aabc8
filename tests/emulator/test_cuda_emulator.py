"""The CUDA kernels' logic without a GPU: tests/emulator runs the device code of csrc/cuda (the
agreement_*, em_* and conv_em_* kernels) on the host (a thread per CUDA thread, barriers for
__syncthreads and the warp shuffles, see tests/emulator/emu.h)
against the CPU backend's element code: every launch path of dynamic routing (a block per element,
rows split over blocks, a warp per part of an element's rows, and the forward and backward an
element per cluster of blocks with the votes in shared memory), float16/bfloat16 storage included
(through c10::Half/BFloat16 from torch's headers), and the EM forward and backward
(em_routing_pose's in batch chunks); the block kernels under the attention routings' rules
(agreement_rules_test, against a double-precision reference of the rule's loop and its reverse
mode);
conv_em_routing's forward and backward (conv_em_test, against a long double reference
differentiated on a tape); all run by the very launch sequences the ops use
(csrc/cuda/agreement_sequence.cuh, em_sequence.cuh and conv_em_sequence.cuh, given a host launcher
instead of the CUDA stream one), with misaligned vector loads caught (UBSan's alignment check); and
a ThreadSanitizer build of the same programs for data races (missing barriers). CI has no GPU, so
this is what checks the kernels' arithmetic, indexing and barriers there; the cuda-marked tests
check them on a GPU."""

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

EMULATOR = Path(__file__).resolve().parent


# Compiled programs are kept in build/emulator/ under a hash of everything that goes into them, so
# the default loop compiles them only after a change to the kernels, the CPU code or the emulator
# (a clean clone, as CI's, compiles every one).
CACHE = EMULATOR.parents[1] / "build" / "emulator"
SOURCES = [*sorted((EMULATOR.parents[1] / "csrc").rglob("*")), *sorted(EMULATOR.glob("*.[ch]*"))]


@pytest.fixture(scope="module")
def build():
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (CXX or g++) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout

    @functools.cache  # one build serves both runs
    def compile_program(name: str, thread_sanitizer: bool = False) -> Path:
        # Without TSan, UBSan's alignment check: a 16-byte vector load from an address off 16 bytes
        # (a row stride vector_capsules missed) is an error there, which x86 would let pass.
        alignment = ["-fsanitize=alignment", "-fno-sanitize-recover=alignment"]
        flags = ["-O1", "-g", "-fsanitize=thread"] if thread_sanitizer else ["-O2", *alignment]
        # torch's headers (header-only, nothing of torch is linked): at::vec for the CPU element code
        # (its portable implementation here), c10::Half / c10::BFloat16 for the half-precision cases.
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        command = [compiler, "-std=c++20", *flags, "-pthread", "-Wall", "-Wno-unknown-pragmas"]
        command += [*includes, str(EMULATOR / f"{name}.cpp")]
        key = hashlib.sha256("\0".join([version, torch.__version__, *command]).encode())
        for path in SOURCES:
            if path.is_file():
                key.update(path.read_bytes())
        exe = CACHE / key.hexdigest()[:16] / (name + ("-tsan" if thread_sanitizer else ""))
        if exe.is_file():
            return exe
        for stale in CACHE.glob("*"):  # programs of sources that have changed since
            if stale != exe.parent:
                shutil.rmtree(stale, ignore_errors=True)
        exe.parent.mkdir(parents=True, exist_ok=True)
        partial = exe.with_suffix(".partial")  # a compile cut off leaves no program behind
        result = subprocess.run([*command, "-o", str(partial)], capture_output=True, text=True)
        assert result.returncode == 0, (
            f"compiling tests/emulator/{name}.cpp failed:\n{result.stderr}"
        )
        partial.rename(exe)
        return exe

    return compile_program


# A program's run may take this long: the full runs take minutes on an idle 2-core machine, and
# more when other processes share it.
TIMEOUT_S = 2400
PROGRAMS = ["agreement_test", "agreement_rules_test", "em_test", "conv_em_test"]

# The default loop runs the programs' small workload without the sanitizer: every kernel once on a
# small shape, in seconds (their quick mode takes minutes on 2 cores). The full run is slow.
EVERY_KERNEL_ONCE = pytest.param("small", id="every-kernel-once")


@pytest.mark.parametrize("mode", [EVERY_KERNEL_ONCE, pytest.param("full", marks=pytest.mark.slow)])
@pytest.mark.parametrize("program", PROGRAMS)
def test_cuda_kernels_match_the_cpu_code(build, program, mode):
    run = subprocess.run(
        [str(build(program)), mode], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("all passed"), (
        run.stdout[-4000:] + run.stderr
    )


# agreement_test's small workload in two processes (its usage line says why): the cluster kernels'
# launches of 4096 threads take most of the time.
TSAN_RUNS = [
    *(["agreement_test", part] for part in ("blocks", "clusters")),
    *([program] for program in PROGRAMS[1:]),
]


@pytest.mark.slow
@pytest.mark.parametrize("program_and_part", TSAN_RUNS, ids=["-".join(run) for run in TSAN_RUNS])
def test_cuda_kernels_have_no_data_race(build, program_and_part):
    """The same kernels under ThreadSanitizer: every emulated CUDA thread is a thread it follows, so a
    missing __syncthreads or a shared-memory slot two threads write shows as a data race. The small
    mode runs every kernel once on a small shape (a TSan build is 5-15x slower)."""
    program, *part = program_and_part
    exe = build(program, thread_sanitizer=True)
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66"}
    run = subprocess.run(
        [str(exe), "small", *part], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]
    assert run.returncode == 0 and run.stdout.strip().endswith("all passed"), (
        run.stdout[-4000:] + run.stderr[-2000:]
    )
