"""MatrixCapsNet learns: a few hundred steps of `capsroute train` on the committed MNIST subset
(tests/data/mnist-small) clear a bar that the stalled recipe of 2026-11-22 does not reach (the
measurements behind the bar are in docs/matrixcapsnet.md); and the routing options of the EM
layers that the diagnosis measured do what they say, on both backends."""

import json
from pathlib import Path

import pytest
import torch

from capsroute import nn as capsnn, train
from capsroute.losses import spread_loss
from capsroute.models import MatrixCapsNet
from capsroute.nn import ClassCapsules, ConvCapsules
from helpers import SMALL_MATRIXCAPSNET

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "mnist-small"


@pytest.mark.slow
def test_matrixcapsnet_learns(tmp_path):
    """282 steps (3 epochs of 3000 images) of the CPU recipe's small network, A=32 B=8 C=8 D=8 with
    the default 2 EM iterations, Adam 1e-2, batch 32, scored on 1000 unseen images. Measured: 87.3%
    (seed 0) and 87.8% (seed 1); the same run with the 3 iterations of the stalled recipe
    (iters=3) reaches 47.3%, hence the bar of 75%."""
    args = [
        *SMALL_MATRIXCAPSNET,
        "--data-dir",
        str(DATA),
        "--out",
        str(tmp_path),
        "--no-progress",
        "--no-plots",
        "--batch-size",
        "32",
        "--epochs",
        "3",
        "--lr",
        "1e-2",
    ]
    assert train.main(args) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["test_accuracy"] >= 0.75, result


def em_inputs(N=2, H=4, types=3, dtype=torch.float64):
    torch.manual_seed(0)
    return torch.randn(N, H, H, types, 16, dtype=dtype), torch.rand(N, H, H, types, dtype=dtype)


@pytest.mark.parametrize("layer_cls", [ConvCapsules, ClassCapsules])
def test_normalize_cost_divides_final_lambda_by_inputs_per_output(layer_cls):
    """normalize_cost gives the op final_lambda * out_types / inputs (inputs: votes per output capsule)."""
    pose, activation = em_inputs()
    normalized = layer_cls(3, 5, normalize_cost=True, final_lambda=2.0).double()
    inputs = 3 * 3 * 3 if layer_cls is ConvCapsules else 4 * 4 * 3
    plain = layer_cls(3, 5, final_lambda=2.0 * 5 / inputs).double()
    plain.load_state_dict(normalized.state_dict())
    for got, want in zip(normalized(pose, activation), plain(pose, activation)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("layer_cls", [ConvCapsules, ClassCapsules])
def test_min_var_is_the_ops_eps(layer_cls):
    pose, activation = em_inputs()
    layer = layer_cls(3, 5, min_var=1e-2).double()
    calls = []
    original = layer.ops

    class Spy:
        def __getattr__(self, name):
            def call(*args, **kwargs):
                calls.append(kwargs)
                return getattr(original, name)(*args, **kwargs)

            return call

    capsnn.BACKENDS["spy"] = Spy()
    try:
        layer.backend = "spy"
        layer(pose, activation)
    finally:
        del capsnn.BACKENDS["spy"]
    assert calls == [{"final_lambda": 0.01, "eps": 1e-2}]


@pytest.mark.parametrize("layer_cls", [ConvCapsules, ClassCapsules])
def test_pose_norm_makes_the_layer_blind_to_each_images_pose_scale(layer_cls):
    pose, activation = em_inputs()
    layer = (
        layer_cls(3, 5, pose_norm=True, coordinate_addition=False).double()
        if layer_cls is ClassCapsules
        else layer_cls(3, 5, pose_norm=True).double()
    )
    scale = torch.tensor([0.01, 30.0], dtype=torch.float64).view(2, 1, 1, 1, 1)
    for got, want in zip(layer(pose * scale, activation), layer(pose, activation)):
        torch.testing.assert_close(got, want)
    without = layer_cls(3, 5).double()
    without.load_state_dict(layer.state_dict())
    assert not torch.allclose(without(pose * scale, activation)[1], without(pose, activation)[1])


def test_weight_std_and_conv_norm():
    torch.manual_seed(0)
    model = MatrixCapsNet(A=8, B=4, C=4, D=4, weight_std=2.0, conv_norm=True)
    assert abs(model.conv_caps2.weight.std().item() - 2.0) < 0.1
    assert isinstance(model.conv_norm, torch.nn.BatchNorm2d) and model.classes.iters == 2
    assert isinstance(MatrixCapsNet(A=8, B=4, C=4, D=4).conv_norm, torch.nn.Identity)


def test_routing_options_agree_across_backends():
    """Every option on: the fused and the reference network compute the same outputs and gradients."""
    images = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    labels = torch.tensor([3, 7])
    results = {}
    for backend in ("fused", "reference"):
        torch.manual_seed(0)
        model = MatrixCapsNet(
            A=8,
            B=4,
            C=4,
            D=4,
            iters=3,
            normalize_cost=True,
            final_lambda=1.0,
            min_var=1e-3,
            pose_norm=True,
            conv_norm=True,
            backend=backend,
        ).double()
        out = model(images, labels)
        spread_loss(out.activations, labels, 0.5).backward()
        results[backend] = (out.activations, out.poses, *[p.grad for p in model.parameters()])
    for got, want in zip(results["fused"], results["reference"]):
        torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
