"""Matrix capsule layers routed by EM (Hinton et al. 2018): primary, convolutional and class
capsules. Poses (N, H, W, types, 16) and activations (N, H, W, types) keep the grid."""

import typing
from typing import Literal

import torch
from torch import Tensor, nn

from ..ops._autocast import like_op
from ._base import CapsuleLayer, check_counts

# Where ConvCapsules normalises a child's assignments (its docstring).
ConvRouting = Literal["window", "cross-window"]
CONV_ROUTINGS = typing.get_args(ConvRouting)


class PrimaryMatrixCapsules(nn.Module):
    """Primary matrix capsules (Hinton et al. 2018): at every position, 1x1 convolutions give each
    of `types` capsules a 4x4 pose and an activation.

        M_t = conv_pose(x)_t (16 values),  a_t = sigmoid(conv_activation(x)_t)

    Args:
        in_channels: channels C of the input feature map.
        types: capsule types per position.

    Shapes:
        x (N, C, H, W) -> pose (N, H, W, types, 16) (row-major 4x4), activation (N, H, W, types).
    """

    def __init__(self, in_channels: int, types: int):
        super().__init__()
        check_counts(in_channels=in_channels, types=types)
        self.types = types
        self.pose = nn.Conv2d(in_channels, types * 16, 1)
        self.activation = nn.Conv2d(in_channels, types, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        N, _, H, W = x.shape
        pose = self.pose(x).view(N, self.types, 16, H, W).permute(0, 3, 4, 1, 2)
        return pose, torch.sigmoid(self.activation(x)).permute(0, 2, 3, 1)


class _EmCapsules(CapsuleLayer):
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

    def __init__(
        self,
        inputs: int,
        out_types: int,
        iters: int,
        final_lambda: float,
        backend: str,
        *,
        normalize_cost: bool = False,
        min_var: float = 1e-6,
        weight_std: float = 0.5,
        pose_norm: bool = False,
    ):
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
        lam = (
            self.final_lambda * self.beta_a.numel() / inputs
            if self.normalize_cost
            else self.final_lambda
        )
        return {"final_lambda": lam, "eps": self.min_var}

    def extra_repr(self) -> str:
        return (
            f"iters={self.iters}, final_lambda={self.final_lambda}, normalize_cost={self.normalize_cost}, "
            f"min_var={self.min_var}, pose_norm={self.pose_norm}, {super().extra_repr()}"
        )


class ConvCapsules(_EmCapsules):
    """Convolutional matrix capsules (Hinton et al. 2018): the k x k window of input capsules
    (k * k * in_types of them) at each output position is routed by EM routing to `out_types`
    capsules there.

        V_ij = M_i W_ij (4x4 products);  pose_j, a_j = EM routing of V, a_in, beta_u, beta_a

    The transformation matrices W depend on the position inside the window and the types, not on
    the window; the fused backend computes the votes inside the kernel and never stores them.
    `routing` says where a child's assignments are normalised:
    - "window": each window on its own (capsroute.em_routing_pose over the unfolded windows): a
      child in several overlapping windows spends its whole vote in each.
    - "cross-window": the paper's (capsroute.conv_em_routing): one distribution over every parent
      of every window that contains the child, the poses never unfolded. With stride = k (no
      overlap) both give the same result.

    Args:
        in_types, out_types: capsule types in and out.
        kernel_size, stride: of the window (no padding).
        iters: EM iterations (>= 1).
        final_lambda: the inverse temperature's scale: iteration t uses
            final_lambda * (1 - 0.95^(t + 1)).
        routing: "window" or "cross-window".
        backend: "fused" or "reference".
        **options: normalize_cost, min_var, weight_std, pose_norm (see _EmCapsules).

    Parameters: weight (k * k * in_types, out_types, 4, 4), N(0, weight_std^2); beta_u and
    beta_a (out_types,), zeros.

    Shapes:
        pose (N, H, W, in_types, 16), activation (N, H, W, in_types) -> pose (N, H', W', out_types,
        16), activation (N, H', W', out_types), H' = (H - kernel_size) // stride + 1 (W' likewise).
    """

    def __init__(
        self,
        in_types: int,
        out_types: int,
        kernel_size: int = 3,
        stride: int = 1,
        iters: int = 3,
        *,
        final_lambda: float = 0.01,
        routing: ConvRouting = "window",
        backend: str = "fused",
        **options,
    ):
        if routing not in CONV_ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(CONV_ROUTINGS)}, got {routing!r}")
        check_counts(in_types=in_types, out_types=out_types, kernel_size=kernel_size, stride=stride)
        super().__init__(
            kernel_size * kernel_size * in_types, out_types, iters, final_lambda, backend, **options
        )
        self.kernel_size, self.stride, self.routing = kernel_size, stride, routing

    def forward(self, pose: Tensor, activation: Tensor) -> tuple[Tensor, Tensor]:
        k, s = self.kernel_size, self.stride
        N, H, W, types, _ = _check_matrix_capsules(
            pose, activation, self.weight.shape[0] // (k * k)
        )
        if H < k or W < k:
            raise ValueError(f"pose's grid ({H} x {W}) must be at least the kernel ({k} x {k})")
        pose = self._normalized(pose)
        if self.routing == "cross-window":
            # weight rows are (row, column, type) inside the window, as the unfold below orders them
            out_pose, out_a = self.ops.conv_em_routing(
                pose,
                activation,
                self.weight.view(k, k, types, -1, 4, 4),
                self.beta_u,
                self.beta_a,
                self.iters,
                stride=s,
                **self._routing_options(self.weight.shape[0]),
            )
            return out_pose.reshape(*out_a.shape, 16), out_a
        # (N, H', W', types, 16, k, k) -> one routing problem per output position: (N H' W', k k types, 16)
        windows = pose.unfold(1, k, s).unfold(2, k, s)
        Ho, Wo = windows.shape[1], windows.shape[2]
        windows = windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(N * Ho * Wo, k * k * types, 16)
        a_windows = (
            activation.unfold(1, k, s)
            .unfold(2, k, s)
            .permute(0, 1, 2, 4, 5, 3)
            .reshape(N * Ho * Wo, -1)
        )
        out_pose, out_a = self.ops.em_routing_pose(
            windows,
            self.weight,
            a_windows,
            self.beta_u,
            self.beta_a,
            self.iters,
            **self._routing_options(windows.shape[1]),
        )
        return out_pose.view(N, Ho, Wo, -1, 16), out_a.view(N, Ho, Wo, -1)

    def extra_repr(self) -> str:
        return (
            f"k={self.kernel_size}, stride={self.stride}, routing={self.routing!r}, "
            f"{super().extra_repr()}"
        )


class ClassCapsules(_EmCapsules):
    """Class capsules (Hinton et al. 2018), the last matrix-capsule layer: every input capsule at
    every position votes for each class with a matrix shared across positions, and all
    H * W * in_types votes are routed together by EM routing (capsroute.em_routing).

        V_ij = M_i W_type(i),j (+ the position's scaled (row, column) in entries (0, 3), (1, 3));
        pose_j, a_j = em_routing(V, a_in, beta_u, beta_a)

    With coordinate addition the centre of input capsule i's position, (row + 0.5) / H and
    (column + 0.5) / W, is added to the first two entries of the vote's last column, so the class
    poses know where their parts were.

    Args:
        in_types: capsule types per input position.
        classes: output capsules, one per class.
        iters: EM iterations (>= 1).
        coordinate_addition: add the positions to the votes as above.
        final_lambda: the inverse temperature's scale: iteration t uses
            final_lambda * (1 - 0.95^(t + 1)).
        backend: "fused" or "reference".
        **routing: normalize_cost, min_var, weight_std, pose_norm (see _EmCapsules).

    Parameters: weight (in_types, classes, 4, 4), N(0, weight_std^2); beta_u and beta_a
    (classes,), zeros.

    Shapes:
        pose (N, H, W, in_types, 16), activation (N, H, W, in_types) -> pose (N, classes, 16),
        activation (N, classes).
    """

    def __init__(
        self,
        in_types: int,
        classes: int,
        iters: int = 3,
        *,
        coordinate_addition: bool = True,
        final_lambda: float = 0.01,
        backend: str = "fused",
        **routing,
    ):
        check_counts(in_types=in_types, classes=classes)
        super().__init__(in_types, classes, iters, final_lambda, backend, **routing)
        self.coordinate_addition = coordinate_addition

    def forward(self, pose: Tensor, activation: Tensor) -> tuple[Tensor, Tensor]:
        _check_matrix_capsules(pose, activation, self.weight.shape[0])
        votes = _class_votes(self._normalized(pose), self.weight, self.coordinate_addition)
        return self.ops.em_routing(
            votes,
            activation.flatten(1),
            self.beta_u,
            self.beta_a,
            self.iters,
            **self._routing_options(votes.shape[1]),
        )

    def extra_repr(self) -> str:
        return f"coordinate_addition={self.coordinate_addition}, {super().extra_repr()}"


def _check_matrix_capsules(pose: Tensor, activation: Tensor, types: int) -> torch.Size:
    """pose (N, H, W, types, 16) and activation (N, H, W, types) as the matrix-capsule layers take
    them; returns pose's shape."""
    if pose.dim() != 5 or pose.shape[3:] != (types, 16):
        raise ValueError(
            f"pose must have shape (N, H, W, {types}, 16) for this layer's {types} input types, "
            f"got {tuple(pose.shape)}"
        )
    if activation.shape != pose.shape[:4]:
        raise ValueError(
            f"activation must have shape {tuple(pose.shape[:4])} to match pose, got "
            f"{tuple(activation.shape)}"
        )
    return pose.shape


@like_op("em_routing")
def _class_votes(pose: Tensor, weight: Tensor, coordinate_addition: bool) -> Tensor:
    """ClassCapsules' votes (N, H W types, classes, 16), under em_routing's autocast rule: they are
    its input, and small differences between them are what it divides by."""
    N, H, W, types, _ = pose.shape
    votes = torch.einsum("nhwtrk,tcks->nhwtcrs", pose.view(N, H, W, types, 4, 4), weight)
    if coordinate_addition:
        offsets = votes.new_zeros(H, W, 4, 4)
        offsets[..., 0, 3] = (
            torch.arange(H, dtype=votes.dtype, device=votes.device)[:, None] + 0.5
        ) / H
        offsets[..., 1, 3] = (
            torch.arange(W, dtype=votes.dtype, device=votes.device)[None, :] + 0.5
        ) / W
        votes = votes + offsets[:, :, None, None]
    return votes.reshape(N, H * W * types, -1, 16)
