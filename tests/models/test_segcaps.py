"""SegCaps (capsroute.nn.DeconvCapsules, capsroute.models.SegCapsNet): the up-sampling capsule
layer is SegCaps' transposed-convolution routing exactly, on both backends; SegCapsNet's shapes; the multimnist-seg masks, loss and metrics; and a
short `capsroute train` run of the segmentation task."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_models import assert_backends_agree, both_backends

import capsroute
from capsroute import reference
from capsroute.datasets import mnist, multimnist
from capsroute.losses import segmentation_loss
from capsroute.models import SegCapsNet
from capsroute.nn import DeconvCapsules
from capsroute.train import main as train_main
from capsroute.train.metrics import pixel_correct, segmentation_metrics, segmentation_sums
from helpers import DEVICES

MNIST_SMALL = "tests/data/mnist-small"


def segcaps_deconv(layer: DeconvCapsules, u: torch.Tensor) -> torch.Tensor:
    """SegCaps' DeconvCapsuleLayer ("deconv") written out: each input type's capsules through one
    conv_transpose2d, the votes (N H' W', C_in, C_out, D) routed by dynamic routing."""
    N, H, W, C, Din = u.shape
    K, _, _, C_out, D, _ = layer.weight.shape
    # the layer convolves the zero-inserted grid: its kernel is the transposed one flipped
    w = layer.weight[:, :, 0].flip(0, 1).permute(4, 2, 3, 0, 1).reshape(Din, C_out * D, K, K)
    votes = F.conv_transpose2d(
        u.permute(0, 3, 4, 1, 2).reshape(N * C, Din, H, W),
        w,
        stride=layer.stride,
        padding=layer.padding,
        output_padding=layer.output_padding,
    )
    Ho, Wo = votes.shape[-2:]
    votes = votes.view(N, C, C_out, D, Ho, Wo).permute(0, 4, 5, 1, 2, 3)
    v = reference.dynamic_routing(
        votes.reshape(N * Ho * Wo, C, C_out, D), layer.conv.iters, bias=layer.bias
    )
    return v.view(N, Ho, Wo, C_out, D)


@pytest.mark.parametrize(
    "kernel_size, stride, padding, output_padding, side",
    [
        (4, 2, "same", 0, 10),
        (5, 2, "same", 0, 10),
        (3, 2, 1, 1, 10),
        (3, 3, 0, 2, 9),
        (2, 2, 0, 0, 8),
    ],
)
@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_deconv_capsules_is_segcaps_transposed_routing(
    backend, kernel_size, stride, padding, output_padding, side
):
    torch.manual_seed(0)
    layer = DeconvCapsules(
        3, 4, 2, 5, kernel_size, stride, padding, output_padding, iters=3, backend=backend
    ).double()
    torch.nn.init.normal_(layer.bias)
    H, W = side // stride, side // stride + 1
    u = capsroute.squash(torch.randn(2, H, W, 3, 4, dtype=torch.float64))
    v = layer(u)
    grow = kernel_size - 2 * layer.padding + layer.output_padding - stride
    assert v.shape == (2, H * stride + grow, W * stride + grow, 2, 5)
    assert grow == 0 or padding != "same"  # "same": s H
    torch.testing.assert_close(v, segcaps_deconv(layer, u), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("upsampling", ["transpose", "nearest"])
@pytest.mark.parametrize("device", DEVICES)
def test_deconv_capsules_backends_agree(device, upsampling):
    u = capsroute.squash(torch.randn(2, 4, 5, 3, 4, dtype=torch.float64, device=device))
    results = both_backends(
        lambda: DeconvCapsules(
            3, 4, 2, 6, kernel_size=4, upsampling=upsampling, share_weights=False
        ).to(device),
        u,
    )
    assert results["fused"][0][0].shape == (2, 8, 10, 2, 6)
    assert_backends_agree(results)


def test_deconv_capsules_gradients_are_exact():
    torch.manual_seed(0)
    layer = DeconvCapsules(2, 3, 2, 3, kernel_size=3, iters=2).double()
    u = capsroute.squash(torch.randn(1, 3, 2, 2, 3, dtype=torch.float64)).requires_grad_()
    # fast_mode: finite differences of random projections (the op's exact gradcheck is in the
    # contract tests; this checks the layer's upsampling and shared weight on top of it).
    assert torch.autograd.gradcheck(
        lambda u, w, b: _deconv(layer, u, w, b), (u, layer.conv.weight, layer.bias), fast_mode=True
    )


def _deconv(layer, u, weight, bias):
    K, _, _, C_out, D, Din = weight.shape
    return capsroute.conv_dynamic_routing(
        layer.upsampled(u), weight.expand(K, K, 2, C_out, D, Din), layer.conv.iters, bias=bias
    )


def test_nearest_upsampling_is_routing_of_the_repeated_capsules():
    torch.manual_seed(0)
    layer = DeconvCapsules(2, 3, 4, 5, kernel_size=5, upsampling="nearest").double()
    u = capsroute.squash(torch.randn(2, 3, 4, 2, 3, dtype=torch.float64))
    repeated = u.repeat_interleave(2, 1).repeat_interleave(2, 2)
    K = 5
    expected = capsroute.conv_dynamic_routing(
        repeated, layer.weight.expand(K, K, 2, 4, 5, 3), 3, bias=layer.bias, padding=2
    )
    torch.testing.assert_close(layer(u), expected, rtol=0, atol=0)


def test_deconv_capsules_refuses_bad_arguments():
    with pytest.raises(ValueError, match="upsampling"):
        DeconvCapsules(2, 4, 2, 4, upsampling="bilinear")
    with pytest.raises(ValueError, match="output_padding"):
        DeconvCapsules(2, 4, 2, 4, 4, 2, padding=1, output_padding=2)
    with pytest.raises(ValueError, match="padding"):
        DeconvCapsules(2, 4, 2, 4, 3, 2, padding=3)
    with pytest.raises(ValueError, match=r"u must be \(N, H, W, 2, Din\)"):
        DeconvCapsules(2, 4, 2, 4)(torch.zeros(1, 3, 3, 3, 4))


@pytest.mark.parametrize("side", [36, 21])
def test_segcapsnet_shapes(side):
    torch.manual_seed(0)
    model = SegCapsNet(10, stem=4, dims=(4, 8), seg_dim=4, iters=2)
    out = model(torch.rand(2, 1, side, side))
    assert out.lengths.shape == (2, 10, side, side)
    assert out.capsules.shape == (2, side, side, 10, 4)
    assert ((out.lengths >= 0) & (out.lengths < 1)).all()


def test_segcapsnet_backends_agree():
    images = torch.rand(2, 1, 12, 12, dtype=torch.float64)
    results = both_backends(lambda: SegCapsNet(2, stem=2, dims=(2, 4), seg_dim=3, iters=2), images)
    assert_backends_agree(results, tol=1e-8)


def test_masks_are_the_digits_pixels():
    train, _ = (mnist.load_dataset("mnist", MNIST_SMALL, split) for split in ("train", "test"))
    pairs = multimnist.MultiMNIST(*train, seed=3)
    images, labels, digits = pairs.float_pairs(np.arange(64))
    masks = multimnist.class_masks(labels, digits)
    assert masks.shape == (64, 10, 36, 36)
    rows = torch.arange(64)
    for k in range(2):  # each label's mask is its digit's pixels of at least half intensity
        assert torch.equal(masks[rows, labels[:, k]], (digits[:, k] > 0.5).float())
        raw = pairs.pairs(np.arange(64)).digits[:, k]
        assert torch.equal(masks[rows, labels[:, k]].bool(), raw >= 128)
    # no other class has pixels; the union is where the composite is at least half intensity
    assert masks.sum((2, 3)).count_nonzero(1).le(2).all()
    assert int(masks.sum()) == int(sum(masks[rows, labels[:, k]].sum() for k in range(2)))
    assert torch.equal(masks.amax(1), (images[:, 0] > 0.5).float())
    # a digit's pixels are never brighter in its mask than the composite shows
    assert (images[:, 0][masks.amax(1).bool()] > 0.5).all()


def test_loss_and_metrics_by_hand():
    masks = torch.zeros(2, 2, 2, 2)
    masks[0, 0, 0, 0] = masks[0, 1, 0, 0] = masks[1, 1, 1, 1] = 1
    lengths = torch.full_like(masks, 0.1)
    lengths[0, 0, 0, 0] = 0.9  # class 1 missed at (0, 0) of image 0
    lengths[1, 1, 1, 1] = lengths[1, 0, 1, 0] = 0.8  # a false class 0 at (1, 0) of image 1
    assert pixel_correct(lengths, masks).tolist() == [0.75, 0.75]
    metrics = segmentation_metrics(segmentation_sums(lengths, masks))
    assert metrics["test_pixel_accuracy"] == 0.75
    assert metrics["test_ink_accuracy"] == 0.5  # (0, 0) of image 0 wrong, (1, 1) of image 1 right
    assert metrics["test_dice"] == pytest.approx((2 / 3 + 2 / 3) / 2)  # 1 TP, 1 FP / 1 FN
    assert metrics["test_iou"] == pytest.approx(0.5)
    assert metrics["test_foreground_dice"] == pytest.approx(2 * 2 / (2 * 2 + 1))
    perfect = segmentation_loss(masks * 0.999999, masks)
    assert perfect < 1e-3 < segmentation_loss(lengths, masks)


def test_train_segmentation_smoke(tmp_path, capsys):
    out = tmp_path / "run"
    argv = [
        "--model", "segcapsnet", "--dataset", "multimnist-seg", "--data-dir", MNIST_SMALL,
        "--model-config", "stem=4", "dims=(4,8)", "seg_dim=4", "iters=2",
        "--epochs", "2", "--train-subset", "64", "--test-subset", "16", "--batch-size", "16",
        "--lr", "3e-3", "--no-progress", "--device", "cpu", "--out", str(out),
    ]  # fmt: skip
    assert train_main(argv) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["model"] == "segcapsnet" and result["dataset"] == "multimnist-seg"
    assert result["test_pairs"] == 16 and result["train_pairs"] == 64
    for key in ("test_pixel_accuracy", "test_dice", "test_iou", "test_foreground_dice"):
        assert 0 <= result[key] <= 1
    assert result["test_accuracy"] == pytest.approx(result["test_pixel_accuracy"])
    epochs = json.loads((out / "metrics.json").read_text())["epochs"]
    assert len(epochs) == 2 and epochs[1]["train_loss"] < epochs[0]["train_loss"]
    assert (out / "masks.png").is_file() and (out / "curves.png").is_file()


@pytest.mark.parametrize(
    "model, dataset, message",
    [
        ("capsnet", "multimnist-seg", "--dataset multimnist-seg trains segcapsnet, not capsnet"),
        ("segcapsnet", "mnist", "--model segcapsnet segments --dataset multimnist-seg, not mnist"),
        (
            "segcapsnet",
            "multimnist",
            "--dataset multimnist trains capsnet, efficientcapsnet or cnn, not segcapsnet",
        ),
    ],
)
def test_train_refuses_mismatched_segmentation(tmp_path, model, dataset, message):
    argv = [
        "--model",
        model,
        "--dataset",
        dataset,
        "--data-dir",
        MNIST_SMALL,
        "--out",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit) as refused:
        train_main(argv)
    assert message in str(refused.value)
