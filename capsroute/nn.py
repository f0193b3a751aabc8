"""Capsule layers on the fused routing ops.

Every layer but PrimaryMatrixCapsules (convolutions only) takes `backend="fused"` (the capsroute
kernels) or `backend="reference"` (the plain PyTorch versions in capsroute.reference); both compute
the same function with the same parameters, so one model can be A/B-compared by switching the
attribute.

Shapes: vector capsules are (N, capsules, dim); matrix capsules keep the grid,
poses (N, H, W, types, 16) and activations (N, H, W, types).
"""

import operator
import typing
from typing import Literal

import torch
from torch import Tensor, nn

from . import ops, reference
from ._autocast import like_op

BACKENDS = {"fused": ops, "reference": reference}
# Where ConvCapsules normalises a child's assignments (its docstring).
ConvRouting = Literal["window", "cross-window"]
CONV_ROUTINGS = typing.get_args(ConvRouting)


def check_counts(**counts) -> None:
    """Constructor arguments that count capsules, values or positions: each an integer >= 1
    (numpy's too)."""
    for name, value in counts.items():
        try:
            valid = not isinstance(value, bool) and operator.index(value) >= 1
        except TypeError:
            valid = False
        if not valid:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


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
    """Primary capsules (Sabour et al. 2017): a convolution whose channels are grouped into `types`
    capsules of `dim` values at every position, each squashed.

        u_k = squash(conv(x)_k)   for each of the types * H' * W' capsules k

    Args:
        in_channels: channels C of the input feature map.
        types: capsule types per position.
        dim: values per capsule.
        kernel_size, stride: of the convolution (no padding).
        backend: "fused" (capsroute ops) or "reference" (plain PyTorch).

    Shapes:
        x (N, C, H, W) -> u (N, types * H' * W', dim), H' = (H - kernel_size) // stride + 1 (W'
        likewise), ordered type-major: capsule (t, y, x) at index t * H' * W' + y * W' + x.
    """

    def __init__(
        self,
        in_channels: int,
        types: int = 32,
        dim: int = 8,
        kernel_size: int = 9,
        stride: int = 2,
        backend: str = "fused",
    ):
        super().__init__(backend)
        check_counts(in_channels=in_channels, types=types, dim=dim)  # nn.Conv2d checks the rest
        self.types, self.dim = types, dim
        self.conv = nn.Conv2d(in_channels, types * dim, kernel_size, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv(x)
        N, _, H, W = y.shape
        s = (
            y.view(N, self.types, self.dim, H, W)
            .permute(0, 1, 3, 4, 2)
            .reshape(N, self.types * H * W, self.dim)
        )
        return self.ops.squash(s)


class DenseCapsules(_CapsuleLayer):
    """Fully connected capsules routed by agreement (Sabour et al. 2017): every input capsule
    votes for every output capsule through its own matrix, and `iters` iterations of dynamic
    routing decide how much each vote counts (capsroute.dense_capsules).

        u_hat_ij = W_ij u_i;  b = 0;  repeat iters times:  c_i = softmax_j(b_i),
        v_j = squash(sum_i c_ij u_hat_ij + bias_j),  b_ij += <u_hat_ij, v_j>

    Args:
        in_capsules: I, the input capsules.
        in_dim: Din, values per input capsule.
        out_capsules: J, the output capsules.
        out_dim: D, values per output capsule.
        iters: routing iterations (>= 1).
        bias: learn a bias (J, D) added before the squash.
        leaky: add an orphan output with logit 0 to the softmax, so votes that agree with no
            output capsule can go nowhere.
        detach: treat the couplings c as constants in the backward pass (the gradient flows
            only through the last weighted sum).
        backend: "fused" (capsroute ops; the votes are never stored) or "reference".

    Parameters: weight (I, J, D, Din), initialised N(0, 0.01^2); bias (J, D), zeros, or None.

    Shapes: u (N, I, Din) -> v (N, J, D).
    """

    def __init__(
        self,
        in_capsules: int,
        in_dim: int,
        out_capsules: int,
        out_dim: int,
        iters: int = 3,
        *,
        bias: bool = True,
        leaky: bool = False,
        detach: bool = False,
        backend: str = "fused",
    ):
        super().__init__(backend)
        check_counts(
            in_capsules=in_capsules, in_dim=in_dim, out_capsules=out_capsules, out_dim=out_dim
        )
        self.iters, self.leaky, self.detach = iters, leaky, detach
        self.weight = nn.Parameter(0.01 * torch.randn(in_capsules, out_capsules, out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_capsules, out_dim)) if bias else None

    def forward(self, u: Tensor) -> Tensor:
        return self.ops.dense_capsules(
            u, self.weight, self.iters, bias=self.bias, leaky=self.leaky, detach=self.detach
        )

    def extra_repr(self) -> str:
        I, J, D, Din = self.weight.shape
        return f"{I}x{Din}D -> {J}x{D}D, iters={self.iters}, leaky={self.leaky}, {super().extra_repr()}"


class ConvDynamicCapsules(_CapsuleLayer):
    """Convolutional capsules routed by agreement: SegCaps' locally-constrained dynamic routing
    (LaLonde and Bagci 2018, capsroute.conv_dynamic_routing). At every output position each input
    capsule type votes for every output type through a K x K convolution of its capsules, and
    `iters` iterations of dynamic routing over the position's votes (softmax over the output types)
    give the output capsules.

        u_hat[y, x, c, o] = sum_{ky, kx} W[ky, kx, c, o] u[y s + ky - p, x s + kx - p, c]
        v[y, x, o] = squash(sum_c c_co u_hat[y, x, c, o] + bias_o),  c = dynamic routing's couplings

    Args:
        in_types: C_in, the capsule types per input position.
        in_dim: Din, values per input capsule.
        out_types: C_out, the capsule types per output position.
        out_dim: D, values per output capsule.
        kernel_size: K of the K x K windows.
        stride: of the windows.
        padding: positions of zero capsules on every side; "same" is (K - 1) // 2, which keeps the
            grid's size at stride 1 for an odd K.
        iters: routing iterations (>= 1).
        share_weights: one transform per window offset and output type for every input type
            (SegCaps'); else one per input type as well (C_in times the parameters).
        bias: learn a bias (C_out, D) added before the squash.
        leaky: add an orphan output with logit 0 to the softmax.
        backend: "fused" (capsroute ops; the votes are never stored for the whole batch) or
            "reference" (plain PyTorch, every vote materialised).

    Parameters: weight (K, K, C_in or 1, C_out, D, Din), initialised N(0, 1 / (K K Din)); bias
    (C_out, D), zeros, or None.

    Shapes: u (N, H, W, C_in, Din) -> v (N, H', W', C_out, D), H' = (H + 2 padding - K) // stride
    + 1 (W' likewise).
    """

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        kernel_size: int = 5,
        stride: int = 1,
        padding: int | Literal["same"] = "same",
        iters: int = 3,
        *,
        share_weights: bool = True,
        bias: bool = True,
        leaky: bool = False,
        backend: str = "fused",
    ):
        super().__init__(backend)
        check_counts(
            in_types=in_types,
            in_dim=in_dim,
            out_types=out_types,
            out_dim=out_dim,
            kernel_size=kernel_size,
            stride=stride,
        )
        if padding == "same":
            padding = (kernel_size - 1) // 2
        if not isinstance(padding, int) or padding < 0:
            raise ValueError(f"padding must be an int >= 0 or 'same', got {padding!r}")
        self.in_types, self.stride, self.padding = in_types, stride, padding
        self.iters, self.leaky = iters, leaky
        types = 1 if share_weights else in_types
        scale = (kernel_size * kernel_size * in_dim) ** -0.5
        self.weight = nn.Parameter(
            scale * torch.randn(kernel_size, kernel_size, types, out_types, out_dim, in_dim)
        )
        self.bias = nn.Parameter(torch.zeros(out_types, out_dim)) if bias else None

    def forward(self, u: Tensor) -> Tensor:
        K, _, _, C_out, D, Din = self.weight.shape
        weight = self.weight.expand(K, K, self.in_types, C_out, D, Din)
        return self.ops.conv_dynamic_routing(
            u,
            weight,
            self.iters,
            bias=self.bias,
            stride=self.stride,
            padding=self.padding,
            leaky=self.leaky,
        )

    def extra_repr(self) -> str:
        K, _, types, C_out, D, Din = self.weight.shape
        return (
            f"{self.in_types}x{Din}D -> {C_out}x{D}D, kernel_size={K}, stride={self.stride}, "
            f"padding={self.padding}, iters={self.iters}, share_weights={types == 1}, "
            f"{super().extra_repr()}"
        )


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


def set_backend(module: nn.Module, backend: str) -> nn.Module:
    """Switches every capsule layer inside `module` to `backend`; returns the module."""
    for layer in module.modules():
        if isinstance(layer, _CapsuleLayer):
            layer.backend = backend
    return module
