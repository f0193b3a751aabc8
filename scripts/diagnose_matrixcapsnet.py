"""Trains MatrixCapsNet for a few hundred steps and logs what EM routing does inside it.

  python scripts/diagnose_matrixcapsnet.py --data-dir tests/data/mnist-small --steps 300 --log-every 50 \
      --model-config A=64 B=8 C=16 D=16 --lr 1e-2 --out diag.json

Every --log-every steps a fixed batch of test images goes through the network on a recording
backend (EM routing in plain PyTorch, checked against capsroute.reference, that keeps its last
iteration) and this prints, per EM layer: the output activations, the spread of the votes and of
the output poses, the mass m_j, the log-variance part of the cost, the last inverse temperature
times beta_a and times the cost, and the last assignment probabilities R (mean of max_j R, and
the entropy / ln J: 1 is uniform). For the class layer also the logits of the true class and of
the best wrong one, and test accuracy. Training runs on --backend (fused by default).
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch

from capsroute import nn as capsnn, reference
from capsroute.datasets import mnist
from capsroute.losses import spread_loss, spread_margin
from capsroute.models import MatrixCapsNet
from capsroute.train import batching
from capsroute.train.model_config import parse_model_config


class RecordingEm:
    """A capsroute backend whose EM routing records the quantities of its last iteration."""

    def __init__(self):
        self.records: list[dict] = []

    def em_routing(self, votes, a_in, beta_u, beta_a, iters=3, *, final_lambda=0.01, eps=1e-6):
        J = votes.shape[2]
        R = votes.new_full(votes.shape[:3], 1.0 / J)
        for t in range(iters):  # DESIGN.md 2.3, the reference's loop with its intermediates kept
            lam = final_lambda * (1 - 0.95 ** (t + 1))
            r = R * a_in[..., None]
            m = r.sum(1)
            mu = torch.einsum("bij,bijh->bjh", r, votes) / (m + eps)[..., None]
            diff = votes - mu[:, None]
            var = torch.einsum("bij,bijh->bjh", r, diff * diff) / (m + eps)[..., None] + eps
            log_var_term = (0.5 * var.log()).sum(-1)
            cost = (votes.shape[3] * beta_u + log_var_term) * m  # sum_h cost_jh
            logit = lam * (beta_a - cost)
            if t < iters - 1:
                log_p = -(
                    diff * diff / (2 * var[:, None])
                    + 0.5 * var[:, None].log()
                    + 0.5 * math.log(2 * math.pi)
                ).sum(-1)
                R = torch.softmax(torch.nn.functional.logsigmoid(logit)[:, None] + log_p, dim=-1)
        a_out = torch.sigmoid(logit)
        pose_ref, a_ref = reference.em_routing(
            votes, a_in, beta_u, beta_a, iters, final_lambda=final_lambda, eps=eps
        )
        torch.testing.assert_close((mu, a_out), (pose_ref, a_ref), rtol=1e-3, atol=1e-4)
        entropy = -(R.clamp_min(1e-30).log() * R).sum(-1) / math.log(J)
        self.records.append(
            {
                "I": votes.shape[1],
                "J": J,
                "a_in_mean": a_in.mean().item(),
                "a_out_mean": a_out.mean().item(),
                "a_out_std": a_out.std().item(),
                "logit_mean": logit.mean().item(),
                "logit_std_over_j": logit.std(-1).mean().item(),
                "vote_std": votes.std(1)
                .mean()
                .item(),  # spread of the votes for one output capsule
                "pose_std": mu.std(0).mean().item(),  # spread of the output poses over the batch
                "var_mean": var.mean().item(),
                "mass_mean": m.mean().item(),
                "log_var_term_mean": log_var_term.mean().item(),
                "lam": lam,
                "lam_beta_a_mean": (lam * beta_a).mean().item(),
                "lam_cost_mean": (lam * cost).mean().item(),
                "lam_cost_std_over_j": (lam * cost).std(-1).mean().item(),
                "R_max_mean": R.max(-1).values.mean().item(),
                "R_entropy": entropy.mean().item(),
            }
        )
        return mu, a_out

    def em_routing_pose(
        self, pose, weight, a_in, beta_u, beta_a, iters=3, *, final_lambda=0.01, eps=1e-6
    ):
        pose = pose.reshape(pose.shape[0], pose.shape[1], 4, 4)
        return self.em_routing(
            reference.pose_votes(pose, weight),
            a_in,
            beta_u,
            beta_a,
            iters,
            final_lambda=final_lambda,
            eps=eps,
        )


LAYERS = ("conv_caps1", "conv_caps2", "classes")


@torch.no_grad()
def probe(model: MatrixCapsNet, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """One recorded forward pass of `images` in eval mode: the records of each EM layer."""
    recorder = RecordingEm()
    capsnn.BACKENDS["recording"] = recorder
    backend = model.classes.backend
    was_training = model.training
    try:
        model.eval()
        capsnn.set_backend(model, "recording")
        out = model(images.double() if next(model.parameters()).dtype == torch.float64 else images)
    finally:
        capsnn.set_backend(model, backend)
        del capsnn.BACKENDS["recording"]
        model.train(was_training)
    row = dict(zip(LAYERS, recorder.records))
    a = out.activations.clamp(1e-7, 1 - 1e-7)
    logits = (a / (1 - a)).log()
    true = logits.gather(1, labels[:, None])[:, 0]
    wrong = logits.scatter(1, labels[:, None], -math.inf).max(1).values
    row["class_logit_true_mean"], row["class_logit_wrong_max_mean"] = (
        true.mean().item(),
        wrong.mean().item(),
    )
    row["class_a_true_mean"] = a.gather(1, labels[:, None]).mean().item()
    row["class_a_wrong_mean"] = (
        ((a.sum(1) - a.gather(1, labels[:, None])[:, 0]) / (a.shape[1] - 1)).mean().item()
    )
    return row


@torch.no_grad()
def accuracy(model, images, labels, batch_size=250) -> float:
    model.eval()
    correct = sum(
        (
            model(images[s : s + batch_size].float().div(255)).scores.argmax(-1)
            == labels[s : s + batch_size]
        )
        .sum()
        .item()
        for s in range(0, len(labels), batch_size)
    )
    model.train()
    return correct / len(labels)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data-dir", type=Path, default=Path("tests/data/mnist-small"))
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--model-config", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", default="fused")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--margin-ramp-steps", type=int, default=500)
    p.add_argument("--margin-start", type=float, default=0.2)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    train_images, train_labels = mnist.load_dataset(args.dataset, args.data_dir, "train")
    test_images, test_labels = mnist.load_dataset(args.dataset, args.data_dir, "test")
    probe_images, probe_labels = test_images[:64].float().div(255), test_labels[:64]
    model = MatrixCapsNet(backend=args.backend, **parse_model_config(args.model_config))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    rows, step, epoch, start = [], 0, 0, time.perf_counter()
    losses = []
    while step < args.steps:
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch)
        for images, labels in batching.batches(
            train_images, train_labels, args.batch_size, generator=generator
        ):
            if step % args.log_every == 0:
                row = {
                    "step": step,
                    "seconds": time.perf_counter() - start,
                    "train_loss": sum(losses) / max(len(losses), 1),
                    **probe(model, probe_images, probe_labels),
                }
                losses.clear()
                rows.append(row)
                print(summary(row), flush=True)
            if args.shift:
                images = batching.shift_augment(
                    images, args.shift, torch.Generator().manual_seed(step)
                )
            margin = spread_margin(step, args.margin_ramp_steps, start=args.margin_start)
            loss = spread_loss(model(images, labels).activations, labels, margin)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    final = {
        "step": step,
        "seconds": time.perf_counter() - start,
        "train_loss": sum(losses) / len(losses),
        **probe(model, probe_images, probe_labels),
        "test_accuracy": accuracy(model, test_images, test_labels),
    }
    rows.append(final)
    print(summary(final), flush=True)
    print(
        f"test accuracy {final['test_accuracy']:.4f} after {step} steps, {final['seconds']:.0f} s"
    )
    if args.out:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1)
        )


def summary(row: dict) -> str:
    layers = " | ".join(
        f"{name}: a {r['a_out_mean']:.2f}+-{r['a_out_std']:.2f} vote_sd {r['vote_std']:.3g} pose_sd {r['pose_std']:.3g}"
        f" m {r['mass_mean']:.2f} lnvar/2 {r['log_var_term_mean']:.1f} lam*b_a {r['lam_beta_a_mean']:.2f}"
        f" lam*cost {r['lam_cost_mean']:.2f}(sd_j {r['lam_cost_std_over_j']:.2f}) R_max {r['R_max_mean']:.2f}"
        f" H(R) {r['R_entropy']:.2f}"
        for name, r in ((n, row[n]) for n in LAYERS)
    )
    return (
        f"step {row['step']:4d} loss {row['train_loss']:.4f} class logit true {row['class_logit_true_mean']:.2f}"
        f" wrong-max {row['class_logit_wrong_max_mean']:.2f} || {layers}"
    )


if __name__ == "__main__":
    main()
