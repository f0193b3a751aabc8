"""Capsule layers on the fused routing ops.

Every layer takes `backend="fused"` (the capsroute kernels) or `backend="reference"` (the plain
PyTorch versions in capsroute.reference); both compute the same function with the same
parameters, so one model can be A/B-compared by switching the attribute.

Shapes: vector capsules are (N, capsules, dim); matrix capsules keep the grid,
poses (N, H, W, types, 16) and activations (N, H, W, types).
"""
import torch
from torch import Tensor, nn

from . import ops, reference
from ._autocast import like_op

BACKENDS = {"fused": ops, "reference": reference}


def _routing_ops(backend: str):
    try:
        return BACKENDS[backend]
    except KeyError:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}") from None


class _CapsuleLayer(nn.Module):
    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str):
        _routing_ops(value)
        self._backend = value

    @property
    def ops(self):
        return _routing_ops(self._backend)

    def extra_repr(self) -> str:
        return f"backend={self._backend!r}"


class PrimaryCapsules(_CapsuleLayer):
    """A convolution whose channels are grouped into `types` capsules of `dim` at every position,
    then squashed: (N, C, H, W) -> (N, types * H' * W', dim)."""

    def __init__(self, in_channels: int, types: int = 32, dim: int = 8, kernel_size: int = 9, stride: int = 2,
                 backend: str = "fused"):
        super().__init__(backend)
        self.types, self.dim = types, dim
        self.conv = nn.Conv2d(in_channels, types * dim, kernel_size, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        N, _, H, W = y.shape
        s = y.view(N, self.types, self.dim, H, W).permute(0, 1, 3, 4, 2).reshape(N, self.types * H * W, self.dim)
        return self.ops.squash(s)


class DenseCapsules(_CapsuleLayer):
    """Every input capsule votes for every output capsule through its own matrix (weight
    (I, J, D, Din)); the votes are routed by agreement (Sabour et al. 2017).
    (N, I, Din) -> (N, J, D). The fused backend never stores the votes."""

    def __init__(self, in_capsules: int, in_dim: int, out_capsules: int, out_dim: int, iters: int = 3, *,
                 bias: bool = True, leaky: bool = False, detach: bool = False, backend: str = "fused"):
        super().__init__(backend)
        self.iters, self.leaky, self.detach = iters, leaky, detach
        self.weight = nn.Parameter(0.01 * torch.randn(in_capsules, out_capsules, out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_capsules, out_dim)) if bias else None

    def forward(self, u: Tensor) -> Tensor:
        return self.ops.dense_capsules(u, self.weight, self.iters, bias=self.bias, leaky=self.leaky,
                                       detach=self.detach)

    def extra_repr(self) -> str:
        I, J, D, Din = self.weight.shape
        return f"{I}x{Din}D -> {J}x{D}D, iters={self.iters}, leaky={self.leaky}, {super().extra_repr()}"


class PrimaryMatrixCapsules(nn.Module):
    """Matrix capsules from a feature map (Hinton et al. 2018): a 1x1 convolution gives each of `types`
    capsules a 4x4 pose and a sigmoid activation. (N, C, H, W) -> poses (N, H, W, types, 16),
    activations (N, H, W, types)."""

    def __init__(self, in_channels: int, types: int):
        super().__init__()
        self.types = types
        self.pose = nn.Conv2d(in_channels, types * 16, 1)
        self.activation = nn.Conv2d(in_channels, types, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        N, _, H, W = x.shape
        pose = self.pose(x).view(N, self.types, 16, H, W).permute(0, 3, 4, 1, 2)
        return pose, torch.sigmoid(self.activation(x)).permute(0, 2, 3, 1)


class _EmCapsules(_CapsuleLayer):
    """Transformation matrices (inputs, out_types, 4, 4) and the EM betas of the output types.

    Options of the routing, none of which changes the op (docs/ops.md, em_routing):
    - normalize_cost: the op's cost sum_h cost_jh grows with the mass m_j, which is about
      inputs / out_types times the mean input activation, so one final_lambda cannot suit a
      3x3 window (72 inputs for 16 outputs) and the class layer (144 inputs for 10 classes)
      alike. With normalize_cost the op gets final_lambda * out_types / inputs: final_lambda is
      then the inverse temperature per unit of mean mass, the same in every layer (what the
      IBM re-implementation does with its layer_norm_factor).
    - min_var: the op's eps, the floor added to every variance (the official code's min_var).
    - weight_std: the standard deviation of the initial transformation matrices.
    - pose_norm: divide each image's input poses by their root mean square over the layer, so
      the votes' spread, and with it the 0.5 ln var part of the cost, keeps the scale of the
      transformation matrices instead of shrinking layer after layer (each output pose is a
      mean of many votes) or drifting with training.
    """

    def __init__(self, inputs: int, out_types: int, iters: int, final_lambda: float, backend: str, *,
                 normalize_cost: bool = False, min_var: float = 1e-6, weight_std: float = 0.5,
                 pose_norm: bool = False):
        super().__init__(backend)
        self.iters, self.final_lambda = iters, final_lambda
        self.normalize_cost, self.min_var, self.pose_norm = normalize_cost, min_var, pose_norm
        self.weight = nn.Parameter(weight_std * torch.randn(inputs, out_types, 4, 4))
        self.beta_u = nn.Parameter(torch.zeros(out_types))
        self.beta_a = nn.Parameter(torch.zeros(out_types))

    def _normalized(self, pose: Tensor) -> Tensor:
        """pose (N, H, W, types, 16), divided per image by its root mean square if pose_norm."""
        if not self.pose_norm:
            return pose
        return pose * torch.rsqrt(pose.pow(2).mean(dim=(1, 2, 3, 4), keepdim=True) + 1e-12)

    def _routing_options(self, inputs: int) -> dict:
        """The op's keyword arguments for `inputs` votes per output capsule."""
        lam = self.final_lambda * self.beta_a.numel() / inputs if self.normalize_cost else self.final_lambda
        return {"final_lambda": lam, "eps": self.min_var}

    def extra_repr(self) -> str:
        return (f"iters={self.iters}, final_lambda={self.final_lambda}, normalize_cost={self.normalize_cost}, "
                f"min_var={self.min_var}, pose_norm={self.pose_norm}, {super().extra_repr()}")


class ConvCapsules(_EmCapsules):
    """A convolutional matrix-capsule layer: every k x k window of input capsules (k*k*in_types
    of them) is routed on its own with EM routing to `out_types` capsules at that output position.
    The transformation matrices depend on the position inside the window and the types, not on
    the window. The fused backend computes votes = pose @ W inside the kernel (em_routing_pose).
    `routing`: normalize_cost, min_var, weight_std, pose_norm (see _EmCapsules)."""

    def __init__(self, in_types: int, out_types: int, kernel_size: int = 3, stride: int = 1, iters: int = 3, *,
                 final_lambda: float = 0.01, backend: str = "fused", **routing):
        super().__init__(kernel_size * kernel_size * in_types, out_types, iters, final_lambda, backend, **routing)
        self.kernel_size, self.stride = kernel_size, stride

    def forward(self, pose: Tensor, activation: Tensor) -> tuple[Tensor, Tensor]:
        N, H, W, types, _ = pose.shape
        k, s = self.kernel_size, self.stride
        pose = self._normalized(pose)
        # (N, H', W', types, 16, k, k) -> one routing problem per output position: (N H' W', k k types, 16)
        windows = pose.unfold(1, k, s).unfold(2, k, s)
        Ho, Wo = windows.shape[1], windows.shape[2]
        windows = windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(N * Ho * Wo, k * k * types, 16)
        a_windows = activation.unfold(1, k, s).unfold(2, k, s).permute(0, 1, 2, 4, 5, 3).reshape(N * Ho * Wo, -1)
        out_pose, out_a = self.ops.em_routing_pose(windows, self.weight, a_windows, self.beta_u, self.beta_a,
                                                   self.iters, **self._routing_options(windows.shape[1]))
        return out_pose.view(N, Ho, Wo, -1, 16), out_a.view(N, Ho, Wo, -1)

    def extra_repr(self) -> str:
        return f"k={self.kernel_size}, stride={self.stride}, {super().extra_repr()}"


class ClassCapsules(_EmCapsules):
    """The last matrix-capsule layer: every input capsule at every position votes for each class
    with a matrix shared across positions; with coordinate addition the scaled (row, column) of
    the position's centre is added to the first two entries of the vote's last column, so the
    class poses know where their parts were. All H*W*in_types votes are routed together.
    `routing`: normalize_cost, min_var, weight_std, pose_norm (see _EmCapsules)."""

    def __init__(self, in_types: int, classes: int, iters: int = 3, *, coordinate_addition: bool = True,
                 final_lambda: float = 0.01, backend: str = "fused", **routing):
        super().__init__(in_types, classes, iters, final_lambda, backend, **routing)
        self.coordinate_addition = coordinate_addition

    def forward(self, pose: Tensor, activation: Tensor) -> tuple[Tensor, Tensor]:
        votes = _class_votes(self._normalized(pose), self.weight, self.coordinate_addition)
        return self.ops.em_routing(votes, activation.flatten(1), self.beta_u, self.beta_a, self.iters,
                                   **self._routing_options(votes.shape[1]))

    def extra_repr(self) -> str:
        return f"coordinate_addition={self.coordinate_addition}, {super().extra_repr()}"


@like_op("em_routing")
def _class_votes(pose: Tensor, weight: Tensor, coordinate_addition: bool) -> Tensor:
    """ClassCapsules' votes (N, H W types, classes, 16), under em_routing's autocast rule: they are
    its input, and small differences between them are what it divides by."""
    N, H, W, types, _ = pose.shape
    votes = torch.einsum("nhwtrk,tcks->nhwtcrs", pose.view(N, H, W, types, 4, 4), weight)
    if coordinate_addition:
        offsets = votes.new_zeros(H, W, 4, 4)
        offsets[..., 0, 3] = (torch.arange(H, dtype=votes.dtype, device=votes.device)[:, None] + 0.5) / H
        offsets[..., 1, 3] = (torch.arange(W, dtype=votes.dtype, device=votes.device)[None, :] + 0.5) / W
        votes = votes + offsets[:, :, None, None]
    return votes.reshape(N, H * W * types, -1, 16)


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Switches every capsule layer inside `module` to `backend`; returns the module."""
    for layer in module.modules():
        if isinstance(layer, _CapsuleLayer):
            layer.backend = backend
    return module
