"""capsroute: fused routing kernels for capsule networks, as PyTorch operators."""

__version__ = "0.1.0"

import torch  # noqa: F401  (loads libtorch before the extension)

try:
    from ._build_config import CPU_ARCH  # written by setup.py at build time
except ModuleNotFoundError as error:
    raise ImportError(
        "capsroute is not built here, or was built by an older setup.py: run "
        "`pip install --no-build-isolation -e .` (README, Install)"
    ) from error
from ._cpu_arch import check_cpu_arch

check_cpu_arch(CPU_ARCH)  # before _C loads: a clear error instead of an illegal instruction

# _C registers the capsroute:: operators; nn and models are reachable after `import capsroute`.
from . import _C, models, nn  # noqa: E402
from .ops import (
    OPS,
    conv_dynamic_routing,
    conv_em_routing,
    dense_capsules,
    dense_inverted_attention_routing,
    dense_inverted_attention_routing_pose,
    dense_self_attention_routing,
    dynamic_routing,
    dynamic_routing_coupling,
    em_routing,
    em_routing_pose,
    inverted_attention_routing,
    inverted_attention_routing_coupling,
    reference,
    self_attention_routing,
    self_attention_routing_coupling,
    squash,
)


def build_info():
    """How the extension was built: version, torch it was built against, CUDA kernels and archs."""
    info = dict(_C.build_info())
    info["version"] = __version__
    return info


def last_kernel_path(op: str, direction: str = "forward") -> str:
    """The kernel path that the last call of `op` ran in `direction` ("forward" or "backward") in
    this process, as the dispatch decided at run time, fallbacks included: "cpu" on the CPU; on CUDA
    "cuda" (squash), "v2-warp-rows", "v2-cluster", "v2-block" (dynamic_routing),
    "dense-v2-gemm+<routing paths of its chunks, comma-separated>" (the dense_ ops), "em-column-lanes"
    or "em-row-ranges" (the EM ops), "conv-em-parent-child" (conv_em_routing), "conv-gemm+<routing paths>"
    (conv_dynamic_routing); docs/kernels.md says which runs when. "" if
    the op has not run in that direction since clear_kernel_paths()."""
    if op not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    return _C.last_kernel_path(op, direction)


def clear_kernel_paths() -> None:
    """Forgets every recorded kernel path (last_kernel_path)."""
    _C.clear_kernel_paths()


def set_cpu_cache_limit(nbytes: int) -> None:
    """The most bytes of freed CPU output blocks capsroute keeps for its next calls (default 1 GiB;
    0: none kept, each freed at once). The CPU ops take their outputs of 1 MiB and more (the vote
    gradient above all) from blocks their earlier outputs freed, so that a training loop does not
    fault the same memory in from the kernel on every call (docs/kernels.md, "CPU"); blocks beyond
    a lowered limit are freed now. It changes no other allocation of the process."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    _C.set_cpu_cache_limit(nbytes)


def empty_cpu_cache() -> None:
    """Frees the CPU output blocks capsroute keeps (set_cpu_cache_limit); tensors alive keep theirs."""
    _C.empty_cpu_cache()


def cpu_cache_stats() -> dict:
    """The CPU output cache (set_cpu_cache_limit): limit_bytes, cached_bytes and cached_blocks kept
    now, and since the process started, hits (outputs given a kept block) and misses (allocated)."""
    return dict(_C.cpu_cache_stats())


__all__ = [
    "build_info",
    "clear_kernel_paths",
    "cpu_cache_stats",
    "conv_dynamic_routing",
    "conv_em_routing",
    "dense_capsules",
    "dense_inverted_attention_routing",
    "dense_inverted_attention_routing_pose",
    "dense_self_attention_routing",
    "dynamic_routing",
    "dynamic_routing_coupling",
    "em_routing",
    "em_routing_pose",
    "empty_cpu_cache",
    "inverted_attention_routing",
    "inverted_attention_routing_coupling",
    "last_kernel_path",
    "models",
    "nn",
    "ops",
    "reference",
    "self_attention_routing",
    "self_attention_routing_coupling",
    "set_cpu_cache_limit",
    "squash",
]
