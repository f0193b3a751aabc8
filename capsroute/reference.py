"""Plain PyTorch versions of every capsroute op: the test oracle and the benchmark baseline.

Written as a careful user would (einsum over whole tensors, no Python loops over capsules;
the loop over routing iterations is inherent). Argument names, defaults and autocast rules
match capsroute.
"""
import math

import torch
from torch import Tensor

from ._autocast import like_op


def squash(s: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    q = (s * s).sum(dim, keepdim=True)
    return q / (1 + q) * s / torch.sqrt(q + eps)


def _coupling(logits: Tensor, leaky: bool) -> Tensor:
    if not leaky:
        return torch.softmax(logits, dim=-1)
    orphan = logits.new_zeros(logits.shape[:-1] + (1,))
    return torch.softmax(torch.cat([logits, orphan], dim=-1), dim=-1)[..., :-1]


@like_op("dynamic_routing")
def dynamic_routing_coupling(votes: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                             detach: bool = False, eps: float = 1e-8) -> tuple[Tensor, Tensor]:
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


def dynamic_routing(votes: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                    detach: bool = False, eps: float = 1e-8) -> Tensor:
    return dynamic_routing_coupling(votes, iters, bias=bias, leaky=leaky, detach=detach, eps=eps)[0]


def dense_votes(u: Tensor, weight: Tensor) -> Tensor:
    """votes_ij = weight_ij @ u_i: u (B, I, Din), weight (I, J, D, Din) -> (B, I, J, D)."""
    return torch.einsum("ijdk,bik->bijd", weight, u)


@like_op("dense_capsules")
def dense_capsules(u: Tensor, weight: Tensor, iters: int = 3, *, bias: Tensor | None = None, leaky: bool = False,
                   detach: bool = False, eps: float = 1e-8) -> Tensor:
    return dynamic_routing(dense_votes(u, weight), iters, bias=bias, leaky=leaky, detach=detach, eps=eps)


@like_op("em_routing")
def em_routing(votes: Tensor, a_in: Tensor, beta_u: Tensor, beta_a: Tensor, iters: int = 3, *,
               final_lambda: float = 0.01, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """EM routing (Hinton et al. 2018) as docs/ops.md states it: votes (B, I, J, H), a_in (B, I), beta_u and
    beta_a (J,) -> pose (B, J, H), a_out (B, J). Sums over i are divided by m_j + eps, so a capsule
    that receives no mass gets mean 0, variance eps and finite gradients."""
    B, I, J, H = votes.shape
    log_2pi = math.log(2 * math.pi)
    R = votes.new_full((B, I, J), 1.0 / J)
    for t in range(iters):
        lam = final_lambda * (1 - 0.95 ** (t + 1))
        # M-step
        r = R * a_in.unsqueeze(-1)                                     # (B, I, J)
        m = r.sum(1)                                                   # (B, J)
        mass = (m + eps).unsqueeze(-1)
        mu = torch.einsum("bij,bijh->bjh", r, votes) / mass            # (B, J, H)
        diff = votes - mu.unsqueeze(1)
        var = torch.einsum("bij,bijh->bjh", r, diff * diff) / mass + eps
        cost = (beta_u.unsqueeze(-1) + 0.5 * torch.log(var)) * m.unsqueeze(-1)
        logit = lam * (beta_a - cost.sum(-1))                          # (B, J)
        if t == iters - 1:
            return mu, torch.sigmoid(logit)
        # E-step, in the log domain
        log_p = -(diff * diff / (2 * var.unsqueeze(1)) + 0.5 * torch.log(var.unsqueeze(1)) + 0.5 * log_2pi).sum(-1)
        R = torch.softmax(torch.nn.functional.logsigmoid(logit).unsqueeze(1) + log_p, dim=-1)
    raise ValueError(f"iters must be >= 1, got {iters}")


def pose_votes(pose: Tensor, weight: Tensor) -> Tensor:
    """votes_ij = pose_i @ weight_ij: pose (B, I, 4, 4), weight (I, J, 4, 4) -> (B, I, J, 16)."""
    return torch.einsum("bikl,ijlm->bijkm", pose, weight).flatten(-2)  # 2x faster than a broadcast @


@like_op("em_routing_pose")
def em_routing_pose(pose: Tensor, weight: Tensor, a_in: Tensor, beta_u: Tensor, beta_a: Tensor, iters: int = 3, *,
                    final_lambda: float = 0.01, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """em_routing over votes pose_i @ weight_ij; pose (B, I, 4, 4) or (B, I, 16)."""
    pose = pose.reshape(pose.shape[0], pose.shape[1], 4, 4)
    return em_routing(pose_votes(pose, weight), a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps)
