"""Vector capsule layers routed by agreement: primary, fully connected, convolutional (SegCaps'
locally-constrained routing) and its transposed-convolution twin."""

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import CapsuleLayer, check_counts

Upsampling = Literal["transpose", "nearest"]


class PrimaryCapsules(CapsuleLayer):
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


class DenseCapsules(CapsuleLayer):
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


class ConvDynamicCapsules(CapsuleLayer):
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


class DeconvCapsules(CapsuleLayer):
    """The up-sampling capsule layer of SegCaps ("deconvolutional capsules"): each input capsule
    type votes for every output type through a K x K transposed convolution of its capsules (one
    transform shared over the input types, as SegCaps has it), and the C_in votes at each output
    position are routed by `iters` iterations of dynamic routing (softmax over the output types).

        u_hat[y, x, c, o] = sum over (i, j, ky, kx) with y = i s + ky - p, x = j s + kx - p of
                            W[ky, kx, o] u[i, j, c]
        v[y, x, o] = squash(sum_c c_co u_hat[y, x, c, o] + bias_o)

    How: a transposed convolution of stride s is a stride-1 convolution of the input with s - 1
    zero capsules inserted between neighbours and K - 1 - p zero capsules around it (the kernel
    flipped, which a learned kernel absorbs). The layer builds that zero-inserted grid, (B, (H - 1)
    s + 1 + 2 (K - 1 - p) + output_padding, ..., C_in, Din), and hands it to
    capsroute.conv_dynamic_routing with stride 1 and no padding. A zero capsule adds nothing to
    a vote, and every position still routes exactly C_in children (child type c's vote sums its
    window, zeros included), so the result is exactly SegCaps' transposed-convolution votes routed
    by SegCaps' update_routing: the same function, not an approximation.

    Why not the two alternatives:
    - Materialising the votes with conv_transpose2d and routing them with
      capsroute.dynamic_routing: the same function, but the votes tensor (B, H', W', C_in, C_out,
      D) is stored for the backward pass, C_out * D / Din times the zero-inserted grid (8x in
      SegCaps' first up layer, 8 types of 32D in and out; 2x in SegCapsNet's default layers). On
      the fused op the votes are computed a chunk of positions at a time and never stored; what is
      kept is the zero-inserted grid, s^2 times the input (4x at stride 2). Measured at SegCaps' first up
      layer (32 x 32 -> 64 x 64, 8 types of 32D in and out, K = 4, forward and backward, one CPU
      thread): 44 MiB of peak memory per image against 101 MiB, in three quarters of the time.
    - upsampling="nearest" (SegCaps' "resize"): each child capsule copied into an s x s block,
      then the same routing with "same" padding. A different function: every output phase sees
      tied sums of one kernel's taps (a transposed convolution with constrained weights), no
      checkerboard pattern from the zeros (Odena et al. 2016), and no multiply-adds spent on zero
      capsules (with "transpose", 1 - 1/s^2 of the window taps are zeros: 3/4 at stride 2; the
      kernel does them all). Offered for users of SegCaps' resize option.

    Args:
        in_types: C_in, the capsule types per input position.
        in_dim: Din, values per input capsule.
        out_types: C_out, the capsule types per output position.
        out_dim: D, values per output capsule.
        kernel_size: K (SegCaps: 4 for "transpose", 5 for "nearest").
        stride: s, the up-sampling factor (SegCaps' scaling, 2).
        padding: p of the transposed convolution; "same" gives an output of s H (K - s even:
            p = (K - s) / 2; else output_padding adds the missing row and column).
        output_padding: zero rows and columns added at the bottom and right ("transpose") to reach
            an odd output size, as conv_transpose2d's.
        iters: routing iterations (>= 1).
        upsampling: "transpose" (the default, SegCaps' "deconv") or "nearest" (SegCaps' "resize").
        share_weights: one transform for every input type (SegCaps'); else one per input type.
        bias: learn a bias (C_out, D) added before the squash.
        backend: "fused" (capsroute.conv_dynamic_routing: the votes never stored) or "reference"
            (plain PyTorch, every vote materialised).

    Parameters: weight (K, K, C_in or 1, C_out, D, Din), N(0, s^2 / (K K Din)) ("transpose": a
    window holds about K K / s^2 real children); bias (C_out, D), zeros, or None.

    Shapes: u (N, H, W, C_in, Din) -> v (N, H', W', C_out, D): "transpose", H' = (H - 1) s - 2 p +
    K + output_padding; "nearest", H' = s H (W' likewise).
    """

    def __init__(
        self,
        in_types: int,
        in_dim: int,
        out_types: int,
        out_dim: int,
        kernel_size: int = 4,
        stride: int = 2,
        padding: int | Literal["same"] = "same",
        output_padding: int = 0,
        iters: int = 3,
        *,
        upsampling: Upsampling = "transpose",
        share_weights: bool = True,
        bias: bool = True,
        backend: str = "fused",
    ):
        super().__init__(backend)
        if upsampling not in ("transpose", "nearest"):
            raise ValueError(f"upsampling must be 'transpose' or 'nearest', got {upsampling!r}")
        if stride < 1 or kernel_size < 1:
            raise ValueError(f"stride and kernel_size must be >= 1, got {stride}, {kernel_size}")
        if padding == "same":
            # H' = s H: 2 p - output_padding = K - s
            padding = max((kernel_size - stride + 1) // 2, 0)
            output_padding = 2 * padding - (kernel_size - stride)
        if not isinstance(padding, int) or not 0 <= padding <= kernel_size - 1:
            raise ValueError(f"padding must be in 0..kernel_size - 1 or 'same', got {padding!r}")
        if not 0 <= output_padding < stride:
            raise ValueError(f"output_padding must be in 0..stride - 1, got {output_padding}")
        self.conv = ConvDynamicCapsules(
            in_types,
            in_dim,
            out_types,
            out_dim,
            kernel_size,
            stride=1,
            padding=0,
            iters=iters,
            share_weights=share_weights,
            bias=bias,
            backend=backend,
        )
        with torch.no_grad():
            self.conv.weight.mul_(stride if upsampling == "transpose" else 1)
        self.stride, self.padding, self.output_padding = stride, padding, output_padding
        self.upsampling = upsampling

    @CapsuleLayer.backend.setter
    def backend(self, value: str):
        CapsuleLayer.backend.fset(self, value)
        if "conv" in self._modules:
            self.conv.backend = value

    @property
    def weight(self) -> Tensor:
        return self.conv.weight

    @property
    def bias(self) -> Tensor | None:
        return self.conv.bias

    def upsampled(self, u: Tensor) -> Tensor:
        """The grid the stride-1 routing reads: u with zeros inserted and padded ("transpose"),
        or each capsule repeated s x s times and padded "same" ("nearest")."""
        N, H, W, C, Din = u.shape
        s, K = self.stride, self.conv.weight.shape[0]
        if self.upsampling == "nearest":
            up = u.repeat_interleave(s, 1).repeat_interleave(s, 2)
            lo = (K - 1) // 2
            return F.pad(up, (0, 0, 0, 0, lo, K - 1 - lo, lo, K - 1 - lo))
        edge = K - 1 - self.padding
        side_h, side_w = (H - 1) * s + 1, (W - 1) * s + 1
        grid = u.new_zeros(
            N,
            side_h + 2 * edge + self.output_padding,
            side_w + 2 * edge + self.output_padding,
            C,
            Din,
        )
        grid[:, edge : edge + side_h : s, edge : edge + side_w : s] = u
        return grid

    def forward(self, u: Tensor) -> Tensor:
        if u.dim() != 5 or u.shape[3] != self.conv.in_types:
            raise ValueError(
                f"DeconvCapsules: u must be (N, H, W, {self.conv.in_types}, Din), got {tuple(u.shape)}"
            )
        return self.conv(self.upsampled(u))

    def extra_repr(self) -> str:
        K, _, types, C_out, D, Din = self.conv.weight.shape
        return (
            f"{self.conv.in_types}x{Din}D -> {C_out}x{D}D, kernel_size={K}, stride={self.stride}, "
            f"padding={self.padding}, output_padding={self.output_padding}, "
            f"upsampling={self.upsampling!r}, iters={self.conv.iters}, {super().extra_repr()}"
        )
