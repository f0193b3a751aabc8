"""The CPU instructions capsroute._C was compiled for, checked before it loads. A build made with
CAPSROUTE_CPU_ARCH=auto on an AVX-512 machine stops with an illegal instruction on a CPU without
AVX-512; this turns that into an error that says why and what to do."""
import torch

_X86_64_V3 = ("avx", "avx2", "bmi", "bmi2", "f16c", "fma3", "lzcnt")
# The features (named as torch.cpu.get_capabilities names them) that each -march level setup.py
# picks needs; any other level is not checked.
FEATURES_OF_ARCH = {
    "x86-64-v3": _X86_64_V3,
    "x86-64-v4": _X86_64_V3 + ("avx512_f", "avx512_bw", "avx512_cd", "avx512_dq", "avx512_vl"),
}


def check_cpu_arch(arch: str, capabilities=None) -> None:
    """Raises ImportError if this CPU (or `capabilities`, a mapping as torch.cpu.get_capabilities
    returns) lacks an instruction set that `arch` needs. Does nothing for other levels, or where
    torch cannot tell (a torch without get_capabilities, or cpuinfo not initialised: no ISA keys)."""
    features = FEATURES_OF_ARCH.get(arch, ())
    if not features:
        return
    if capabilities is None:
        get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # not in every torch version
        if get_capabilities is None:
            return
        capabilities = get_capabilities()
    if not any(feature in capabilities for feature in features):
        return
    missing = [feature for feature in features if not capabilities.get(feature, False)]
    if missing:
        raise ImportError(
            f"capsroute._C was compiled with -march={arch}, and this CPU lacks {', '.join(missing)}: "
            "its kernels would stop with an illegal instruction. Rebuild capsroute on this machine "
            "(pip install --no-build-isolation -e .), or build with CAPSROUTE_CPU_ARCH=x86-64 for any "
            "x86-64 CPU.")
