"""Builds capsroute._C: the C++ CPU backend always, the CUDA kernels when a toolkit is found.

Environment: CAPSROUTE_FORCE_CUDA, CAPSROUTE_FORCE_CPU, TORCH_CUDA_ARCH_LIST, MAX_JOBS,
CAPSROUTE_CPU_ARCH and CUDA_HOME; what each does is in docs/install.md.
"""

import glob
import importlib.util
import os
import re
import sys

# nvcc is also on PATH as /usr/local/bin/nvcc on some machines, which makes torch guess
# CUDA_HOME=/usr/local where libcudart is missing; prefer the real toolkit directory.
if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")

import torch  # noqa: E402
from setuptools import find_packages, setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def env_flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes")


def want_cuda():
    if env_flag("CAPSROUTE_FORCE_CPU"):
        return False
    found = cpp_extension.CUDA_HOME is not None and torch.version.cuda is not None
    if env_flag("CAPSROUTE_FORCE_CUDA") and not found:
        raise RuntimeError(
            "CAPSROUTE_FORCE_CUDA=1 but no CUDA build of torch with a CUDA toolkit was found "
            f"(torch {torch.__version__}, CUDA_HOME={cpp_extension.CUDA_HOME})"
        )
    return found


def version():
    text = open(os.path.join(ROOT, "capsroute", "__init__.py")).read()
    return re.search(r'__version__ = "([^"]+)"', text).group(1)


def load_cpu_arch_module():
    """capsroute/_cpu_arch.py, loaded by its path: importing the package would load the unbuilt _C."""
    spec = importlib.util.spec_from_file_location(
        "capsroute_cpu_arch", os.path.join(ROOT, "capsroute", "_cpu_arch.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_cpu_arch = load_cpu_arch_module()
ARCH_OF_CAPABILITY = _cpu_arch.ARCH_OF_CAPABILITY


def cpu_arch():
    arch = os.environ.get("CAPSROUTE_CPU_ARCH", "auto")
    if arch != "auto":
        return arch
    capability = torch.backends.cpu.get_cpu_capability()
    arch = _cpu_arch.auto_arch(capability)
    if arch != ARCH_OF_CAPABILITY.get(capability):
        missing = _cpu_arch.missing_features(ARCH_OF_CAPABILITY[capability])
        print(
            f"capsroute: torch runs its {capability} kernels here, but this CPU lacks {', '.join(missing)}: "
            f"building for {arch or 'the compiler baseline'} (CAPSROUTE_CPU_ARCH sets the level)",
            file=sys.stderr,
        )
    return arch


CPU_ARCH = cpu_arch()  # None: the compiler's baseline
CPU_ARCH_NAME = CPU_ARCH or "baseline"  # as build_info() and capsroute/_build_config.py name it


def extension():
    with_cuda = want_cuda()
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    defines = [("CAPSROUTE_TORCH_VERSION", f'"{torch.__version__}"')]
    # at::parallel_for is inlined from ATen's OpenMP header: without -fopenmp it runs serially.
    cxx = ["-O3", "-fvisibility=hidden", "-fopenmp"]
    defines.append(("CAPSROUTE_CPU_ARCH", f'"{CPU_ARCH_NAME}"'))
    if CPU_ARCH:
        cxx.append(f"-march={CPU_ARCH}")
    # at::vec picks its implementation from these, as ATen's own AVX2 and AVX-512 kernels are built.
    capability = {level: cap for cap, level in ARCH_OF_CAPABILITY.items()}.get(CPU_ARCH)
    if capability:
        cxx += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    if capability == "AVX512":
        # GCC 12 flags every AVX-512 shuffle intrinsic's _mm512_undefined_ps() operand as maybe
        # uninitialised (GCC bug 105593, fixed in 13): over a thousand false warnings per build.
        cxx.append("-Wno-maybe-uninitialized")
    if not with_cuda:
        return cpp_extension.CppExtension(
            "capsroute._C",
            sources,
            define_macros=defines,
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    defines += [
        ("CAPSROUTE_WITH_CUDA", None),
        ("CAPSROUTE_CUDA_VERSION", f'"{torch.version.cuda}"'),
        ("CAPSROUTE_CUDA_ARCHS", f'"{archs}"'),
    ]
    # --resource-usage: ptxas reports each kernel's registers and spills (scripts/kernel_resources.py)
    nvcc = [
        "-O3",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-Xcompiler=-fvisibility=hidden",
        "--resource-usage",
    ]
    return cpp_extension.CUDAExtension(
        "capsroute._C",
        sources,
        define_macros=defines,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=["-fopenmp"],
    )


class BuildExtension(cpp_extension.BuildExtension):
    """Also writes capsroute/_build_config.py next to the built _C, once it is built: what the package
    must know before it loads _C (the -march level, checked against the CPU by capsroute/_cpu_arch.py)."""

    def run(self):
        super().run()
        package_dir = os.path.dirname(self.get_ext_fullpath("capsroute._C"))
        with open(os.path.join(package_dir, "_build_config.py"), "w") as f:
            f.write(
                '"""Written by setup.py when it built capsroute._C: the -march of its C++ sources."""\n'
                f"CPU_ARCH = {CPU_ARCH_NAME!r}\n"
            )


setup(
    name="capsroute",
    version=version(),
    packages=find_packages(include=["capsroute", "capsroute.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension},
)
