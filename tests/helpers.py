"""Shared test helpers: devices, tolerances, random inputs, relative-error assertions and the
scripts of scripts/ loaded as modules."""

import importlib.util
from pathlib import Path

import pytest
import torch

from capsroute.testing import TOLERANCE, randn  # noqa: F401  (the tests import them from here)

HAS_CUDA = torch.cuda.is_available()
# The small CapsNet and MatrixCapsNet the training tests run (MatrixCapsNet: A=32 B=8 C=8 D=8, 2 EM
# iterations).
SMALL_CAPSNET = ["--model-config", "conv_channels=32", "primary_types=8", "decoder=(64,128)"]
SMALL_MATRIXCAPSNET = ["--model", "matrixcapsnet", "--model-config", "A=32", "B=8", "C=8", "D=8"]

CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]
)
DEVICES = ["cpu", CUDA]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    scale = expected.abs().max().item() if expected.numel() else 1.0
    return (actual - expected).abs().max().item() / max(scale, 1e-300) if expected.numel() else 0.0


def assert_rel_close(actual, expected, tol, what=""):
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.isfinite(actual).all() == torch.isfinite(expected).all(), (
        f"{what}: non-finite values differ"
    )
    err = rel_err(actual, expected)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.1g}"


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a layout that is not contiguous: the dims stored in reverse order, or for
    a vector every other element of a buffer twice as long."""
    x = t.detach()
    if x.dim() > 1:
        dims = list(reversed(range(x.dim())))
        x = x.permute(dims).contiguous().permute(dims)
    else:
        x = torch.stack([x, torch.zeros_like(x)], -1)[..., 0]
    assert not x.is_contiguous()
    return x.requires_grad_(t.requires_grad)


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
