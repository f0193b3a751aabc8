"""The CPU instructions capsroute._C is compiled for: the level setup.py's CAPSROUTE_CPU_ARCH=auto
picks, and the check before _C loads. A build made on an AVX-512 machine stops with an illegal
instruction on a CPU without AVX-512; the check turns that into an error that says why and what to
do. setup.py loads this file by its path (before capsroute is built): it imports only torch."""

from __future__ import annotations

import torch

# torch's CPU capability -> the -march level of the same instructions, highest first.
ARCH_OF_CAPABILITY = {"AVX512": "x86-64-v4", "AVX2": "x86-64-v3"}

_X86_64_V3 = ("avx", "avx2", "bmi", "bmi2", "f16c", "fma3", "lzcnt")
# The features (named as torch.cpu.get_capabilities names them) that each -march level setup.py
# picks needs; any other level is not checked.
FEATURES_OF_ARCH = {
    "x86-64-v3": _X86_64_V3,
    "x86-64-v4": _X86_64_V3 + ("avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl"),
}


def missing_features(arch: str, capabilities=None) -> list[str]:
    """The instruction sets `arch` needs that this CPU (or `capabilities`, a mapping as
    torch.cpu.get_capabilities returns) lacks. Empty for other levels, or where torch cannot tell
    (a torch without get_capabilities, or cpuinfo not initialised: no ISA keys)."""
    features = FEATURES_OF_ARCH.get(arch, ())
    if not features:
        return []
    if capabilities is None:
        get_capabilities = getattr(
            torch.cpu, "get_capabilities", None
        )  # not in every torch version
        if get_capabilities is None:
            return []
        capabilities = get_capabilities()
    if not any(feature in capabilities for feature in features):
        return []
    return [feature for feature in features if not capabilities.get(feature, False)]


def check_cpu_arch(arch: str, capabilities=None) -> None:
    """Raises ImportError if this CPU (or `capabilities`) lacks an instruction set that `arch` needs."""
    missing = missing_features(arch, capabilities)
    if missing:
        raise ImportError(
            f"capsroute._C was compiled with -march={arch}, and this CPU lacks {', '.join(missing)}: "
            "its kernels would stop with an illegal instruction. Rebuild capsroute on this machine "
            "(pip install --no-build-isolation -e .), or build with CAPSROUTE_CPU_ARCH=x86-64 for any "
            "x86-64 CPU."
        )


def auto_arch(capability: str, capabilities=None) -> str | None:
    """The level CAPSROUTE_CPU_ARCH=auto builds for, given torch's CPU capability ("AVX512",
    "AVX2", ...): the highest level up to that of torch's own kernels whose instruction sets this
    CPU (or `capabilities`) has all of. A virtual machine can report AVX2 and hide BMI or F16C, and
    import would refuse a build for that CPU. None: the compiler's baseline."""
    levels = list(ARCH_OF_CAPABILITY.values())
    if capability not in ARCH_OF_CAPABILITY:
        return None
    for level in levels[levels.index(ARCH_OF_CAPABILITY[capability]) :]:
        if not missing_features(level, capabilities):
            return level
    return None
