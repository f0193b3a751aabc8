"""The training loop of `capsroute train` (the package's docstring says what it does): the
Trainer, and run(), which takes the parsed command line."""

import argparse
import csv
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import __version__
from .._utils.command import CommandError
from .._utils.runinfo import (
    cpu_model,
    device_name,
    git_commit,
    precision_modes,
    replacing,
    resolve_device,
    write_json_atomic,
)
from ..datasets import affine_mnist, mnist
from ..losses import spread_margin
from . import augment, batching
from .args import (
    AMP_DTYPES,
    apply_recipe,
    check_arguments,
    checkpoint_args,
    choose_cuda_graph,
    resolve_run_dir,
)
from .cuda_graph import GraphedStep
from .distributed import Distributed
from .metrics import training_loss
from .model_config import model_for_run, parse_model_config
from .tasks import load_task, source_dataset

METRIC_FIELDS = [
    "epoch",
    "step",
    "lr",
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "val_error",
    "test_loss",
    "test_accuracy",
    "test_error",
    "epoch_seconds",
    "images_per_sec",
]


class FlooredExponentialLR(torch.optim.lr_scheduler.ExponentialLR):
    """ExponentialLR that stops decaying at min_lr (Efficient-CapsNet's floor); min_lr = 0 is
    ExponentialLR."""

    def __init__(self, optimizer: torch.optim.Optimizer, gamma: float, min_lr: float = 0.0):
        self.min_lr = min_lr
        super().__init__(optimizer, gamma)

    def get_lr(self) -> list[float]:
        return [max(lr, self.min_lr) for lr in super().get_lr()]


class StoppedBetweenSteps(KeyboardInterrupt):
    """Ctrl-C, taken after a whole training step."""


class Trainer:
    def __init__(self, args: argparse.Namespace, ddp: Distributed, device: torch.device):
        self.args, self.ddp, self.device = args, ddp, device
        self.commit = git_commit()  # of the code this process imported, whatever HEAD is by the end
        torch.manual_seed(args.seed)
        self.task, warning = load_task(args)
        if warning is not None and ddp.main:
            print(f"warning: {warning}", file=sys.stderr)
        self.train_size, self.test_size = self.task.train_size, self.task.test_size
        try:
            self.model = model_for_run(vars(args)).to(device)
        except (ValueError, RuntimeError) as e:  # sizes too small for the images, or too large
            raise CommandError(
                f"--model {args.model} --model-config {' '.join(args.model_config)}: "
                f"cannot build the network: {e}"
            ) from e
        self.net = (
            nn.parallel.DistributedDataParallel(self.model) if ddp.world_size > 1 else self.model
        )
        # fused: one pass over all parameters (docs/training.md); a resumed run keeps the
        # implementation its checkpoint names.
        self.optimizer = torch.optim.Adam(
            self.model.parameters(),
            lr=args.lr,
            weight_decay=args.weight_decay,
            fused=True,
            capturable=args.cuda_graph,
        )
        self.train_step = (
            GraphedStep(self._train_step, self.optimizer) if args.cuda_graph else self._train_step
        )
        self.steps_per_epoch = batching.num_batches(
            self.train_size, args.batch_size, world_size=ddp.world_size
        )
        # Exponential decay, applied smoothly every step: lr * decay ** (step / decay_steps), not
        # below min_lr; decay_steps 0 is one epoch.
        decay_steps = args.decay_steps or self.steps_per_epoch
        self.scheduler = FlooredExponentialLR(
            self.optimizer, args.lr_decay ** (1 / decay_steps), args.min_lr
        )
        self.amp_dtype = AMP_DTYPES[args.amp]
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype is torch.float16)
        self.epoch, self.step_in_epoch, self.step = 0, 0, 0
        # This epoch's sums so far (loss * n, correct, n, seconds): kept in checkpoints so that a
        # resumed epoch reports the same metrics as an uninterrupted one.
        self.epoch_sums = [0.0, 0.0, 0.0, 0.0]
        self.history: list[dict] = []
        self.stop_requested = False

    def autocast(self):
        return (
            nullcontext()
            if self.amp_dtype is None
            else torch.autocast(self.device.type, dtype=self.amp_dtype)
        )

    def margin(self) -> float:
        """MatrixCapsNet's spread-loss margin at this step."""
        return spread_margin(self.step, round(self.args.margin_ramp_epochs * self.steps_per_epoch))

    def _train_step(self, images, labels, targets, margin):
        """Forward, loss, backward and the optimizer's step: what --cuda-graph captures."""
        with self.autocast():
            out = self.net(images, labels)
            loss = training_loss(out, targets, labels, margin)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return out, loss

    def _training_batches(self):
        """This epoch's shuffled batches (images, labels, reconstruction targets) of this rank, from
        where the epoch stands (resume). Augmentation is drawn when a batch is taken: a function
        of self.step."""
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.epoch)
        return self.task.training_batches(
            self.args.batch_size,
            self._augment,
            generator=generator,
            rank=self.ddp.rank,
            world_size=self.ddp.world_size,
            skip=self.step_in_epoch,
        )

    def _on_device(self, batch, non_blocking: bool = False):
        """(images, labels, targets) on the device; targets that are the images move only once."""
        images, labels, targets = batch
        same = targets is images
        images, labels = (t.to(self.device, non_blocking=non_blocking) for t in (images, labels))
        return (
            images,
            labels,
            images if same else targets.to(self.device, non_blocking=non_blocking),
        )

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        forty = self.args.dataset == "mnist40"
        if self.args.augment == "shift" and self.args.shift == 0 and not forty:
            return images
        # A function of (seed, step) alone, so a resumed run augments exactly as an uninterrupted one.
        generator = torch.Generator().manual_seed(
            (self.args.seed * 1_000_003 + self.step) * 7919 + self.ddp.rank
        )
        if forty:  # the random place on the 40x40 canvas is the augmentation
            return affine_mnist.pad_shifted(images, generator)
        if self.args.augment == "efficientcapsnet":
            return augment.efficient_capsnet(images, generator)
        return batching.shift_augment(images, self.args.shift, generator=generator)

    # -- checkpoints -------------------------------------------------------------------------
    def state(self) -> dict:
        """Plain types and tensors only, so that a checkpoint loads with weights_only=True."""
        return {
            "capsroute": __version__,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "step": self.step,
            "epoch_sums": self.epoch_sums,
            "history": self.history,
            "torch_rng": torch.get_rng_state(),
            "args": checkpoint_args(self.args),
        }

    def load_state(self, state: dict) -> None:
        # Before loading: torch puts Adam's step counts on the device only for a capturable (or
        # fused) group, and a checkpoint from before fused Adam has neither.
        for group in state["optimizer"]["param_groups"]:
            group["capturable"] = self.args.cuda_graph  # about this process, not the run
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CommandError(
                f"{self.args.resume / 'checkpoint.pt'}: its network or optimizer does not fit "
                f"the run's options; --debug shows why"
            ) from e
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step_in_epoch, self.step = (
            state["epoch"],
            state["step_in_epoch"],
            state["step"],
        )
        self.epoch_sums, self.history = state["epoch_sums"], state["history"]
        torch.set_rng_state(state["torch_rng"])

    def save_checkpoint(self) -> None:
        if self.ddp.main:
            with replacing(self.args.out / "checkpoint.pt") as tmp:
                torch.save(self.state(), tmp)

    # -- the loop ----------------------------------------------------------------------------
    def train_epoch(self, progress) -> dict:
        self.net.train()
        # loss * n and correct on the device (no sync per step); the image count on the host
        sums = torch.tensor(self.epoch_sums[:2], dtype=torch.float64, device=self.device)
        seen = self.epoch_sums[2]
        start = time.perf_counter() - self.epoch_sums[3]
        try:
            for batch in self._training_batches():
                images, labels, targets = self._on_device(batch, non_blocking=True)
                out, loss = self.train_step(images, labels, targets, self.margin())
                self.scheduler.step()
                with torch.no_grad():
                    seen += len(labels)
                    sums += torch.stack(
                        [
                            loss.detach().double() * len(labels),
                            self.task.correct(out, labels, targets).sum().double(),
                        ]
                    )
                self.step += 1
                self.step_in_epoch += 1
                progress.update(1)
                if self.step_in_epoch % 10 == 0 or self.step_in_epoch == self.steps_per_epoch:
                    loss_sum, correct = sums.tolist()
                    rate = seen * self.ddp.world_size / (time.perf_counter() - start)
                    progress.set_postfix(
                        loss=f"{loss_sum / seen:.4f}",
                        acc=f"{correct / seen:.4f}",
                        img_s=f"{rate:.0f}",
                    )
                if self._interrupted():
                    raise StoppedBetweenSteps
                if self.args.max_steps is not None and self.step >= self.args.max_steps:
                    break
        finally:  # also on Ctrl-C: the checkpoint then carries this epoch's sums so far
            self.epoch_sums = sums.tolist() + [seen, time.perf_counter() - start]
        loss_sum, correct, seen = self.ddp.sum(self.epoch_sums[:3], self.device)
        elapsed = self.epoch_sums[3]
        return {
            "train_loss": loss_sum / max(seen, 1),
            "train_accuracy": correct / max(seen, 1),
            "epoch_seconds": elapsed,
            "images_per_sec": seen / elapsed if elapsed > 0 else 0.0,
        }

    def _interrupted(self) -> bool:
        """Ctrl-C is taken between steps only, so the checkpoint is always a whole step; under
        torch.distributed every rank stops after the same step."""
        if self.ddp.world_size == 1:
            return self.stop_requested
        flag = torch.tensor([float(self.stop_requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _request_stop(self, signum, frame) -> None:
        if self.stop_requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.stop_requested = True

    def _test_batches(self, split: str):
        """This rank's share of the test set (split "val": of the validation part) as (images,
        labels, reconstruction targets): unique samples, no padding to equal shards here."""
        size, batch = (
            (self.task.val_size, self.task.val_batch)
            if split == "val"
            else (self.test_size, self.task.test_batch)
        )
        index = torch.arange(size)[self.ddp.rank :: self.ddp.world_size]
        for start in range(0, len(index), self.args.batch_size):
            yield batch(index[start : start + self.args.batch_size])

    @torch.no_grad()
    def evaluate(self, split: str = "test") -> dict:
        """Test loss and error (split "val": of the validation part, the keys val_...; MultiMNIST: a pair is right when its two longest capsules are its two
        labels; multimnist-seg: the fraction of pixels right). MultiMNIST CapsNet also:
        test_recon_error, the mean squared pixel error of each digit's reconstruction from its own
        label's capsule against the digit alone; multimnist-seg: Dice and IoU (the task's
        test_metrics)."""
        self.net.eval()
        sums = 0  # loss * n, correct, then the task's test_sums
        seen = 0
        for batch in self._test_batches(split):
            images, labels, targets = self._on_device(batch)
            with self.autocast():
                out = self.model(images, self.task.test_labels_for(labels))
                loss = training_loss(out, targets, labels, self.margin())
            task_sums = self.task.test_sums(self.model, out, targets, labels)
            sums = sums + torch.cat(
                [
                    torch.stack(
                        [
                            loss.double() * len(labels),
                            self.task.correct(out, labels, targets).sum().double(),
                        ]
                    ),
                    task_sums.to(self.device, torch.float64),
                ]
            )
            seen += len(labels)
        if isinstance(sums, int):  # no test sample on this rank
            sums = torch.zeros(2 + self.task.test_sums_length, dtype=torch.float64)
        loss_sum, correct, *task_sums, seen = self.ddp.sum(sums.tolist() + [seen], self.device)
        accuracy = correct / max(seen, 1)
        metrics = {
            "test_loss": loss_sum / max(seen, 1),
            "test_accuracy": accuracy,
            "test_error": 1 - accuracy,
            **self.task.test_metrics(self.model, task_sums, seen),
        }
        return {key.replace("test_", f"{split}_", 1): value for key, value in metrics.items()}

    def _scored_split(self) -> str:
        """What each epoch scores: the validation part where there is one, else the test set."""
        return "val" if self.task.val_size else "test"

    def _reached_val_accuracy(self) -> bool:
        """--stop-at-val-accuracy: the last epoch's validation accuracy reached it."""
        target = self.args.stop_at_val_accuracy
        return (
            target is not None and bool(self.history) and self.history[-1]["val_accuracy"] >= target
        )

    def fit(self) -> dict | None:
        from tqdm import tqdm

        args = self.args
        total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps is not None:
            total_steps = min(total_steps, args.max_steps)
        progress = tqdm(
            total=total_steps,
            initial=self.step,
            disable=args.no_progress or not self.ddp.main,
            unit="step",
            dynamic_ncols=True,
        )
        if self.ddp.main:
            params = sum(p.numel() for p in self.model.parameters())
            start = (
                f"resuming at epoch {self.epoch + 1}, step {self.step}" if self.step else "starting"
            )
            samples = self.task.samples
            print(
                f"{args.model} ({params / 1e6:.2f}M parameters, {args.backend} backend, amp {args.amp}"
                f"{', CUDA graph' if args.cuda_graph else ''}) on "
                f"{args.dataset}: {self.train_size} training / {self.test_size} test {samples}, "
                f"{self.ddp.world_size} x {self.device}, batch {args.batch_size} x {self.ddp.world_size}, "
                f"{self.steps_per_epoch} steps per epoch; {start}; writing to {args.out}"
            )
        previous_handler = signal.signal(signal.SIGINT, self._request_stop)
        try:
            while self.epoch < args.epochs and not self._reached_val_accuracy():
                if args.max_steps is not None and self.step >= args.max_steps:
                    break
                progress.set_description(f"epoch {self.epoch + 1}/{args.epochs}")
                train = self.train_epoch(progress)
                if (
                    self.step_in_epoch < self.steps_per_epoch
                ):  # stopped by --max-steps inside the epoch
                    break
                metrics = {
                    "epoch": self.epoch + 1,
                    "step": self.step,
                    "lr": self.scheduler.get_last_lr()[0],
                    **train,
                    **self.evaluate(self._scored_split()),
                }
                self.history.append(metrics)
                self.epoch, self.step_in_epoch, self.epoch_sums = (
                    self.epoch + 1,
                    0,
                    [0.0, 0.0, 0.0, 0.0],
                )
                if self.ddp.main:
                    self.write_metrics()
                    split = self._scored_split()
                    progress.write(
                        f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f} "
                        f"acc {metrics['train_accuracy']:.4f} | {split} acc {metrics[f'{split}_accuracy']:.4f} "
                        f"error {100 * metrics[f'{split}_error']:.2f}% | {metrics['epoch_seconds']:.1f} s, "
                        f"{metrics['images_per_sec']:.0f} img/s"
                    )
                self.save_checkpoint()
        except KeyboardInterrupt as e:
            progress.close()
            if isinstance(e, StoppedBetweenSteps):
                self.save_checkpoint()
                message = f"interrupted at step {self.step}; checkpoint written"
            else:  # a second Ctrl-C, possibly inside a step: keep the last whole checkpoint
                message = "interrupted again; the last checkpoint is kept"
            if self.ddp.main:
                print(
                    f"\n{message}. Continue with: capsroute train --resume {args.out}",
                    file=sys.stderr,
                )
            raise
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        progress.close()
        self.save_checkpoint()
        if self.epoch < args.epochs and not self._reached_val_accuracy():
            if self.ddp.main:
                print(
                    f"stopped at step {self.step} (--max-steps); continue with --resume {args.out}"
                )
            return None
        return self.finish()

    def write_metrics(self) -> None:
        out = self.args.out
        fields = [k for k in METRIC_FIELDS if k in self.history[0]] + [
            k for k in self.history[0] if k not in METRIC_FIELDS
        ]  # test_recon_error
        with replacing(out / "metrics.csv") as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows({k: row[k] for k in fields} for row in self.history)
        write_json_atomic({"run": self.run_info(), "epochs": self.history}, out / "metrics.json")

    def run_info(self) -> dict:
        args = self.args
        info = {
            "kind": "train",
            "model": args.model,
            "dataset": args.dataset,
            "device": device_name(self.device),
            "devices": self.ddp.world_size,
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "commit": self.commit,
            "backend": args.backend,
            "amp": args.amp,
            **precision_modes(),
            "cuda_graph": args.cuda_graph,
            "batch_size": args.batch_size * self.ddp.world_size,
            "model_config": parse_model_config(args.model_config),
            "capsroute": __version__,
            "command": args.invocation,
            "resume_commands": args.resume_commands,
        }
        return {**info, **self.task.run_info()}

    def evaluate_checkpoint(self) -> dict:
        """--evaluate: the test metrics of the network at the checkpoint's step, into evaluation.json,
        and the figures that need only the network (pairs.png or reconstructions.png, perturbations.png)."""
        seen = self.step * self.args.batch_size * self.ddp.world_size
        result = {
            **self.run_info(),
            "step": self.step,
            "epochs": self.step / self.steps_per_epoch,
            "training_samples_seen": seen,
            **self.evaluate(),
            "date": time.strftime("%Y-%m-%d"),
        }
        if self.ddp.main:
            write_json_atomic(result, self.args.out / "evaluation.json")
            print(
                f"step {self.step} ({seen} training samples): test accuracy {100 * result['test_accuracy']:.2f}% "
                f"(error {100 * result['test_error']:.2f}%); wrote {self.args.out / 'evaluation.json'}"
            )
            if not self.args.no_plots:
                for png in self.plot(curves=bool(self.history)):
                    print(f"wrote {png}")
        return result

    def plot(self, curves: bool = True) -> list[Path]:
        from .plot import plot_run

        return plot_run(self.args.out, model=self.model, curves=curves, **self.task.figure_inputs())

    def finish(self) -> dict:
        """result.json: the last epoch's test metrics, or with --val-split its validation metrics
        and the test set scored once now."""
        last = self.history[-1]
        if self.task.val_size:
            last = {**last, **self.evaluate("test")}
        seconds = [m["epoch_seconds"] for m in self.history]
        result = {
            **self.run_info(),
            "epochs": len(self.history),
            "sec_per_epoch": sum(seconds) / len(seconds),
            "images_per_sec": sum(m["images_per_sec"] for m in self.history) / len(self.history),
            "test_error": last["test_error"],
            "test_accuracy": last["test_accuracy"],
            **{k: last[k] for k in ("val_accuracy", "val_error") if k in last},
            **(
                {"val_accuracy_reached": self._reached_val_accuracy()}
                if self.args.stop_at_val_accuracy is not None
                else {}
            ),
            **self.task.result_metrics(last),
            "date": time.strftime("%Y-%m-%d"),
        }
        if self.ddp.main:
            write_json_atomic(result, self.args.out / "result.json")
            print(
                f"test accuracy {100 * last['test_accuracy']:.2f}% (error {100 * last['test_error']:.2f}%), "
                f"{result['sec_per_epoch']:.1f} s/epoch; files in {self.args.out}"
            )
            if not self.args.no_plots:
                for png in self.plot():
                    print(f"wrote {png}")
        return result


def run(args: argparse.Namespace) -> int:
    """Trains (or with --evaluate scores) as args say; raises CommandError to refuse."""
    state = resolve_run_dir(args)
    recipe = apply_recipe(args) if state is None else {}
    check_arguments(args)  # everything that needs no data, before any data is read
    ddp = Distributed.from_env(resolve_device(args.device).type)
    if recipe and ddp.main:
        options = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in recipe.items())
        print(f"{args.model} on {args.dataset}: its recipe gives {options}")
    try:
        code = _train(args, ddp, state)
        if code == 0:  # the ranks close together: gloo aborts one whose peer is still at work
            ddp.barrier()
        return code
    finally:
        if ddp.world_size > 1:
            dist.destroy_process_group()


def _train(args: argparse.Namespace, ddp: Distributed, state: dict | None) -> int:
    device = resolve_device(args.device, ddp.local_rank)
    args.cuda_graph, eager_reason = choose_cuda_graph(args, device, ddp.world_size)
    if eager_reason and ddp.main:
        print(f"the eager training step: {eager_reason}", file=sys.stderr)
    if args.amp == "fp16" and device.type == "cpu" and ddp.main:
        print(
            "warning: --amp fp16 on a CPU runs about 15x slower than --amp bf16 (no fast float16 "
            "matrix products there); use --amp bf16 or none",
            file=sys.stderr,
        )
    if args.download and ddp.main:  # one process downloads; the others wait for it below
        try:
            mnist.find_dataset_files(source_dataset(args.dataset), args.data_dir, download=True)
        except (OSError, RuntimeError) as e:  # no mirror gave a good copy, or an unwritable folder
            raise CommandError(f"--download: {e}") from e
    ddp.barrier()
    trainer = Trainer(args, ddp, device)
    if state is not None:
        trainer.load_state(state)
    elif ddp.main:
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CommandError(f"--out {args.out}: cannot make the folder ({e.strerror})") from e
    if args.evaluate and args.eval_dataset is not None:
        from .robustness import evaluate_robustness

        evaluate_robustness(trainer)
        return 0
    if args.evaluate:
        trainer.evaluate_checkpoint()
        return 0
    try:
        trainer.fit()
    except KeyboardInterrupt:
        return 130
    return 0
