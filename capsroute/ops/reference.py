"""Plain PyTorch versions of every capsroute op: the test oracle and the benchmark baseline.

Written as a careful user would (einsum over whole tensors, no Python loops over capsules;
the loop over routing iterations is inherent). Argument names, defaults and autocast rules
match capsroute.
"""

import math

import torch
from torch import Tensor

from ._autocast import like_op


def _norm_and_nonzero(s: Tensor, dim: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(q = |s|^2, n = sqrt(q + eps), n > 0) over `dim`, with n = 1 where q + eps = 0 (s = 0 at
    eps = 0): the squashes take their limits there, and the gradients through the unused branch
    of their torch.where stay 0, not 0/0."""
    q = (s * s).sum(dim, keepdim=True)
    nonzero = q + eps > 0
    return q, torch.sqrt(torch.where(nonzero, q + eps, torch.ones_like(q))), nonzero


def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    q, n, nonzero = _norm_and_nonzero(s, dim, eps)
    scale = torch.where(nonzero, q / ((1 + q) * n), torch.zeros_like(q))
    # CUDA autocast sums in float32; the op returns the input's dtype (docs/ops.md, Autocast).
    return (scale * s).to(s.dtype)


def _coupling(logits: Tensor, leaky: bool) -> Tensor:
    if not leaky:
        return torch.softmax(logits, dim=-1)
    orphan = logits.new_zeros(logits.shape[:-1] + (1,))
    return torch.softmax(torch.cat([logits, orphan], dim=-1), dim=-1)[..., :-1]


@like_op("dynamic_routing")
def dynamic_routing_coupling(
    votes: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Returns (v (B, J, D), final coupling c (B, I, J))."""
    B, I, J, D = votes.shape
    logits = votes.new_zeros(B, I, J)
    for r in range(iters):
        c = _coupling(logits, leaky)
        if detach:  # the coupling is a constant of the backward pass
            c = c.detach()
        s = torch.einsum("bij,bijd->bjd", c, votes)
        if bias is not None:
            s = s + bias
        v = squash(s, eps=eps)
        if r < iters - 1:
            logits = logits + torch.einsum("bijd,bjd->bij", votes, v)
    return v, c


def dynamic_routing(
    votes: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    return dynamic_routing_coupling(votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps)[0]


def dense_votes(u: Tensor, weight: Tensor) -> Tensor:
    """votes_ij = weight_ij @ u_i: u (B, I, Din), weight (I, J, D, Din) -> (B, I, J, D)."""
    return torch.einsum("ijdk,bik->bijd", weight, u)


@like_op("dense_capsules")
def dense_capsules(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    return dynamic_routing(
        dense_votes(u, weight), iters, bias=bias, leaky=leaky, detach=detach, eps=eps
    )


def squash_exp(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """Efficient-CapsNet's squash (1 - exp(-n)) s / n, n = sqrt(|s|^2 + eps), over `dim`; its scale
    (1 - exp(-n)) / n is 1 at n = 0 (s = 0 at eps = 0), its limit."""
    q, n, nonzero = _norm_and_nonzero(s, dim, eps)
    scale = torch.where(nonzero, -torch.expm1(-n) / n, torch.ones_like(q))
    return (scale * s).to(s.dtype)


SQUASHES = {"sabour": squash, "efficient": squash_exp}


@like_op("self_attention_routing")
def self_attention_routing_coupling(
    votes: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Returns (v (B, J, D), coupling c (B, I, J)): docs/ops.md, self_attention_routing."""
    D = votes.shape[-1]
    total = votes.sum(1)  # (B, J, D): every vote for j
    logits = torch.einsum("bijd,bjd->bij", votes, total) / math.sqrt(D)
    c = torch.softmax(logits, dim=-1)
    if coupling_bias is not None:
        c = c + coupling_bias
    s = torch.einsum("bij,bijd->bjd", c, votes)
    return SQUASHES[squash](s, eps=eps), c


def self_attention_routing(
    votes: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> Tensor:
    return self_attention_routing_coupling(
        votes, coupling_bias=coupling_bias, squash=squash, eps=eps
    )[0]


@like_op("inverted_attention_routing")
def inverted_attention_routing_coupling(
    votes: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """Returns (v (B, J, D), final coupling c (B, I, J)): docs/ops.md, inverted_attention_routing."""
    B, I, J, D = votes.shape
    c = votes.new_full((B, I, J), 1.0 / J)
    for r in range(iters):
        s = torch.einsum("bij,bijd->bjd", c, votes)
        v = torch.nn.functional.layer_norm(s, (D,), norm_weight, norm_bias, eps)
        if r < iters - 1:
            c = torch.softmax(torch.einsum("bijd,bjd->bij", votes, v) / math.sqrt(D), dim=-1)
    return v, c


def inverted_attention_routing(
    votes: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    return inverted_attention_routing_coupling(
        votes, iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
    )[0]


def _em_m_step(
    R: Tensor, a_in: Tensor, votes: Tensor, beta_u: Tensor, beta_a: Tensor, lam: float, eps: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """EM's M-step over the inputs i of votes (..., I, J, H) with assignments R (..., I, J):
    (mean, variance, activation logit, votes - mean)."""
    r = R * a_in.unsqueeze(-1)  # (..., I, J)
    m = r.sum(-2)  # (..., J)
    mass = (m + eps).unsqueeze(-1)
    mu = torch.einsum("...ij,...ijh->...jh", r, votes) / mass  # (..., J, H)
    diff = votes - mu.unsqueeze(-3)
    var = torch.einsum("...ij,...ijh->...jh", r, diff * diff) / mass + eps
    cost = (beta_u.unsqueeze(-1) + 0.5 * torch.log(var)) * m.unsqueeze(-1)
    return mu, var, lam * (beta_a - cost.sum(-1)), diff


def _em_log_posterior(logit: Tensor, var: Tensor, diff: Tensor) -> Tensor:
    """ln a_j + ln p_ij of the E-step, (..., I, J): the log domain, never a product of densities."""
    log_p = -(
        diff * diff / (2 * var.unsqueeze(-3))
        + 0.5 * torch.log(var.unsqueeze(-3))
        + 0.5 * math.log(2 * math.pi)
    ).sum(-1)
    return torch.nn.functional.logsigmoid(logit).unsqueeze(-2) + log_p


def _em_lambda(final_lambda: float, t: int) -> float:
    return final_lambda * (1 - 0.95 ** (t + 1))


@like_op("dense_self_attention_routing")
def dense_self_attention_routing(
    u: Tensor,
    weight: Tensor,
    *,
    coupling_bias: Tensor | None = None,
    squash: str = "efficient",
    eps: float = 1e-8,
) -> Tensor:
    return self_attention_routing(
        dense_votes(u, weight), coupling_bias=coupling_bias, squash=squash, eps=eps
    )


@like_op("dense_inverted_attention_routing")
def dense_inverted_attention_routing(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    return inverted_attention_routing(
        dense_votes(u, weight), iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
    )


@like_op("dense_inverted_attention_routing")
def dense_inverted_attention_routing_pose(
    pose: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    norm_weight: Tensor | None = None,
    norm_bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    return inverted_attention_routing(
        pose_votes(pose, weight), iters, norm_weight=norm_weight, norm_bias=norm_bias, eps=eps
    )


@like_op("em_routing")
def em_routing(
    votes: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """EM routing (Hinton et al. 2018) as docs/ops.md states it: votes (B, I, J, H), a_in (B, I), beta_u and
    beta_a (J,) -> pose (B, J, H), a_out (B, J). Sums over i are divided by m_j + eps, so a capsule
    that receives no mass gets mean 0, variance eps and finite gradients."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    J = votes.shape[2]
    R = votes.new_full(votes.shape[:3], 1.0 / J)
    for t in range(iters):
        mu, var, logit, diff = _em_m_step(
            R, a_in, votes, beta_u, beta_a, _em_lambda(final_lambda, t), eps
        )
        if t < iters - 1:
            R = torch.softmax(_em_log_posterior(logit, var, diff), dim=-1)
    return mu, torch.sigmoid(logit)


def pose_votes(pose: Tensor, weight: Tensor) -> Tensor:
    """votes_ij = pose_i @ weight_ij: pose (B, I, 4, 4), weight (I, J, 4, 4) -> (B, I, J, 16)."""
    return torch.einsum("bikl,ijlm->bijkm", pose, weight).flatten(
        -2
    )  # 2x faster than a broadcast @


@like_op("em_routing_pose")
def em_routing_pose(
    pose: Tensor,
    weight: Tensor,
    a_in: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """em_routing over votes pose_i @ weight_ij; pose (B, I, 4, 4) or (B, I, 16)."""
    pose = pose.reshape(pose.shape[0], pose.shape[1], 4, 4)
    return em_routing(
        pose_votes(pose, weight), a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
    )


def conv_windows(
    H: int, W: int, kernel_size: int, stride: int, padding: int, device=None
) -> Tensor:
    """The flat index, in the padded (H + 2 padding) x (W + 2 padding) grid, of every window's
    positions: (H', W', K, K)."""
    Hp, Wp = H + 2 * padding, W + 2 * padding
    offsets = torch.arange(kernel_size, device=device)
    rows = torch.arange(0, Hp - kernel_size + 1, stride, device=device)[:, None] + offsets
    cols = torch.arange(0, Wp - kernel_size + 1, stride, device=device)[:, None] + offsets
    return rows[:, None, :, None] * Wp + cols[None, :, None, :]


def conv_capsule_votes(u: Tensor, weight: Tensor, stride: int = 1, padding: int = 0) -> Tensor:
    """The votes of a convolutional capsule layer: child type c at output position (y, x) votes for
    parent type o with sum_{ky, kx} weight[ky, kx, c, o] @ u[y stride + ky - padding, x stride + kx
    - padding, c] (zeros outside the input). u (B, H, W, C_in, Din), weight (K, K, C_in, C_out, D,
    Din) -> (B, H', W', C_in, C_out, D), through the unfolded windows (B, H', W', K, K, C_in, Din)."""
    B, H, W, C_in, Din = u.shape
    p = padding
    u = torch.nn.functional.pad(u, (0, 0, 0, 0, p, p, p, p))
    windows = conv_windows(H, W, weight.shape[0], stride, p, u.device)  # (H', W', K, K)
    window_u = u.flatten(1, 2)[:, windows]  # (B, H', W', K, K, C_in, Din)
    return torch.einsum("byxklci,klcodi->byxcod", window_u, weight)


@like_op("conv_dynamic_routing")
def conv_dynamic_routing(
    u: Tensor,
    weight: Tensor,
    iters: int = 3,
    *,
    bias: Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    leaky: bool = False,
    detach: bool = False,
    eps: float = 1e-8,
) -> Tensor:
    """dynamic_routing at every output position of a convolutional capsule layer, over the votes of
    conv_capsule_votes: u (B, H, W, C_in, Din), weight (K, K, C_in, C_out, D, Din) -> (B, H', W',
    C_out, D). Materialises the unfolded windows and every vote: the oracle, not a fast path."""
    votes = conv_capsule_votes(u, weight, stride, padding)
    v = dynamic_routing(votes.flatten(0, 2), iters, bias=bias, leaky=leaky, detach=detach, eps=eps)
    return v.unflatten(0, votes.shape[:3])


@like_op("conv_em_routing")
def conv_em_routing(
    pose: Tensor,
    a_in: Tensor,
    weight: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    stride: int = 1,
    padding: int = 0,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """EM routing in a convolutional capsule layer with the paper's cross-window E-step
    (docs/ops.md, conv_em_routing): pose (B, H, W, C_in, 4, 4) or (..., 16), a_in (B, H, W, C_in),
    weight (K, K, C_in, C_out, 4, 4) -> pose (B, H', W', C_out, 16), a_out (B, H', W', C_out).
    Unfolds the poses into windows and materialises every vote: the oracle, not a fast path."""
    mu, logit, _ = _conv_em(
        pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps
    )
    return mu, torch.sigmoid(logit)


def conv_em_assignments(
    pose: Tensor,
    a_in: Tensor,
    weight: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    iters: int = 3,
    *,
    stride: int = 1,
    padding: int = 0,
    final_lambda: float = 0.01,
    eps: float = 1e-6,
) -> Tensor:
    """For inspection: the assignments R of conv_em_routing's last M-step, (B, H', W', K*K*C_in, C_out),
    the window's children in (ky, kx, c) order; entries of padded positions are meaningless."""
    return _conv_em(pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps)[
        2
    ]


def _conv_em(pose, a_in, weight, beta_u, beta_a, iters, stride, padding, final_lambda, eps):
    """(mean, logit, assignments) of conv_em_routing's last M-step."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    B, H, W, C_in = a_in.shape
    K, C_out = weight.shape[0], weight.shape[3]
    p = padding
    # Padded positions are no capsules: activation 0, so they take no part in any sum.
    pose = torch.nn.functional.pad(pose.reshape(B, H, W, C_in, 16), (0, 0, 0, 0, p, p, p, p))
    a_in = torch.nn.functional.pad(a_in, (0, 0, p, p, p, p))
    windows = conv_windows(H, W, K, stride, p, pose.device)  # (H', W', K, K)
    Ho, Wo = windows.shape[:2]
    children = pose.shape[1] * pose.shape[2]
    window_poses = pose.flatten(1, 2)[:, windows].unflatten(
        -1, (4, 4)
    )  # (B, H', W', K, K, C_in, 4, 4)
    votes = torch.einsum("byxklcpq,klcoqr->byxklcopr", window_poses, weight)
    votes = votes.flatten(-2).reshape(B, Ho, Wo, K * K * C_in, C_out, 16)
    a_win = a_in.flatten(1, 2)[:, windows].reshape(B, Ho, Wo, K * K * C_in)
    child = windows.flatten()  # the child of each window entry
    covering = torch.zeros(children, dtype=pose.dtype, device=pose.device).index_add_(
        0, child, torch.ones_like(child, dtype=pose.dtype)
    )
    R = (
        (1 / (covering[windows] * C_out))
        .unsqueeze(-1)
        .expand(Ho, Wo, K, K, C_in)
        .reshape(Ho, Wo, -1)
    )
    R = R.unsqueeze(-1).expand(B, Ho, Wo, K * K * C_in, C_out)
    for t in range(iters):
        mu, var, logit, diff = _em_m_step(
            R, a_win, votes, beta_u, beta_a, _em_lambda(final_lambda, t), eps
        )
        if t == iters - 1:
            break
        # E-step: a softmax over every (window, parent) pair that contains the child.
        log_post = _em_log_posterior(logit, var, diff).reshape(B, Ho, Wo, K, K, C_in, C_out)
        by_child = (B, Ho * Wo * K * K, C_in)
        index = child[None, :, None].expand(by_child)
        # The shift only keeps exp finite; the softmax does not depend on it.
        shift = log_post.detach().amax(-1).reshape(by_child)
        shift = shift.new_full((B, children, C_in), -math.inf).scatter_reduce(
            1, index, shift, "amax"
        )
        shift = shift[:, windows].unsqueeze(-1)  # (B, H', W', K, K, C_in, 1)
        weights = torch.exp(log_post - shift)
        total = weights.new_zeros(B, children, C_in).index_add(
            1, child, weights.sum(-1).reshape(by_child)
        )
        R = (weights / total[:, windows].unsqueeze(-1)).reshape(B, Ho, Wo, K * K * C_in, C_out)
    return mu, logit, R
