import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import capsroute
from capsroute._build_config import CPU_ARCH
from capsroute._cpu_arch import FEATURES_OF_ARCH, auto_arch, check_cpu_arch
from capsroute.ops import SCHEMA_OPS

ROOT = Path(__file__).resolve().parents[2]


def test_build_info():
    info = capsroute.build_info()
    assert info["version"] == capsroute.__version__
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_archs"]


def test_the_op_list_names_every_registered_op():
    registered = {
        name for name in torch._C._dispatch_get_all_op_names() if name.startswith("capsroute::")
    }
    assert registered == {f"capsroute::{op}" for op in SCHEMA_OPS}


def test_every_op_has_cpu_kernels_and_cuda_kernels_when_built_with_cuda():
    for op in SCHEMA_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CPU"), op
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CUDA")
        assert has_cuda == capsroute.build_info()["cuda"], op


def test_the_build_config_and_the_extension_agree_on_the_cpu_arch():
    assert capsroute.build_info()["cpu_arch"] == CPU_ARCH


@pytest.mark.parametrize("arch", sorted(FEATURES_OF_ARCH))
def test_check_cpu_arch_names_each_missing_instruction_set(arch):
    features = FEATURES_OF_ARCH[arch]
    check_cpu_arch(arch, dict.fromkeys(features, True))
    for feature in features:
        with pytest.raises(ImportError, match=f"-march={arch}, and this CPU lacks {feature}:"):
            check_cpu_arch(arch, {**dict.fromkeys(features, True), feature: False})


def test_check_cpu_arch_passes_levels_it_does_not_know_and_cpus_torch_cannot_read():
    for arch in ("baseline", "x86-64", "native"):
        check_cpu_arch(arch, {})
    for arch in FEATURES_OF_ARCH:  # cpuinfo not initialised: torch reports only the architecture
        check_cpu_arch(arch, {"architecture": "x86_64"})


@pytest.mark.skipif(
    not hasattr(torch.cpu, "get_capabilities") or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs torch.cpu.get_capabilities on an x86-64 CPU",
)
def test_the_feature_names_are_torchs():
    capabilities = torch.cpu.get_capabilities()
    for arch, features in FEATURES_OF_ARCH.items():
        assert set(features) <= set(capabilities), (arch, set(features) - set(capabilities))


def test_import_refuses_a_cpu_without_the_build_instructions():
    """The check runs on import, before _C loads: a CPU that reports every checked feature absent."""
    absent = sorted({feature for features in FEATURES_OF_ARCH.values() for feature in features})
    script = f"import torch; torch.cpu.get_capabilities = lambda: dict.fromkeys({absent!r}, False); import capsroute"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if CPU_ARCH in FEATURES_OF_ARCH:
        assert (
            run.returncode != 0
            and f"compiled with -march={CPU_ARCH}, and this CPU lacks" in run.stderr
        )
    else:
        assert run.returncode == 0, run.stderr


def test_auto_arch_is_the_highest_level_up_to_torchs_that_the_cpu_can_run():
    v3, v4 = (dict.fromkeys(FEATURES_OF_ARCH[arch], True) for arch in ("x86-64-v3", "x86-64-v4"))
    assert auto_arch("AVX512", v4) == "x86-64-v4"
    assert auto_arch("AVX2", v4) == "x86-64-v3"
    assert auto_arch("AVX512", {**v4, "avx512_cd": False}) == "x86-64-v3"
    for feature in FEATURES_OF_ARCH["x86-64-v3"]:  # a VM reporting AVX2 and hiding BMI, F16C, ...
        assert auto_arch("AVX512", {**v4, feature: False}) is None
        assert auto_arch("AVX2", {**v3, feature: False}) is None
    assert auto_arch("DEFAULT", v4) is None
    assert (
        auto_arch("AVX512", {"architecture": "x86_64"}) == "x86-64-v4"
    )  # cannot read: torch's level


def test_setup_falls_back_a_level_on_a_cpu_that_hides_an_instruction_set():
    """setup.py's CAPSROUTE_CPU_ARCH=auto on a CPU that reports everything but BMI: auto_arch's
    level (the baseline where torch runs AVX2 or AVX-512 kernels), said on stderr."""
    hidden = {**dict.fromkeys(FEATURES_OF_ARCH["x86-64-v4"], True), "bmi": False}
    code = (
        f"import sys, torch; torch.cpu.get_capabilities = lambda: {hidden!r}; "
        "sys.argv = ['setup.py', '--version']; import setup; print(setup.CPU_ARCH)"
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("CAPSROUTE_CPU_ARCH", "CAPSROUTE_FORCE_CUDA")
    }
    env["CAPSROUTE_FORCE_CPU"] = "1"  # only the -march choice is under test, not the CUDA toolkit
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    capability = torch.backends.cpu.get_cpu_capability()
    assert run.stdout.split()[-1] == str(auto_arch(capability, hidden))
    if capability in ("AVX2", "AVX512"):
        said = f"torch runs its {capability} kernels here, but this CPU lacks bmi: building for the compiler baseline"
        assert said in run.stderr
        assert "CAPSROUTE_CPU_ARCH" in run.stderr
