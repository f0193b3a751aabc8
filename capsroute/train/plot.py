"""Figures of a `capsroute train` run, as PNG files in its folder (matplotlib, Agg).

  curves.png          loss and test error per epoch
  reconstructions.png test digits (top) and the decoder's reconstruction from their class capsule (bottom)
  perturbations.png   Sabour et al. 2017, fig. 4: each row tweaks one dimension of the class
                      capsule by -0.25 .. 0.25 and shows what the decoder draws
  pairs.png           MultiMNIST runs, Sabour et al. 2017, fig. 5: test pairs (top), the reconstructions
                      from the two longest capsules in red and green (middle), and the reconstruction
                      from the longest capsule of a class that is not in the pair (bottom)
  masks.png           SegCapsNet runs (multimnist-seg): test pairs, their true masks and the predicted ones
  affine samples      plot_affine_samples: affine-mnist digits beside their originals
  robustness          plot_robustness: accuracy against the size of each transformation, from
                      the records of `capsroute train --evaluate --eval-dataset affine-mnist`
The reconstruction figures need a network with a decoder (CapsNet, EfficientCapsNet); MultiMNIST
runs draw pairs.png in place of reconstructions.png.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator

from .._utils.command import CommandError
from .._utils.runinfo import short_commit
from ..datasets import affine_mnist, mnist
from ..datasets.affine_mnist import AffineMNIST
from ..datasets.multimnist import SIZE, MultiMNIST, class_masks
from ..models import DecoderCapsNet, SegCapsNet
from .args import load_checkpoint
from .model_config import model_for_run
from .robustness import seed_interval
from .tasks import source_dataset, task_class

PERTURBATIONS = torch.linspace(-0.25, 0.25, 11)


class _PlainLogFormatter(LogFormatter):
    """LogFormatter's choice of the ticks to label (minor ones where the axis spans less than about
    two decades), each written as a plain number (0.06, 20) rather than 6e-02 or 2 x 10^1."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def _new_figure(size) -> Figure:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_curves(history: list[dict], path: Path, title: str) -> Path:
    fig = _new_figure((11, 4.2))
    loss_ax, error_ax = fig.subplots(1, 2)
    epochs = [m["epoch"] for m in history]
    # What each epoch scored: the validation part (--val-split) or the test set.
    split, label = ("val", "validation") if "val_loss" in history[0] else ("test", "test")
    loss_ax.plot(epochs, [m["train_loss"] for m in history], "o-", label="train")
    loss_ax.plot(epochs, [m[f"{split}_loss"] for m in history], "o-", label=label)
    loss_ax.set(xlabel="epoch", ylabel="loss", yscale="log")
    loss_ax.legend()
    error_ax.plot(
        epochs, [100 * (1 - m["train_accuracy"]) for m in history], "o-", label="train (augmented)"
    )
    error_ax.plot(epochs, [100 * m[f"{split}_error"] for m in history], "o-", label=label)
    error_ax.set(xlabel="epoch", ylabel="error, %", yscale="log")
    error_ax.legend()
    for ax in (loss_ax, error_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_formatter(_PlainLogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(
            _PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))
        )
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def _show(ax, image: torch.Tensor) -> None:
    ax.imshow(image.float().cpu().numpy(), cmap="gray", vmin=0, vmax=1)
    ax.set_axis_off()


@torch.no_grad()
def plot_reconstructions(
    model: DecoderCapsNet, images: torch.Tensor, path: Path, count: int = 16
) -> Path:
    model.eval()
    images = images[:count]
    out = model(images)
    side = model.image_shape[-1]
    fig = _new_figure((count * 0.8, 2))
    axes = fig.subplots(2, count, squeeze=False)
    for k in range(count):
        _show(axes[0, k], images[k, 0])
        _show(axes[1, k], out.reconstructions[k].view(-1, side, side)[0])
        axes[0, k].set_title(str(out.lengths[k].argmax().item()), fontsize="small")
    fig.suptitle(
        "test images (top, predicted class) and reconstructions from the class capsule (bottom)"
    )
    fig.savefig(path, dpi=100)
    return path


@torch.no_grad()
def plot_perturbations(model: DecoderCapsNet, image: torch.Tensor, path: Path) -> Path:
    model.eval()
    out = model(image[None])
    cls = out.lengths[0].argmax()
    capsule = out.capsules[0, cls]
    dims, steps = capsule.numel(), len(PERTURBATIONS)
    # Every (dimension, step) pair at once: one decoder batch of dims * steps capsules.
    tweaked = out.capsules.repeat(dims * steps, 1, 1)
    offsets = PERTURBATIONS.to(capsule)
    for d in range(dims):
        tweaked[d * steps : (d + 1) * steps, cls, d] += offsets
    drawn = model.reconstruct(tweaked, cls.repeat(dims * steps))
    side = model.image_shape[-1]
    fig = _new_figure((steps * 0.7, dims * 0.7))
    axes = fig.subplots(dims, steps, squeeze=False)
    for d in range(dims):
        for k in range(steps):
            _show(axes[d, k], drawn[d * steps + k].view(-1, side, side)[0])
    fig.suptitle(
        f"class {cls.item()}: each row adds -0.25 .. 0.25 to one of the {dims} capsule dimensions"
    )
    fig.savefig(path, dpi=100)
    return path


@torch.no_grad()
def plot_pairs(model: DecoderCapsNet, pairs: MultiMNIST, path: Path, count: int = 12) -> Path:
    model.eval()
    images, labels, _ = pairs.float_pairs(np.arange(count))
    out = model(images)
    predicted = out.lengths.topk(2).indices
    drawn = model.reconstruct(out.capsules, predicted).view(count, 2, SIZE, SIZE)
    # The most tempting wrong class: the longest capsule of a class in neither the pair nor the prediction.
    excluded = torch.zeros_like(out.lengths, dtype=torch.bool).scatter_(
        1, torch.cat([labels, predicted], 1), True
    )
    absent = out.lengths.masked_fill(excluded, -1).argmax(-1)
    empty = model.reconstruct(out.capsules, absent).view(count, SIZE, SIZE)
    fig = _new_figure((count * 1.0, 3.6))
    axes = fig.subplots(3, count, squeeze=False)
    for k in range(count):
        _show(axes[0, k], images[k, 0])
        axes[0, k].set_title("L:({},{})".format(*labels[k].tolist()), fontsize="small")
        red_green = torch.stack([drawn[k, 0], drawn[k, 1], torch.zeros(SIZE, SIZE)], -1).clamp(0, 1)
        axes[1, k].imshow(red_green.numpy())
        axes[1, k].set_axis_off()
        right = set(predicted[k].tolist()) == set(labels[k].tolist())
        axes[1, k].set_title(
            "R:({},{})".format(*predicted[k].tolist()),
            fontsize="small",
            color="black" if right else "red",
        )
        _show(axes[2, k], empty[k])
        axes[2, k].set_title(
            f"*{absent[k].item()} ({out.lengths[k, absent[k]]:.2f})", fontsize="small"
        )
    fig.suptitle(
        "top: test pairs (L: labels); middle: reconstructions from the two longest capsules in red and\n"
        "green (R: their classes, red when wrong); bottom: from an absent class (*: class, capsule length)",
        fontsize="medium",
    )
    fig.savefig(path, dpi=100)
    return path


@torch.no_grad()
def plot_masks(model: SegCapsNet, pairs: MultiMNIST, path: Path, count: int = 12) -> Path:
    """Test pairs (top), their true masks (middle: the first label's digit red, the second's green)
    and the predicted ones (bottom: the lengths of the same two classes' capsules in red and green,
    the longest of the other eight classes in blue), each pixel's colour its probabilities."""
    model.eval()
    images, labels, digits = pairs.float_pairs(np.arange(count))
    masks = class_masks(labels, digits)
    lengths = model(images).lengths.float()
    rows = torch.arange(count)[:, None]
    others = lengths.clone()
    others[rows, labels] = 0
    fig = _new_figure((count * 1.0, 3.6))
    axes = fig.subplots(3, count, squeeze=False)
    for k in range(count):
        _show(axes[0, k], images[k, 0])
        axes[0, k].set_title("L:({},{})".format(*labels[k].tolist()), fontsize="small")
        true = torch.stack([*masks[k, labels[k]], torch.zeros(SIZE, SIZE)], -1)
        predicted = torch.stack([*lengths[k, labels[k]], others[k].amax(0)], -1).clamp(0, 1)
        for row, rgb in ((1, true), (2, predicted)):
            axes[row, k].imshow(rgb.numpy())
            axes[row, k].set_axis_off()
        found = (lengths[k] > 0.5).flatten(1).sum(1)
        top = found.topk(2).indices.tolist()
        right = set(top) == set(labels[k].tolist())
        axes[2, k].set_title(
            "P:({},{})".format(*top), fontsize="small", color="black" if right else "red"
        )
    fig.suptitle(
        "top: test pairs (L: labels); middle: true masks, first label red, second green; bottom:\n"
        "predicted (same classes red, green; other classes blue; P: the two classes with most pixels)",
        fontsize="medium",
    )
    fig.savefig(path, dpi=100)
    return path


def plot_affine_samples(
    dataset: AffineMNIST, path: Path | None = None, digits: int = 8, versions: int = 8
) -> Figure:
    """The first `digits` digits of an affine-mnist set, one a row: the original centred on the
    40x40 canvas, then its first `versions` transformations, each titled with its rotation
    (degrees), shear and scale x, y. Saved to `path` where given.

    Args:
        dataset: the generated set (capsroute.datasets.affine_mnist.AffineMNIST).
        path: where to write the PNG, or None.
        digits, versions: rows, and transformed samples per row.

    Returns:
        The figure.
    """
    n = len(dataset.digit_labels)
    digits = min(digits, n)
    versions = min(versions, dataset.transforms_per_digit)
    index = (np.arange(digits)[:, None] + n * np.arange(versions)[None]).ravel()
    batch = dataset.samples(index)
    originals = affine_mnist.centred(torch.from_numpy(dataset.digit_images[:digits, None]))
    fig = _new_figure(((versions + 1) * 1.1, digits * 1.25))
    axes = fig.subplots(digits, versions + 1, squeeze=False)
    for row in range(digits):
        _show(axes[row, 0], originals[row, 0].float() / 255)
        axes[row, 0].set_title(f"label {dataset.digit_labels[row].item()}", fontsize="x-small")
        for k in range(versions):
            at = row * versions + k
            rotation, shear, sx, sy = batch.params[at, :4].tolist()
            _show(axes[row, k + 1], batch.images[at, 0].float() / 255)
            axes[row, k + 1].set_title(
                f"{rotation:+.0f}° {shear:+.2f}\n{sx:.2f} x {sy:.2f}", fontsize="x-small"
            )
    fig.suptitle(
        f"affine-mnist (generated, seed {dataset.seed}): originals (left), transformed "
        "(rotation, shear; scale x by y)",
        fontsize="small",
    )
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _model_label(model: str, records: list[dict]) -> str:
    """ "capsnet: 79.1 +- 0.5% (3 runs)": the model's affine-set accuracy over its runs."""
    accuracies = [100 * r["eval_accuracy"] for r in records if r["model"] == model]
    if len(accuracies) == 1:
        return f"{model}: {accuracies[0]:.1f}% (1 run)"
    mean, half = seed_interval(accuracies)
    return f"{model}: {mean:.1f} +- {half:.1f}% ({len(accuracies)} runs)"


def plot_robustness(records: list[dict], path: Path | None = None) -> Figure:
    """Accuracy on an affine set against the size of each kind of transformation (the records'
    "bins": rotation, shear, scale x and y, translation), one line per model: the mean over its
    records (training seeds), shaded between their lowest and highest, labelled with the model's
    accuracy on the whole set and its 95% interval over the seeds. Saved to `path` where given.

    Args:
        records: robustness records (capsroute.train.robustness.evaluate_robustness) with bins,
            all of the same affine set.
        path: where to write the PNG, or None.

    Returns:
        The figure.
    """
    kinds = list(records[0]["bins"])
    fig = _new_figure((3.2 * len(kinds), 3.4))
    axes = fig.subplots(1, len(kinds), squeeze=False)[0]
    models = sorted({r["model"] for r in records})
    for ax, kind in zip(axes, kinds):
        for model in models:
            mine = [r["bins"][kind] for r in records if r["model"] == model]
            centres = np.array([sum(row["range"]) / 2 for row in mine[0]])
            acc = 100 * np.array(
                [
                    [np.nan if row["accuracy"] is None else row["accuracy"] for row in b]
                    for b in mine
                ]
            )
            seen = ~np.isnan(acc).all(0)  # bins with no sample in any record are left out
            centres, acc = centres[seen], acc[:, seen]
            (line,) = ax.plot(centres, np.nanmean(acc, 0), "o-", label=_model_label(model, records))
            if len(mine) > 1:
                low, high = np.nanmin(acc, 0), np.nanmax(acc, 0)
                ax.fill_between(centres, low, high, alpha=0.2, color=line.get_color())
        ax.set(xlabel=kind.replace("_", " "), ylabel="accuracy, %")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    first = records[0]
    what = f"{first['eval_dataset']}" + (
        f" (generated, seed {first['eval_seed']}; not affNIST)" if first.get("generated") else ""
    )
    fig.suptitle(f"accuracy on {what} by the size of each transformation (runs per model)")
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def _load_model(run_dir: Path):
    state = load_checkpoint(run_dir / "checkpoint.pt")
    args = state["args"]
    model = model_for_run(args)
    model.load_state_dict(state["model"])
    return model, args


def _figure_inputs(args: dict) -> dict:
    """The test images (or MultiMNIST test pairs) of a run's dataset, as its task draws them."""
    dataset, data_dir = args["dataset"], Path(args["data_dir"])
    try:
        test = mnist.load_dataset(source_dataset(dataset), data_dir, "test")
    except (OSError, ValueError) as e:  # moved, missing or damaged since the run
        raise CommandError(f"the run's test data: {e}") from e
    return task_class(dataset).figure_inputs_of(*test)


def plot_run(
    run_dir: str | Path,
    model=None,
    images: torch.Tensor | None = None,
    pairs: MultiMNIST | None = None,
    curves: bool = True,
    out: str | Path | None = None,
) -> list[Path]:
    """Draws the run's figures into `out` (default: run_dir); returns their paths. Without `model`
    the network is loaded from run_dir/checkpoint.pt and the test images (or MultiMNIST test pairs)
    from the run's dataset; without either (a run folder kept without its checkpoint, as
    bench/results keeps them) only curves.png. curves=False: not curves.png (a run scored
    mid-epoch has no epochs to draw)."""
    run_dir = Path(run_dir)
    out = run_dir if out is None else Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CommandError(f"--out {out}: cannot make the folder ({e.strerror})") from e
    written = []
    if curves:
        try:
            metrics = json.loads((run_dir / "metrics.json").read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CommandError(f"{run_dir / 'metrics.json'}: damaged ({e})") from e
        run = metrics["run"]
        title = (
            f"{run['model']} on {run['dataset']}, {run['backend']} backend, {run['device']}, "
            f"commit {short_commit(run['commit'])}"
        )
        written.append(plot_curves(metrics["epochs"], out / "curves.png", title))
    if model is None:
        if not (run_dir / "checkpoint.pt").exists():
            return written
        model, args = _load_model(run_dir)
        if isinstance(model, (DecoderCapsNet, SegCapsNet)):
            inputs = _figure_inputs(args)
            images, pairs = inputs.get("images"), inputs.get("pairs")
    if isinstance(model, SegCapsNet) and pairs is not None:
        model = copy.deepcopy(model).float().cpu()
        written.append(plot_masks(model, pairs, out / "masks.png"))
    if isinstance(model, DecoderCapsNet):
        model = copy.deepcopy(model).float().cpu()
        if pairs is not None:
            written.append(plot_pairs(model, pairs, out / "pairs.png"))
            images = pairs.float_pairs(np.arange(1))[0]
        else:
            images = images.float().div(255) if images.dtype == torch.uint8 else images.float()
            written.append(plot_reconstructions(model, images, out / "reconstructions.png"))
        written.append(plot_perturbations(model, images[0], out / "perturbations.png"))
    return written
