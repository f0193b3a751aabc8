"""What a benchmark or training record says about its run (commit, device, CPU), the device a run
uses, and the atomic file writes both commands make. A leaf: it imports nothing from capsroute, so
the benchmark, the trainer and their figures can all use it without importing each other.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

_CHECKOUT = Path(__file__).resolve().parents[2]  # the repository root when run from a checkout


def command_line(program: str, argv: list[str] | None) -> str:
    """The command as typed, for a record: program and argv (sys.argv[1:] when None), shell-quoted.
    Under torchrun, the torchrun line that started this process (its parent) where the system
    shows it (Linux), else one that starts the same processes."""
    command = f"{program} {shlex.join(sys.argv[1:] if argv is None else argv)}"
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return command
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return shlex.join(f.read().decode().rstrip("\0").split("\0"))
    except OSError:
        nodes, per_node = (
            os.environ.get("GROUP_WORLD_SIZE", "1"),
            os.environ.get("LOCAL_WORLD_SIZE", "1"),
        )
        return f"torchrun --nnodes {nodes} --nproc-per-node {per_node} -m {command.replace(' ', '.', 1)}"


def _git(*args, cwd=None) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def git_toplevel(cwd=None) -> Path | None:
    """The root of the git checkout that `cwd` (default: the current directory) is in, or None."""
    top = _git("rev-parse", "--show-toplevel", cwd=cwd)
    return Path(top) if top else None


def git_commit() -> str:
    """HEAD of the checkout capsroute is imported from, + "-dirty" when tracked files differ from it;
    "unknown" when capsroute is not imported from a checkout (a non-editable install)."""
    if git_toplevel(_CHECKOUT) != _CHECKOUT:
        return "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", cwd=_CHECKOUT)
    return _git("rev-parse", "HEAD", cwd=_CHECKOUT) + ("-dirty" if dirty else "")


def short_commit(commit: str) -> str:
    """git_commit()'s value for titles and file names: 7 hex digits, keeping "-dirty"."""
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def device_name(device: torch.device) -> str:
    """The GPU's name, or "cpu" (the CPU's model is cpu_model())."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cpuinfo() -> dict[str, str]:
    """The fields of /proc/cpuinfo, the first value of each ({} where there is none)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_id() -> str | None:
    """The x86 family and model ("family 26 model 2") on Linux, else None: a virtual machine's model
    name ("AMD EPYC") leaves out the processor's generation, and the CPU kernels' speed depends on it."""
    info = _cpuinfo()
    if "cpu family" not in info or "model" not in info:
        return None
    return f"family {info['cpu family']} model {info['model']}"


# The SIMD width capsroute's C++ kernels are built for at each -march level (at::vec's AVX-512 and
# AVX2 implementations; below x86-64-v3 its portable code, which the compiler may vectorise).
VECTOR_BITS = {"x86-64-v4": 512, "x86-64-v3": 256}
_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def cpu_caches() -> dict[str, str]:
    """The caches of the first CPU as Linux lists them, by level and type ({"L1d": "48K", "L1i":
    "32K", "L2": "1024K", "L3": "32768K"}; a shared cache's whole size), {} where it lists none."""
    caches = {}
    for index in sorted(_CACHES.glob("index[0-9]*")):
        try:
            level, kind, size = (
                (index / name).read_text().strip() for name in ("level", "type", "size")
            )
        except OSError:
            continue
        caches[f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")] = size
    return caches


def loadavg() -> float | None:
    """The 1-minute load average, None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_machine(cpu_arch: str) -> dict:
    """What a CPU record names about the machine and the build: the processor (model name, x86
    family and model, torch's capability), the -march level capsroute's C++ kernels were built for
    and their vector width, the caches and the cores."""
    return {
        "cpu": cpu_model(),
        "cpu_id": cpu_id(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_arch": cpu_arch,
        "vector_bits": VECTOR_BITS.get(cpu_arch),
        "caches": cpu_caches(),
        "cores": os.cpu_count(),
    }


def precision_modes() -> dict:
    """The float32 modes torch's own kernels run in, which a record names: the matmul precision
    ("highest": no TF32) and whether cuDNN's convolutions and cuBLAS's matmuls may use TF32."""
    return {
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
    }


def describe_cpu(machine: dict) -> str:
    """cpu_machine's dict in a line: "AMD EPYC (family 25 model 1, AVX2), built for x86-64-v3
    (256-bit vectors), L2 1024K, L3 32768K, 2 cores"."""
    vectors = f"{machine['vector_bits']}-bit vectors" if machine["vector_bits"] else "no SIMD level"
    caches = "".join(
        f", {level} {size}" for level, size in machine["caches"].items() if "i" not in level
    )
    processor = ", ".join(filter(None, [machine["cpu_id"], machine["cpu_capability"]]))
    return (
        f"{machine['cpu']} ({processor}), built for {machine['cpu_arch']} ({vectors}){caches}, "
        f"{machine['cores']} cores"
    )


def resolve_device(spec: str, local_rank: int | None = None) -> torch.device:
    """`--device` (auto, cpu, cuda or cuda:N) as a device, made current on CUDA. A CUDA device without an
    index is `local_rank` (one process per GPU under torchrun), else the current one."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"--device {spec}: no CUDA device is available")
        if device.index is None:
            device = torch.device(
                "cuda", torch.cuda.current_device() if local_rank is None else local_rank
            )
        torch.cuda.set_device(device)
    return device


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", as the records and the command lines spell dtypes."""
    return str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def replacing(path: Path):
    """Yields a temporary path beside `path`; when the block succeeds the file written there replaces
    `path` in one step, so a reader (or a run killed mid-write) never sees a partial file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    yield tmp
    os.replace(tmp, path)


def write_json_atomic(obj, path: Path) -> Path:
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
    return Path(path)
