"""capsroute: fused routing kernels for capsule networks, as PyTorch operators."""
__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from ._build_config import CPU_ARCH  # written by setup.py at build time
except ModuleNotFoundError as error:
    raise ImportError("capsroute is not built here, or was built by an older setup.py: run "
                      "`pip install --no-build-isolation -e .` (README, Install)") from error
from ._cpu_arch import check_cpu_arch

check_cpu_arch(CPU_ARCH)  # before _C loads: a clear error instead of an illegal instruction

from . import _C  # noqa: E402  (registers the capsroute:: operators)
from .ops import dense_capsules, dynamic_routing, dynamic_routing_coupling, em_routing, em_routing_pose, squash


def build_info():
    """How the extension was built: version, torch it was built against, CUDA kernels and archs."""
    info = dict(_C.build_info())
    info["version"] = __version__
    return info


def cuda_kernel_set() -> str:
    """The CUDA kernel set the ops run, from the environment variable CAPSROUTE_CUDA_KERNELS,
    read at every call: "v1" (the default: block kernels, a block per element or per range of
    its rows) or "v2" (dense_capsules' votes as batched GEMMs per chunk of the batch, the routing
    rows a warp each, on sm_90 an element per thread-block cluster, EM in row ranges). Both sets
    stay until a GPU has measured them; docs/kernels.md says which path runs when. Raises
    RuntimeError on any other value."""
    return _C.cuda_kernel_set()


__all__ = ["build_info", "cuda_kernel_set", "dense_capsules", "dynamic_routing", "dynamic_routing_coupling", "em_routing", "em_routing_pose", "squash"]
