"""capsroute.nn layers, capsroute.models and capsroute.losses: the fused backend computes the
same function as the reference backend, shapes follow the papers, losses match their formulas."""

import pytest
import torch

import capsroute
from capsroute import losses
from capsroute.models import CapsNet, MatrixCapsNet
from capsroute.nn import (
    ClassCapsules,
    ConvCapsules,
    ConvDynamicCapsules,
    DenseCapsules,
    PrimaryCapsules,
    PrimaryMatrixCapsules,
    set_backend,
)
from capsroute.nn.attention import InvertedAttentionCapsules, SelfAttentionCapsules
from helpers import CUDA, DEVICES, assert_rel_close


def both_backends(make_module, *inputs, seed=0):
    """Outputs and parameter gradients of one module under each backend (float64)."""
    torch.manual_seed(seed)
    module = make_module().double()
    results = {}
    for backend in ("fused", "reference"):
        set_backend(module, backend)
        module.zero_grad()
        xs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = module(*xs)
        out = out if isinstance(out, tuple) else (out,)
        torch.manual_seed(seed + 1)
        sum(
            (
                (o.float() if o.dtype != torch.float64 else o)
                * torch.randn_like(o, dtype=torch.float64)
            ).sum()
            for o in out
        ).backward()
        grads = [p.grad.clone() for p in module.parameters()] + [
            x.grad for x in xs if x.grad is not None
        ]
        results[backend] = (out, grads)
    return results


def assert_backends_agree(results, tol=1e-9):
    (out_f, grads_f), (out_r, grads_r) = results["fused"], results["reference"]
    for a, b in zip(out_f, out_r):
        assert_rel_close(a, b, tol)
    assert len(grads_f) == len(grads_r)
    for a, b in zip(grads_f, grads_r):
        assert_rel_close(a, b, tol)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_capsules_layer_backends_agree(device):
    u = capsroute.squash(torch.randn(3, 20, 8, dtype=torch.float64, device=device))
    assert_backends_agree(both_backends(lambda: DenseCapsules(20, 8, 5, 16, iters=3).to(device), u))


@pytest.mark.parametrize("device", DEVICES)
def test_primary_capsules_layer(device):
    x = torch.randn(2, 4, 21, 21, dtype=torch.float64, device=device)
    results = both_backends(lambda: PrimaryCapsules(4, types=3, dim=8).to(device), x)
    assert results["fused"][0][0].shape == (2, 3 * 7 * 7, 8)
    assert (results["fused"][0][0].norm(dim=-1) < 1).all()
    assert_backends_agree(results)


@pytest.mark.parametrize("routing", ["window", "cross-window"])
@pytest.mark.parametrize("device", DEVICES)
def test_conv_capsules_layer_backends_agree(device, routing):
    pose = torch.randn(2, 5, 6, 3, 16, dtype=torch.float64, device=device)
    activation = torch.rand(2, 5, 6, 3, dtype=torch.float64, device=device)
    results = both_backends(
        lambda: ConvCapsules(3, 4, kernel_size=3, stride=2, routing=routing, pose_norm=True).to(
            device
        ),
        pose,
        activation,
    )
    out_pose, out_a = results["fused"][0]
    assert out_pose.shape == (2, 2, 2, 4, 16) and out_a.shape == (2, 2, 2, 4)
    assert_backends_agree(results)


def both_routings(in_types, out_types, stride, backend="fused"):
    """ConvCapsules with routing "window" and "cross-window", the same parameters, float64."""
    window, cross = (
        ConvCapsules(
            in_types,
            out_types,
            kernel_size=3,
            stride=stride,
            iters=2,
            final_lambda=0.5,
            routing=routing,
            backend=backend,
        ).double()
        for routing in ("window", "cross-window")
    )
    cross.load_state_dict(window.state_dict())
    return window, cross


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_conv_capsules_routings_agree_without_overlap(backend):
    """With stride = kernel size every child lies in one window: normalising its assignments across
    the windows that contain it is normalising them in its window, so both routings agree (this
    also pins the weight's (row, column, type) order to the op's)."""
    torch.manual_seed(0)
    window, cross = both_routings(3, 4, stride=3, backend=backend)
    pose = torch.randn(2, 6, 9, 3, 16, dtype=torch.float64)
    activation = torch.rand(2, 6, 9, 3, dtype=torch.float64)
    for a, b in zip(window(pose, activation), cross(pose, activation)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_conv_capsules_cross_window_shares_a_child_between_windows():
    """With overlapping windows the two routings differ: a child's assignments are normalised
    across every window that contains it, not in each window on its own."""
    torch.manual_seed(0)
    window, cross = both_routings(2, 3, stride=1)
    pose = torch.randn(1, 5, 5, 2, 16, dtype=torch.float64)
    activation = torch.rand(1, 5, 5, 2, dtype=torch.float64)
    expected = capsroute.conv_em_routing(
        pose,
        activation,
        window.weight.view(3, 3, 2, 3, 4, 4),
        window.beta_u,
        window.beta_a,
        2,
        final_lambda=0.5,
    )
    got = cross(pose, activation)
    torch.testing.assert_close(got[0], expected[0].reshape(1, 3, 3, 3, 16), rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)
    assert not torch.allclose(window(pose, activation)[1], got[1], rtol=1e-6, atol=1e-6)


def test_conv_capsules_refuses_an_unknown_routing():
    with pytest.raises(ValueError, match="routing must be one of window, cross-window, got 'x'"):
        ConvCapsules(2, 3, routing="x")


def test_conv_capsules_routes_each_window():
    """Output position (y, x) depends only on the window of input capsules it covers."""
    layer = ConvCapsules(2, 3, kernel_size=3, stride=1).double()
    pose = torch.randn(1, 5, 5, 2, 16, dtype=torch.float64)
    activation = torch.rand(1, 5, 5, 2, dtype=torch.float64)
    out_pose, out_a = layer(pose, activation)
    window_pose, window_a = layer(
        pose[:, 1:4, 2:5].contiguous(), activation[:, 1:4, 2:5].contiguous()
    )
    torch.testing.assert_close(out_pose[:, 1, 2], window_pose[:, 0, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out_a[:, 1, 2], window_a[:, 0, 0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_class_capsules_layer_backends_agree(device):
    pose = torch.randn(2, 3, 3, 4, 16, dtype=torch.float64, device=device)
    activation = torch.rand(2, 3, 3, 4, dtype=torch.float64, device=device)
    results = both_backends(lambda: ClassCapsules(4, 5).to(device), pose, activation)
    assert results["fused"][0][0].shape == (2, 5, 16) and results["fused"][0][1].shape == (2, 5)
    assert_backends_agree(results)


def test_class_capsules_coordinate_addition_moves_the_last_column():
    """With identity transforms, the class pose is the a-weighted mean of the input poses plus
    the mean scaled coordinates in entries (0, 3) and (1, 3)."""
    layer = ClassCapsules(1, 1, iters=1).double()
    with torch.no_grad():
        layer.weight.copy_(torch.eye(4, dtype=torch.float64))
    pose = torch.zeros(1, 2, 2, 1, 16, dtype=torch.float64)
    activation = torch.ones(1, 2, 2, 1, dtype=torch.float64)
    with_coords, _ = layer(pose, activation)
    layer.coordinate_addition = False
    without, _ = layer(pose, activation)
    expected = torch.zeros(16, dtype=torch.float64)
    expected[3] = expected[7] = 0.5  # centres (0.25, 0.75) in both axes, averaged
    torch.testing.assert_close(with_coords[0, 0], expected, rtol=0, atol=1e-5)  # m / (m + eps)
    assert without.abs().max() == 0


def test_capsnet_is_the_papers_network():
    model = CapsNet()
    assert (
        sum(p.numel() for p in model.parameters()) == 8_215_728
    )  # 8.2M in Sabour et al. (with biases)
    assert model.classes.weight.shape == (1152, 10, 16, 8)
    images, labels = torch.rand(3, 1, 28, 28), torch.tensor([1, 2, 3])
    out = model.train()(images, labels)
    assert (
        out.lengths.shape == (3, 10)
        and out.capsules.shape == (3, 10, 16)
        and out.reconstructions.shape == (3, 784)
    )
    assert ((out.lengths > 0) & (out.lengths < 1)).all()


def test_capsnet_decoder_masking():
    """Training shows the decoder the label's capsule; evaluation the longest one."""
    torch.manual_seed(0)
    model = CapsNet(conv_channels=16, primary_types=4).double()
    images = torch.rand(4, 1, 28, 28, dtype=torch.float64)
    model.eval()
    out = model(images)
    predicted = out.lengths.argmax(-1)
    wrong = (predicted + 1) % 10
    torch.testing.assert_close(out.reconstructions, model.reconstruct(out.capsules, predicted))
    model.train()
    out_train = model(images, wrong)
    torch.testing.assert_close(out_train.reconstructions, model.reconstruct(out.capsules, wrong))


def test_matrix_capsnet_is_the_papers_small_network():
    model = MatrixCapsNet()
    assert [m.weight.shape for m in (model.conv_caps1, model.conv_caps2, model.classes)] == [
        (72, 16, 4, 4),
        (144, 16, 4, 4),
        (16, 10, 4, 4),
    ]
    out = model(torch.rand(2, 1, 28, 28))
    assert out.activations.shape == (2, 10) and out.poses.shape == (2, 10, 16)
    assert (
        torch.isfinite(out.activations).all()
        and ((out.activations > 0) & (out.activations < 1)).all()
    )


@pytest.mark.parametrize(
    "model_cls, config",
    [(CapsNet, dict(conv_channels=16, primary_types=4)), (MatrixCapsNet, dict(A=8, B=4, C=4, D=4))],
)
def test_models_backends_agree(model_cls, config):
    images = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    labels = torch.tensor([3, 7])
    results = both_backends(lambda: model_cls(**config).train(), images, labels)
    assert_backends_agree(results, tol=1e-8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_models_under_autocast(dtype):
    torch.manual_seed(0)
    for model in (CapsNet(conv_channels=16, primary_types=4), MatrixCapsNet(A=8, B=4, C=4, D=4)):
        with torch.autocast("cpu", dtype=dtype):
            out = model(torch.rand(2, 1, 28, 28), torch.tensor([0, 1]))
        out.scores.float().sum().backward()
        assert torch.isfinite(out.scores.float()).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("conv_routing", ["window", "cross-window"])
def test_em_layers_route_in_float32_under_autocast(conv_routing):
    """Under autocast the convolutions run in bfloat16 but EM routing stays in float32, in both
    backends, so they agree to float32 rounding of the same bfloat16 convolution outputs."""
    torch.manual_seed(0)
    model = MatrixCapsNet(A=8, B=4, C=4, D=4, conv_routing=conv_routing)
    images = torch.rand(2, 1, 28, 28)
    outs = {}
    for backend in ("fused", "reference"):
        set_backend(model, backend)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[backend] = model(images)
    assert outs["fused"].activations.dtype == torch.float32
    torch.testing.assert_close(
        outs["fused"].activations, outs["reference"].activations, rtol=1e-4, atol=1e-5
    )


AUTOCAST = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
    *(
        pytest.param("cuda", amp, id=f"cuda-{name}", marks=CUDA.marks)
        for amp, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"))
    ),
]


@pytest.mark.parametrize("device,amp", AUTOCAST)
def test_layers_and_ops_agree_under_autocast(device, amp):
    """The layers carry no autocast rule of their own: under autocast a layer gives bitwise what its
    op gives to a user who calls it with the layer's parameters, and the EM layers give what they
    give on float32 inputs outside autocast, as when the rule lived in the layers."""
    torch.manual_seed(0)
    dense = DenseCapsules(11, 8, 5, 16).to(device)
    conv = ConvCapsules(3, 4, kernel_size=3, stride=2).to(device)
    classes = ClassCapsules(3, 5).to(device)
    u = capsroute.squash(torch.randn(3, 11, 8, device=device)).to(
        amp
    )  # as PrimaryCapsules delivers it
    pose = torch.randn(2, 5, 6, 3, 16, device=device).to(amp)
    activation = torch.rand(2, 5, 6, 3, device=device).to(amp)
    # ConvCapsules' windows (kernel 3, stride 2: 2 x 2 positions of 27 input capsules)
    windows = pose.unfold(1, 3, 2).unfold(2, 3, 2).permute(0, 1, 2, 5, 6, 3, 4).reshape(8, 27, 16)
    a_windows = activation.unfold(1, 3, 2).unfold(2, 3, 2).permute(0, 1, 2, 4, 5, 3).reshape(8, 27)
    with torch.autocast(device, dtype=amp):
        v = dense(u)
        v_op = capsroute.dense_capsules(u, dense.weight, bias=dense.bias)
        conv_out = conv(pose, activation)
        conv_op = capsroute.em_routing_pose(
            windows, conv.weight, a_windows, conv.beta_u, conv.beta_a
        )
        class_out = classes(pose[:, :3], activation[:, :3])
    assert v.dtype == amp and torch.equal(v, v_op)
    for name, a, b, c in zip(
        ["pose", "a"], conv_out, conv_op, conv(pose.float(), activation.float())
    ):
        assert (
            a.dtype == torch.float32 and torch.equal(a.reshape(b.shape), b) and torch.equal(a, c)
        ), f"conv {name}"
    for name, a, c in zip(
        ["pose", "a"], class_out, classes(pose[:, :3].float(), activation[:, :3].float())
    ):
        assert a.dtype == torch.float32 and torch.equal(a, c), f"classes {name}"


def test_bad_backend_is_named():
    with pytest.raises(ValueError, match="backend must be one of"):
        DenseCapsules(4, 8, 2, 16, backend="cuda")
    layer = PrimaryMatrixCapsules(3, 2)
    assert layer(torch.rand(1, 3, 4, 4))[0].shape == (1, 4, 4, 2, 16)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: ConvDynamicCapsules(2, 3, 2, 4, kernel_size=0), "kernel_size must be an int >= 1"),
        (lambda: ConvDynamicCapsules(2, 0, 2, 4), "in_dim must be an int >= 1, got 0"),
        (lambda: SelfAttentionCapsules(0, 8, 10, 16), "in_capsules must be an int >= 1, got 0"),
        (lambda: InvertedAttentionCapsules(4, 8, 10, 0), "out_dim must be an int >= 1, got 0"),
        (lambda: DenseCapsules(4, 8, 2.5, 16), "out_capsules must be an int >= 1, got 2.5"),
        (lambda: ClassCapsules(0, 10), "in_types must be an int >= 1, got 0"),
        (lambda: PrimaryMatrixCapsules(3, 0), "types must be an int >= 1, got 0"),
    ],
)
def test_layers_refuse_empty_sizes(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("routing", ["window", "cross-window"])
def test_matrix_capsule_layers_name_a_wrong_input(routing):
    pose, a = torch.rand(1, 5, 5, 4, 16), torch.rand(1, 5, 5, 4)
    with pytest.raises(ValueError, match=r"pose must have shape \(N, H, W, 2, 16\)"):
        ConvCapsules(2, 3, routing=routing)(pose, a)
    with pytest.raises(ValueError, match=r"activation must have shape \(1, 5, 5, 4\)"):
        ConvCapsules(4, 3, routing=routing)(pose, a[..., :3])
    with pytest.raises(ValueError, match=r"pose's grid \(5 x 5\) must be at least the kernel"):
        ConvCapsules(4, 3, kernel_size=7, routing=routing)(pose, a)
    with pytest.raises(ValueError, match=r"pose must have shape \(N, H, W, 3, 16\)"):
        ClassCapsules(3, 10)(pose, a)


def test_margin_loss_formula():
    lengths = torch.tensor([[0.95, 0.05, 0.5], [0.2, 0.8, 0.0]])
    labels = torch.tensor([0, 2])
    # row 0: present 0 (0.95 > 0.9); absent 0.5 * (0.4^2) for class 2, class 1 below 0.1.
    # row 1: present (0.9 - 0)^2; absent 0.5 * (0.1^2 + 0.7^2).
    expected = (0.5 * 0.16 + 0.81 + 0.5 * (0.01 + 0.49)) / 2
    torch.testing.assert_close(losses.margin_loss(lengths, labels), torch.tensor(expected))


def test_reconstruction_loss_formula():
    images = torch.zeros(2, 1, 2, 2)
    recon = torch.tensor([[1.0, 0, 0, 0], [1.0, 1.0, 0, 0]])
    torch.testing.assert_close(
        losses.reconstruction_loss(recon, images), torch.tensor(0.0005 * 1.5)
    )


def test_spread_loss_formula_and_schedule():
    a = torch.tensor([[0.9, 0.5, 0.1]])
    # margin 0.6: class 1 gap 0.4 -> (0.2)^2, class 2 gap 0.8 -> 0.
    torch.testing.assert_close(losses.spread_loss(a, torch.tensor([0]), 0.6), torch.tensor(0.04))
    assert losses.spread_margin(0, 100) == pytest.approx(0.2)
    assert losses.spread_margin(50, 100) == pytest.approx(0.55)
    assert losses.spread_margin(500, 100) == pytest.approx(0.9)


def test_capsnet_smallest_image():
    CapsNet(image_size=17)  # a 1x1 primary capsule grid
    with pytest.raises(ValueError, match="at least 17"):
        CapsNet(image_size=16)
