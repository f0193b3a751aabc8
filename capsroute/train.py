"""`capsroute train`: train CapsNet or MatrixCapsNet on MNIST or Fashion-MNIST, or CapsNet on MultiMNIST.

  capsroute train --model capsnet --data-dir ../shared/data/mnist --epochs 30
  capsroute train --dataset multimnist --data-dir ../shared/data/mnist --pairs-per-digit 1 --epochs 1
  torchrun --nproc-per-node 4 -m capsroute.train --model capsnet ...      (one process per GPU)

Everything a run writes goes to --out (default runs/<model>-<dataset>): metrics.csv and
metrics.json after every epoch, checkpoint.pt (written atomically after every epoch, on Ctrl-C
and at --max-steps), result.json at the end (the "train" record of bench/README.md) and the PNG figures.
`--resume DIR` continues exactly where the checkpoint stopped: same step, optimizer, scheduler
and data order (the order and the augmentation are functions of the seed, epoch and step).
"""
import argparse
import csv
import dataclasses
import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from . import data, multimnist
from ._runinfo import command_line, device_name, git_commit, replacing, resolve_device, write_json_atomic
from .losses import spread_margin, training_loss
from .models import MODELS, CapsNet, model_for_run, parse_model_config
from .multimnist import pair_correct
from .nn import BACKENDS

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# A resumed run keeps its own arguments (model, data, optimizer, seed..., the command that started
# it) except these: taken from the new command line always, or only when given there.
RESUME_FROM_COMMAND_LINE = {"max_steps", "no_progress", "no_plots", "download", "evaluate"}
RESUME_OVERRIDES = {"epochs", "device", "data_dir", "test_subset"}
METRIC_FIELDS = ["epoch", "step", "lr", "train_loss", "train_accuracy", "test_loss", "test_accuracy", "test_error",
                 "epoch_seconds", "images_per_sec"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.set_defaults(invocation=None)  # the command as typed, for the records (None from Python)
    p.add_argument("--model", choices=sorted(MODELS), default="capsnet", help="the network")
    p.add_argument("--model-config", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE",
                   help="constructor arguments of the model, e.g. conv_channels=64 (CapsNet) or A=32 (MatrixCapsNet)")
    p.add_argument("--dataset", choices=sorted([*data.DATASETS, "multimnist"]), default="mnist",
                   help="the images; multimnist: pairs of overlapping MNIST digits (capsroute.multimnist)")
    p.add_argument("--data-dir", type=Path, default=Path(os.environ.get("CAPSROUTE_DATA", "data")),
                   help="folder with the IDX .gz files ($CAPSROUTE_DATA when set; MNIST's for multimnist)")
    p.add_argument("--pairs-per-digit", type=int, default=1,
                   help=f"multimnist: training pairs per training digit, 1..{multimnist.MAX_PAIRS_PER_DIGIT} "
                        "(an epoch of 60,000 pairs per unit; the test set is fixed: one pair per test digit)")
    p.add_argument("--download", action="store_true", help="download missing files (checksums verified)")
    p.add_argument("--epochs", type=int, default=10, help="passes over the training images")
    p.add_argument("--batch-size", type=int, default=128, help="per process")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--lr-decay", type=float, default=0.96, help="multiplied into the learning rate every --decay-steps")
    p.add_argument("--decay-steps", type=int, default=2000, help="steps per --lr-decay factor")
    p.add_argument("--weight-decay", type=float, default=0.0, help="Adam's L2 penalty")
    p.add_argument("--shift", type=int, default=2,
                   help="random shift augmentation in pixels (0: none); multimnist shifts each digit by up to 4")
    p.add_argument("--margin-ramp-epochs", type=float, default=5.0,
                   help="MatrixCapsNet: epochs over which the spread-loss margin grows from 0.2 to 0.9")
    p.add_argument("--amp", choices=sorted(AMP_DTYPES), default="none", help="mixed precision (autocast)")
    p.add_argument("--backend", choices=sorted(BACKENDS), default="fused",
                   help="fused capsroute kernels, or the plain PyTorch reference")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="initial weights, data order and augmentation")
    p.add_argument("--train-subset", type=int, default=None, help="use the first N training images")
    p.add_argument("--test-subset", type=int, default=None, help="use the first N test images (multimnist: pairs)")
    p.add_argument("--max-steps", type=int, default=None, help="stop (with a checkpoint) after this many steps")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<model>-<dataset>)")
    p.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR", help="continue the run in this folder")
    p.add_argument("--evaluate", action="store_true",
                   help="with --resume: score the checkpoint's network as it stands (even mid-epoch) on the test set "
                        "into RUN_DIR/evaluation.json and draw its figures, without training")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="do not draw figures at the end")


def _key_value(item: str) -> str:
    """An item of --model-config, checked here and kept as text (the checkpoint stores the arguments as given)."""
    try:
        parse_model_config([item])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return item


@dataclasses.dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, device_kind: str) -> "Distributed":
        """Under torchrun (WORLD_SIZE > 1) joins the process group: NCCL on GPUs, gloo on CPUs."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls()
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo")
        return cls(dist.get_rank(), world_size, int(os.environ.get("LOCAL_RANK", "0")))

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        if self.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.tolist()


class StoppedBetweenSteps(KeyboardInterrupt):
    """Ctrl-C, taken after a whole training step."""


class Trainer:
    def __init__(self, args: argparse.Namespace, ddp: Distributed, device: torch.device):
        self.args, self.ddp, self.device = args, ddp, device
        self.commit = git_commit()  # of the code this process imported, whatever HEAD is by the end
        torch.manual_seed(args.seed)
        self.pairs = args.dataset == "multimnist"
        if self.pairs and args.model not in ("capsnet", "cnn"):
            raise SystemExit(f"--dataset multimnist trains capsnet or cnn, not {args.model}")
        self.train_images, self.train_labels = self._load("train", args.train_subset)
        # MultiMNIST's test pairs take their second digits from the whole test split.
        self.test_images, self.test_labels = self._load("test", None if self.pairs else args.test_subset)
        self.train_size, self.test_size = len(self.train_labels), len(self.test_labels)
        if self.pairs:
            self.train_pairs = multimnist.MultiMNIST(self.train_images, self.train_labels, args.pairs_per_digit,
                                                     seed=args.seed)
            self.test_pairs = multimnist.test_pairs(self.test_images, self.test_labels)
            self.train_size = len(self.train_pairs)
            self.test_size = min(len(self.test_pairs), args.test_subset or len(self.test_pairs))
            self.test_checksum = multimnist.checksum(self.test_pairs, count=self.test_size)
            if len(self.test_pairs) == self.test_size == 10_000 and self.test_checksum != multimnist.MNIST_TEST_CHECKSUM:
                print(f"warning: these 10,000 test pairs are not the standard ones (checksum {self.test_checksum}, "
                      f"expected {multimnist.MNIST_TEST_CHECKSUM}): are {args.data_dir}'s files MNIST's?",
                      file=sys.stderr)
        self.model = model_for_run(vars(args)).to(device)
        self.net = nn.parallel.DistributedDataParallel(self.model) if ddp.world_size > 1 else self.model
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        # Exponential decay, applied smoothly every step: lr * decay ** (step / decay_steps).
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, args.lr_decay ** (1 / args.decay_steps))
        self.amp_dtype = AMP_DTYPES[args.amp]
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.amp_dtype is torch.float16)
        self.steps_per_epoch = data.num_batches(self.train_size, args.batch_size, world_size=ddp.world_size)
        self.epoch, self.step_in_epoch, self.step = 0, 0, 0
        # This epoch's sums so far (loss * n, correct, n, seconds): kept in checkpoints so that a
        # resumed epoch reports the same metrics as an uninterrupted one.
        self.epoch_sums = [0.0, 0.0, 0.0, 0.0]
        self.history: list[dict] = []
        self.stop_requested = False

    def _load(self, split: str, subset: int | None):
        images, labels = data.load_dataset("mnist" if self.pairs else self.args.dataset, self.args.data_dir, split)
        return images[:subset], labels[:subset]

    def autocast(self):
        return nullcontext() if self.amp_dtype is None else torch.autocast(self.device.type, dtype=self.amp_dtype)

    def loss(self, out, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ramp_steps = round(self.args.margin_ramp_epochs * self.steps_per_epoch)
        return training_loss(out, images, labels, spread_margin(self.step, ramp_steps))

    def _training_batches(self):
        """This epoch's shuffled batches (images, labels, reconstruction targets) of this rank, from
        where the epoch stands (resume). The targets are the images themselves, or for MultiMNIST
        the two digits of each pair."""
        generator = torch.Generator().manual_seed(self.args.seed * 1_000_003 + self.epoch)
        shard = {"generator": generator, "rank": self.ddp.rank, "world_size": self.ddp.world_size,
                 "skip": self.step_in_epoch}
        if self.pairs:
            yield from self.train_pairs.batches(self.args.batch_size, **shard)
            return
        for images, labels in data.batches(self.train_images, self.train_labels, self.args.batch_size, **shard):
            images = self._augment(images)  # drawn when the batch is taken: a function of self.step
            yield images, labels, images

    def _on_device(self, batch, non_blocking: bool = False):
        """(images, labels, targets) on the device; targets that are the images move only once."""
        images, labels, targets = batch
        same = targets is images
        images, labels = (t.to(self.device, non_blocking=non_blocking) for t in (images, labels))
        return images, labels, images if same else targets.to(self.device, non_blocking=non_blocking)

    def _augment(self, images: torch.Tensor) -> torch.Tensor:
        if self.args.shift == 0:
            return images
        # A function of (seed, step) alone, so a resumed run augments exactly as an uninterrupted one.
        generator = torch.Generator().manual_seed((self.args.seed * 1_000_003 + self.step) * 7919 + self.ddp.rank)
        return data.shift_augment(images, self.args.shift, generator=generator)

    # -- checkpoints -------------------------------------------------------------------------
    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "step": self.step,
                "epoch_sums": self.epoch_sums, "history": self.history, "torch_rng": torch.get_rng_state(),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(self.args).items()}}

    def load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.step_in_epoch, self.step = state["epoch"], state["step_in_epoch"], state["step"]
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
                with self.autocast():
                    out = self.net(images, labels)
                    loss = self.loss(out, targets, labels)
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.scheduler.step()
                with torch.no_grad():
                    seen += len(labels)
                    sums += torch.stack([loss.detach().double() * len(labels),
                                         pair_correct(out.scores, labels).sum().double()])
                self.step += 1
                self.step_in_epoch += 1
                progress.update(1)
                if self.step_in_epoch % 10 == 0 or self.step_in_epoch == self.steps_per_epoch:
                    loss_sum, correct = sums.tolist()
                    rate = seen * self.ddp.world_size / (time.perf_counter() - start)
                    progress.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.4f}",
                                         img_s=f"{rate:.0f}")
                if self._interrupted():
                    raise StoppedBetweenSteps
                if self.args.max_steps is not None and self.step >= self.args.max_steps:
                    break
        finally:  # also on Ctrl-C: the checkpoint then carries this epoch's sums so far
            self.epoch_sums = sums.tolist() + [seen, time.perf_counter() - start]
        loss_sum, correct, seen = self.ddp.sum(self.epoch_sums[:3], self.device)
        elapsed = self.epoch_sums[3]
        return {"train_loss": loss_sum / max(seen, 1), "train_accuracy": correct / max(seen, 1),
                "epoch_seconds": elapsed, "images_per_sec": seen / elapsed if elapsed > 0 else 0.0}

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

    def _test_batches(self):
        """This rank's share of the test set as (images, labels, reconstruction targets): unique
        samples, no padding to equal shards here."""
        index = torch.arange(self.test_size)[self.ddp.rank::self.ddp.world_size]
        for start in range(0, len(index), self.args.batch_size):
            chunk = index[start:start + self.args.batch_size]
            if self.pairs:
                yield self.test_pairs.float_pairs(chunk)
            else:
                images = self.test_images[chunk].float().div_(255)
                yield images, self.test_labels[chunk], images

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Test loss and error (MultiMNIST: a pair is right when its two longest capsules are its two
        labels). MultiMNIST CapsNet also: test_recon_error, the mean squared pixel error of each
        digit's reconstruction from its own label's capsule against the digit alone."""
        self.net.eval()
        reconstructs = self.pairs and isinstance(self.model, CapsNet)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss * n, correct, squared error
        seen = 0
        for batch in self._test_batches():
            images, labels, targets = self._on_device(batch)
            with self.autocast():
                # MultiMNIST reconstructs each digit from its label's capsule, as in training.
                out = self.model(images, labels if self.pairs else None)
                loss = self.loss(out, targets, labels)
            squared_error = (out.reconstructions.float() - targets.flatten(2)).square().sum() if reconstructs else 0
            sums += torch.stack([loss.double() * len(labels), pair_correct(out.scores, labels).sum().double(),
                                 torch.as_tensor(squared_error, dtype=torch.float64, device=self.device)])
            seen += len(labels)
        loss_sum, correct, squared_error, seen = self.ddp.sum(sums.tolist() + [seen], self.device)
        accuracy = correct / max(seen, 1)
        metrics = {"test_loss": loss_sum / max(seen, 1), "test_accuracy": accuracy, "test_error": 1 - accuracy}
        if reconstructs:
            metrics["test_recon_error"] = squared_error / max(2 * seen * multimnist.SIZE ** 2, 1)
        return metrics

    def fit(self) -> dict | None:
        from tqdm import tqdm

        args = self.args
        total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps is not None:
            total_steps = min(total_steps, args.max_steps)
        progress = tqdm(total=total_steps, initial=self.step, disable=args.no_progress or not self.ddp.main,
                        unit="step", dynamic_ncols=True)
        if self.ddp.main:
            params = sum(p.numel() for p in self.model.parameters())
            start = f"resuming at epoch {self.epoch + 1}, step {self.step}" if self.step else "starting"
            samples = "pairs" if self.pairs else "images"
            print(f"{args.model} ({params / 1e6:.2f}M parameters, {args.backend} backend, amp {args.amp}) on "
                  f"{args.dataset}: {self.train_size} training / {self.test_size} test {samples}, "
                  f"{self.ddp.world_size} x {self.device}, batch {args.batch_size} x {self.ddp.world_size}, "
                  f"{self.steps_per_epoch} steps per epoch; {start}; writing to {args.out}")
        previous_handler = signal.signal(signal.SIGINT, self._request_stop)
        try:
            while self.epoch < args.epochs:
                if args.max_steps is not None and self.step >= args.max_steps:
                    break
                progress.set_description(f"epoch {self.epoch + 1}/{args.epochs}")
                train = self.train_epoch(progress)
                if self.step_in_epoch < self.steps_per_epoch:  # stopped by --max-steps inside the epoch
                    break
                metrics = {"epoch": self.epoch + 1, "step": self.step, "lr": self.scheduler.get_last_lr()[0],
                           **train, **self.evaluate()}
                self.history.append(metrics)
                self.epoch, self.step_in_epoch, self.epoch_sums = self.epoch + 1, 0, [0.0, 0.0, 0.0, 0.0]
                if self.ddp.main:
                    self.write_metrics()
                    progress.write(f"epoch {metrics['epoch']}: train loss {metrics['train_loss']:.4f} "
                                   f"acc {metrics['train_accuracy']:.4f} | test acc {metrics['test_accuracy']:.4f} "
                                   f"error {100 * metrics['test_error']:.2f}% | {metrics['epoch_seconds']:.1f} s, "
                                   f"{metrics['images_per_sec']:.0f} img/s")
                self.save_checkpoint()
        except KeyboardInterrupt as e:
            progress.close()
            if isinstance(e, StoppedBetweenSteps):
                self.save_checkpoint()
                message = f"interrupted at step {self.step}; checkpoint written"
            else:  # a second Ctrl-C, possibly inside a step: keep the last whole checkpoint
                message = "interrupted again; the last checkpoint is kept"
            if self.ddp.main:
                print(f"\n{message}. Continue with: capsroute train --resume {args.out}", file=sys.stderr)
            raise
        finally:
            signal.signal(signal.SIGINT, previous_handler)
        progress.close()
        self.save_checkpoint()
        if self.epoch < args.epochs:
            if self.ddp.main:
                print(f"stopped at step {self.step} (--max-steps); continue with --resume {args.out}")
            return None
        return self.finish()

    def write_metrics(self) -> None:
        out = self.args.out
        fields = METRIC_FIELDS + [k for k in self.history[0] if k not in METRIC_FIELDS]  # test_recon_error
        with replacing(out / "metrics.csv") as tmp, open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fields)
            writer.writeheader()
            writer.writerows({k: row[k] for k in fields} for row in self.history)
        write_json_atomic({"run": self.run_info(), "epochs": self.history}, out / "metrics.json")

    def run_info(self) -> dict:
        args = self.args
        info = {"kind": "train", "model": args.model, "dataset": args.dataset, "device": device_name(self.device),
                "devices": self.ddp.world_size, "torch": torch.__version__, "commit": self.commit,
                "backend": args.backend, "amp": args.amp, "batch_size": args.batch_size * self.ddp.world_size,
                "model_config": parse_model_config(args.model_config),
                "command": self.args.invocation}
        if self.pairs:  # equal checksums: the same test pairs (README: MultiMNIST)
            info.update(train_pairs=self.train_size, test_pairs=self.test_size, test_checksum=self.test_checksum)
        return info

    def evaluate_checkpoint(self) -> dict:
        """--evaluate: the test metrics of the network at the checkpoint's step, into evaluation.json,
        and the figures that need only the network (pairs.png or reconstructions.png, perturbations.png)."""
        seen = self.step * self.args.batch_size * self.ddp.world_size
        result = {**self.run_info(), "step": self.step, "epochs": self.step / self.steps_per_epoch,
                  "training_samples_seen": seen, **self.evaluate(), "date": time.strftime("%Y-%m-%d")}
        if self.ddp.main:
            write_json_atomic(result, self.args.out / "evaluation.json")
            print(f"step {self.step} ({seen} training samples): test accuracy {100 * result['test_accuracy']:.2f}% "
                  f"(error {100 * result['test_error']:.2f}%); wrote {self.args.out / 'evaluation.json'}")
            if not self.args.no_plots:
                for png in self.plot(curves=bool(self.history)):
                    print(f"wrote {png}")
        return result

    def plot(self, curves: bool = True) -> list[Path]:
        from .train_plot import plot_run

        test = {"pairs": self.test_pairs} if self.pairs else {"images": self.test_images[:64]}
        return plot_run(self.args.out, model=self.model, curves=curves, **test)

    def finish(self) -> dict:
        last = self.history[-1]
        seconds = [m["epoch_seconds"] for m in self.history]
        result = {**self.run_info(), "epochs": len(self.history), "sec_per_epoch": sum(seconds) / len(seconds),
                  "images_per_sec": sum(m["images_per_sec"] for m in self.history) / len(self.history),
                  "test_error": last["test_error"], "test_accuracy": last["test_accuracy"],
                  "date": time.strftime("%Y-%m-%d")}
        if self.ddp.main:
            write_json_atomic(result, self.args.out / "result.json")
            print(f"test accuracy {100 * last['test_accuracy']:.2f}% (error {100 * last['test_error']:.2f}%), "
                  f"{result['sec_per_epoch']:.1f} s/epoch; files in {self.args.out}")
            if not self.args.no_plots:
                for png in self.plot():
                    print(f"wrote {png}")
        return result


def resolve_run_dir(args: argparse.Namespace) -> dict | None:
    """Sets args.out; with --resume, loads the checkpoint and restores the run's arguments."""
    if args.resume is None:
        args.out = args.out or Path("runs") / f"{args.model}-{args.dataset}"
        return None
    path = args.resume / "checkpoint.pt" if args.resume.is_dir() else args.resume
    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=False)
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    defaults = vars(defaults.parse_args([]))
    given = vars(args)
    for key, saved in state["args"].items():
        overridden = key in RESUME_OVERRIDES and given[key] != defaults[key]
        if key in given and key not in RESUME_FROM_COMMAND_LINE and not overridden:
            given[key] = saved
    args.data_dir = Path(args.data_dir)
    args.out = args.resume = path.parent
    return state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="capsroute train", description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.invocation = command_line("capsroute train", argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    state = resolve_run_dir(args)
    ddp = Distributed.from_env(resolve_device(args.device).type)
    try:
        device = resolve_device(args.device, ddp.local_rank)
        try:
            if args.download and ddp.main:  # one process downloads; the others wait for it below
                data.load_dataset(args.dataset, args.data_dir, "train", download=True)
            ddp.barrier()
            trainer = Trainer(args, ddp, device)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None
        if state is not None:
            trainer.load_state(state)
        elif ddp.main:
            args.out.mkdir(parents=True, exist_ok=True)
        if args.evaluate:
            if state is None:
                raise SystemExit("--evaluate needs --resume RUN_DIR (the checkpoint to score)")
            trainer.evaluate_checkpoint()
            return 0
        try:
            trainer.fit()
        except KeyboardInterrupt:
            return 130
        return 0
    finally:
        if ddp.world_size > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
