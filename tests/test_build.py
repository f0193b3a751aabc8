import platform
import subprocess
import sys

import pytest
import torch

import capsroute
from capsroute._build_config import CPU_ARCH
from capsroute._cpu_arch import FEATURES_OF_ARCH, check_cpu_arch
from capsroute.ops import SCHEMA_OPS


def test_build_info():
    info = capsroute.build_info()
    assert info["version"] == capsroute.__version__
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_archs"]


def test_the_op_list_names_every_registered_op():
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("capsroute::")}
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


@pytest.mark.skipif(not hasattr(torch.cpu, "get_capabilities") or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs torch.cpu.get_capabilities on an x86-64 CPU")
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
        assert run.returncode != 0 and f"compiled with -march={CPU_ARCH}, and this CPU lacks" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
