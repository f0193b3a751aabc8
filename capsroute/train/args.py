"""`capsroute train`'s command line and run folder: the options, their checks (all made before any
data is read), and the checkpoint that `--resume` continues and `capsroute plot` draws from.

  add_arguments(parser)      the options; each value's range is checked as it is parsed
  check_arguments(args)      what needs several options: --model-config against --model, ...
  apply_recipe(args)         a model's training recipe, for the options the command leaves out
  resolve_run_dir(args)      the run folder; with --resume, the checkpoint and the run's options
  load_checkpoint(path)      a checkpoint, loaded without running code (weights_only=True)
  checkpoint_args(args)      the options as a checkpoint stores them (plain types)
"""

from __future__ import annotations

import argparse
import os
import warnings
from pathlib import Path

import torch

from .. import __version__
from .._utils.command import CommandError, real_number, whole_number
from ..datasets import affine_mnist, mnist, multimnist
from ..models import MODELS
from ..nn import BACKENDS
from .model_config import FORTY_MODELS, PAIR_MODELS, check_model_config, parse_model_config

AMP_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
SEGMENTATION = {"segcapsnet": "multimnist-seg"}  # segmentation networks and their one dataset
AUGMENTATIONS = ("shift", "efficientcapsnet")
# Efficient-CapsNet's recipe, the official code's config.json: batch 16, Adam 5e-4 decayed by 0.97
# an epoch (here smoothly every step) down to 5e-5, 150 epochs, its MNIST generator's augmentation.
# The paper trains no Fashion-MNIST network: that gets the MNIST recipe. Its MultiMNIST epoch is
# 10 x 60,000 / 16 steps of generated pairs: 10 pairs per training digit.
_EFFICIENT_CAPSNET = {
    "batch_size": 16,
    "epochs": 150,
    "lr": 5e-4,
    "lr_decay": 0.97,
    "decay_steps": 0,
    "min_lr": 5e-5,
}
RECIPES = {
    ("efficientcapsnet", "mnist"): {**_EFFICIENT_CAPSNET, "augment": "efficientcapsnet"},
    ("efficientcapsnet", "fashion-mnist"): {**_EFFICIENT_CAPSNET, "augment": "efficientcapsnet"},
    ("efficientcapsnet", "multimnist"): {**_EFFICIENT_CAPSNET, "pairs_per_digit": 10},
}
# The trainer seeds each epoch and step from --seed; those seeds must fit in 64 bits.
MAX_SEED = 2**31 - 1
# A resumed run keeps its own options except these: taken from the new command line always (they
# are about this process), or only when given there (the run goes on the same with them). Any
# other option given there with a value other than the run's is refused.
RESUME_FROM_COMMAND_LINE = {
    "max_steps",
    "cuda_graph",
    "no_progress",
    "no_plots",
    "download",
    "evaluate",
    "eval_dataset",
    "eval_seed",
    "eval_transforms",
    "affnist_dir",
    "debug",
}
RESUME_OVERRIDES = {"epochs", "device", "data_dir", "test_subset"}
CHECKPOINT_KEYS = {
    "capsroute",
    "args",
    "model",
    "optimizer",
    "scheduler",
    "scaler",
    "epoch",
    "step_in_epoch",
    "step",
    "epoch_sums",
    "history",
    "torch_rng",
}


# The sets --eval-dataset scores a mnist40 network on: generated, or affNIST's published files.
EVAL_DATASETS = ("affine-mnist", "affnist")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # The command as typed (for the records) and its options (for --resume's checks), both None
    # from Python; the commands that resumed the run.
    p.set_defaults(invocation=None, argv=None, resume_commands=[])
    positive = whole_number(1)
    p.add_argument("--model", choices=sorted(MODELS), default="capsnet", help="the network")
    p.add_argument(
        "--model-config",
        nargs="*",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="keyword arguments of the model, e.g. conv_channels=64 (CapsNet) or A=32 (MatrixCapsNet)",
    )
    p.add_argument(
        "--dataset",
        choices=sorted([*mnist.DATASETS, "mnist40", "multimnist", "multimnist-seg"]),
        default="mnist",
        help="the images; mnist40: MNIST on a 40x40 canvas, placed at random in training and "
        "centred in test (Sabour et al. 2017, section 5); multimnist: pairs of overlapping MNIST "
        "digits (capsroute.datasets.multimnist); multimnist-seg: the same pairs with each digit's "
        "pixels as per-class masks (segcapsnet)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("CAPSROUTE_DATA", "data")),
        help="folder with the IDX .gz files ($CAPSROUTE_DATA when set; MNIST's for multimnist)",
    )
    p.add_argument(
        "--pairs-per-digit",
        type=whole_number(1, multimnist.MAX_PAIRS_PER_DIGIT),
        default=1,
        help=f"multimnist: training pairs per training digit, 1..{multimnist.MAX_PAIRS_PER_DIGIT} "
        "(an epoch of 60,000 pairs per unit; the test set is fixed: one pair per test digit)",
    )
    p.add_argument(
        "--download", action="store_true", help="download missing files (checksums verified)"
    )
    p.add_argument("--epochs", type=positive, default=10, help="passes over the training images")
    p.add_argument("--batch-size", type=positive, default=128, help="per process")
    p.add_argument(
        "--lr", type=real_number(0, low_open=True), default=1e-3, help="Adam learning rate"
    )
    p.add_argument(
        "--lr-decay",
        type=real_number(0, 1, low_open=True),
        default=0.96,
        help="multiplied into the learning rate every --decay-steps",
    )
    p.add_argument(
        "--decay-steps",
        type=whole_number(0),
        default=2000,
        help="steps per --lr-decay factor (0: one epoch)",
    )
    p.add_argument(
        "--min-lr", type=real_number(0), default=0.0, help="the decay stops at this learning rate"
    )
    p.add_argument("--weight-decay", type=real_number(0), default=0.0, help="Adam's L2 penalty")
    p.add_argument(
        "--shift",
        type=whole_number(0, multimnist.DIGIT_SIZE - 1),
        default=2,
        help="random shift augmentation in pixels (0: none); multimnist shifts each digit by up to 4",
    )
    p.add_argument(
        "--augment",
        choices=AUGMENTATIONS,
        default="shift",
        help="shift: --shift's random shift (Sabour et al.); efficientcapsnet: the official "
        "Efficient-CapsNet MNIST generator's rotation, shift, squish and erasure "
        "(capsroute.train.augment); multimnist pairs come shifted either way",
    )
    p.add_argument(
        "--margin-ramp-epochs",
        type=real_number(0),
        default=5.0,
        help="MatrixCapsNet: epochs over which the spread-loss margin grows from 0.2 to 0.9",
    )
    p.add_argument(
        "--amp", choices=sorted(AMP_DTYPES), default="none", help="mixed precision (autocast)"
    )
    p.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default="fused",
        help="fused capsroute kernels, or the plain PyTorch reference",
    )
    p.add_argument("--device", type=_device, default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture the training step in a CUDA graph and replay it: one launch a step (one "
        "CUDA process, --amp none or bf16; default: on where that step has been checked on a GPU "
        "against the eager one, with the reason printed where it is not)",
    )
    p.add_argument(
        "--seed",
        type=whole_number(0, MAX_SEED),
        default=0,
        help="initial weights, data order and augmentation",
    )
    p.add_argument(
        "--train-subset", type=positive, default=None, help="use the first N training images"
    )
    p.add_argument(
        "--test-subset",
        type=positive,
        default=None,
        help="use the first N test images (multimnist: pairs)",
    )
    p.add_argument(
        "--val-split",
        type=positive,
        default=None,
        metavar="N",
        help="hold out the last N training images (after --train-subset) as a validation part, "
        "scored each epoch in place of the test set, which is scored once at the end (mnist40 "
        "places them on the canvas once, with a fixed seed: every run scores the same images)",
    )
    p.add_argument(
        "--stop-at-val-accuracy",
        type=real_number(0, 1, low_open=True),
        default=None,
        metavar="A",
        help="with --val-split: stop after the first epoch whose validation accuracy is A or more "
        "(for example 0.992), then score the test set",
    )
    p.add_argument(
        "--max-steps",
        type=positive,
        default=None,
        help="stop (with a checkpoint) after this many steps",
    )
    p.add_argument(
        "--out", type=Path, default=None, help="run folder (default: runs/<model>-<dataset>)"
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue the run in this folder",
    )
    p.add_argument(
        "--evaluate",
        action="store_true",
        help="with --resume: score the checkpoint's network as it stands (even mid-epoch) on the test set "
        "into RUN_DIR/evaluation.json and draw its figures, without training",
    )
    p.add_argument(
        "--eval-dataset",
        choices=EVAL_DATASETS,
        default=None,
        help="with --evaluate, a mnist40 run: score it on MNIST test digits under random affine "
        "transformations, generated (affine-mnist, not the paper's set) or affNIST's published "
        "test files (affnist, --affnist-dir), and on the 40x40 MNIST test set, into "
        "RUN_DIR/robustness-<set>.json",
    )
    p.add_argument(
        "--eval-seed",
        type=whole_number(0, MAX_SEED),
        default=affine_mnist.DEFAULT_SEED,
        help="affine-mnist: the seed of its transformations",
    )
    p.add_argument(
        "--eval-transforms",
        type=whole_number(1, affine_mnist.TRANSFORMS_PER_DIGIT),
        default=affine_mnist.TRANSFORMS_PER_DIGIT,
        help="affine-mnist: transformations per test digit (affNIST's 32)",
    )
    p.add_argument(
        "--affnist-dir",
        type=Path,
        default=None,
        help="affnist: the folder with affNIST's test.mat (32x/transformed/test.mat.zip, unzipped) "
        "or its test_batches 1.mat .. 32.mat",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="do not draw figures at the end")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _key_value(item: str) -> str:
    """An item of --model-config, checked here and kept as text (the checkpoint stores the
    arguments as given)."""
    try:
        parse_model_config([item])
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    except (
        MemoryError,
        RecursionError,
    ):  # what Python's parser raises on thousands of nested operators
        raise argparse.ArgumentTypeError(
            f"{item[:40]!r}...: too deeply nested to be a value"
        ) from None
    return item


def _device(text: str) -> str:
    """--device as given (resolve_device makes it a device once the run starts), checked."""
    try:
        ok = text == "auto" or torch.device(text).type in ("cpu", "cuda")
    except RuntimeError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"must be auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def _defaults() -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def given_options(args: argparse.Namespace) -> set[str]:
    """The options given on the command line (args.argv); from Python (no argv), those whose value
    differs from the default."""
    defaults = _defaults()
    if args.argv is None:
        return {key for key, value in defaults.items() if getattr(args, key) != value}
    unset = object()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # argparse fills in a default only where the namespace has no value yet.
    parsed = parser.parse_args(args.argv, argparse.Namespace(**dict.fromkeys(defaults, unset)))
    return {key for key, value in vars(parsed).items() if value is not unset}


def apply_recipe(args: argparse.Namespace) -> dict:
    """Sets the options of the model's training recipe on `args` (RECIPES[model, dataset]) where
    the command line leaves them out (from Python: where they have their defaults); returns those
    it set. A new run only: --resume keeps the run's own options."""
    given = given_options(args)
    recipe = {
        key: value
        for key, value in RECIPES.get((args.model, args.dataset), {}).items()
        if key not in given
    }
    for key, value in recipe.items():
        setattr(args, key, value)
    return recipe


def check_arguments(args: argparse.Namespace) -> None:
    """The checks that need several options (the single values are checked as they are parsed)."""
    check_model_config(args.model, args.model_config)
    if args.dataset == "multimnist" and args.model not in PAIR_MODELS:
        raise CommandError(
            f"--dataset multimnist trains {', '.join(PAIR_MODELS[:-1])} or {PAIR_MODELS[-1]}, "
            f"not {args.model}"
        )
    if args.augment != "shift" and "shift" in given_options(args):
        raise CommandError(
            f"--shift {args.shift}: --augment {args.augment} shifts as its own generator does; "
            f"leave --shift out, or pass --augment shift"
        )
    segmented = SEGMENTATION.get(args.model)
    if (args.dataset in SEGMENTATION.values() or segmented) and args.dataset != segmented:
        model = (
            next(m for m, d in SEGMENTATION.items() if d == args.dataset) if not segmented else None
        )
        raise CommandError(
            f"--dataset {args.dataset} trains {model}, not {args.model}"
            if model
            else f"--model {args.model} segments --dataset {segmented}, not {args.dataset}"
        )
    if args.cuda_graph and args.amp == "fp16":
        raise CommandError(
            "--cuda-graph: --amp fp16 checks its loss scale on the host every step, which a "
            "captured step cannot; use --amp bf16 or none"
        )
    if args.evaluate and args.resume is None:
        raise CommandError("--evaluate needs --resume RUN_DIR (the checkpoint to score)")
    if args.dataset == "mnist40":
        _check_forty(args)
    if args.val_split is not None and args.dataset.startswith("multimnist"):
        raise CommandError(
            f"--val-split {args.val_split}: holds out training images of mnist, fashion-mnist or "
            f"mnist40, not --dataset {args.dataset}'s generated pairs"
        )
    if args.stop_at_val_accuracy is not None and args.val_split is None:
        raise CommandError(
            f"--stop-at-val-accuracy {args.stop_at_val_accuracy}: needs --val-split N, the "
            "training images it scores"
        )
    _check_eval_options(args)
    if args.out.exists() and not args.out.is_dir():
        raise CommandError(f"--out {args.out}: a file, not a folder; pass a folder for the run")


def _check_forty(args: argparse.Namespace) -> None:
    """--dataset mnist40: a network of 40x40 inputs, and its own placement in place of --shift."""
    if args.model not in FORTY_MODELS:
        raise CommandError(
            f"--dataset mnist40 trains {', '.join(FORTY_MODELS)} (40x40 inputs), not {args.model}"
        )
    if args.augment != "shift":
        raise CommandError(
            f"--augment {args.augment}: --dataset mnist40 places each training digit at random "
            f"on the 40x40 canvas instead; leave --augment out"
        )
    if "shift" in given_options(args):
        raise CommandError(
            f"--shift {args.shift}: --dataset mnist40 places each training digit at random on "
            f"the 40x40 canvas instead; leave --shift out"
        )


def _check_eval_options(args: argparse.Namespace) -> None:
    """--eval-dataset and its options: with --evaluate, on a mnist40 run, each with its set."""
    given = given_options(args)
    own = {"eval_seed": "affine-mnist", "eval_transforms": "affine-mnist", "affnist_dir": "affnist"}
    for key, dataset in own.items():
        if key in given and args.eval_dataset != dataset:
            raise CommandError(
                f"{_option(key)}: an option of --eval-dataset {dataset}, which the command "
                f"does not ask for"
            )
    if args.eval_dataset is None:
        return
    if not args.evaluate:
        raise CommandError(
            f"--eval-dataset {args.eval_dataset} scores a trained run: pass --evaluate --resume RUN_DIR"
        )
    if args.dataset != "mnist40":
        raise CommandError(
            f"--eval-dataset {args.eval_dataset} scores networks of 40x40 MNIST; the run in "
            f"{args.resume} trained on --dataset {args.dataset} (train one with --dataset mnist40)"
        )
    if args.eval_dataset == "affnist" and args.affnist_dir is None:
        raise CommandError(
            "--eval-dataset affnist needs --affnist-dir FOLDER with affNIST's test files "
            "(capsroute does not download them)"
        )


# The training steps (model, backend, amp) checked under a CUDA graph on a GPU against the eager
# step, the same metrics epoch by epoch (bench/results/nvidia-h200-2026-12-04-ed63859): the graph
# is their default on a CUDA device.
CUDA_GRAPH_CHECKED = {("capsnet", "fused", "none")}


def choose_cuda_graph(
    args: argparse.Namespace, device: torch.device, world_size: int
) -> tuple[bool, str | None]:
    """Whether this process replays its training step from a CUDA graph, and why not where the
    default leaves a CUDA run eager. --cuda-graph off a CUDA device or under torchrun is refused
    (check_arguments refuses it with --amp fp16)."""
    if args.cuda_graph:
        if device.type != "cuda":
            raise CommandError(
                f"--cuda-graph replays the step on a CUDA device; this run is on {device}"
            )
        if world_size > 1:
            raise CommandError(
                f"--cuda-graph runs in one process; torchrun started {world_size} (leave it out)"
            )
        return True, None
    if args.cuda_graph is False or device.type != "cuda":
        return False, None
    if world_size > 1:
        return False, f"torchrun started {world_size} processes and a graph replays one"
    if args.amp == "fp16":
        return False, "--amp fp16 checks its loss scale on the host every step"
    if (args.model, args.backend, args.amp) not in CUDA_GRAPH_CHECKED:
        return False, (
            f"--model {args.model} --backend {args.backend} --amp {args.amp} is not yet checked "
            "under a CUDA graph on a GPU (--cuda-graph tries it)"
        )
    return True, None


def _plain(value):
    return str(value) if isinstance(value, Path) else value


def checkpoint_args(args: argparse.Namespace) -> dict:
    """The run's options, command and resume commands in plain types (weights_only loads them)."""
    return {key: _plain(getattr(args, key)) for key in _defaults() if key != "argv"}


def load_checkpoint(path: Path) -> dict:
    """A checkpoint written by this capsroute version; refuses, naming the file, anything else."""
    try:
        with (
            warnings.catch_warnings()
        ):  # torch's notes on an unusual file: the line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load fails in many ways on a damaged or foreign file
        raise CommandError(
            f"{path}: not a checkpoint capsroute {__version__} can load safely (truncated, "
            f"damaged, foreign or from an older capsroute); --debug shows why"
        ) from e
    if not isinstance(state, dict) or not CHECKPOINT_KEYS - {"capsroute"} <= state.keys():
        raise CommandError(f"{path}: not a capsroute train checkpoint (it lacks the run's state)")
    version = state.get("capsroute")
    if version != __version__:
        written = f"capsroute {version}" if version else "an older capsroute (no version recorded)"
        raise CommandError(
            f"{path}: written by {written}, this is capsroute {__version__}: continue the run "
            f"with that version, or start a new one"
        )
    return state


def _shown(value) -> str:
    return " ".join(value) if isinstance(value, list) else str(value)


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")


def resolve_run_dir(args: argparse.Namespace) -> dict | None:
    """Sets args.out; with --resume, loads the checkpoint and restores the run's options, applies
    those --resume may change and refuses other changes; returns the checkpoint (None without
    --resume)."""
    if args.resume is None:
        args.out = args.out or Path("runs") / f"{args.model}-{args.dataset}"
        args.resume_commands = []
        return None
    path = args.resume / "checkpoint.pt" if args.resume.is_dir() else args.resume
    if not path.is_file():
        raise CommandError(
            f"--resume {args.resume}: no checkpoint at {path}; pass a run folder of capsroute train"
        )
    state = load_checkpoint(path)
    given, this_command = given_options(args), args.invocation
    if "out" in given and args.out.resolve() != path.parent.resolve():
        raise CommandError(
            f"--out {args.out}: a resumed run stays in its folder {path.parent}; leave --out out"
        )
    saved = state["args"]
    for key, value in saved.items():
        if (
            key in ("out", "resume", "resume_commands")
            or key in RESUME_FROM_COMMAND_LINE
            or not hasattr(args, key)
        ):
            continue
        if key in given and key in RESUME_OVERRIDES:
            continue
        new = _plain(getattr(args, key))
        same = (
            parse_model_config(new) == parse_model_config(value)
            if key == "model_config"
            else new == value
        )
        if key in given and not same:
            raise CommandError(
                f"{_option(key)} {_shown(new)}: the run in {path.parent} has {_shown(value)}, "
                f"which --resume keeps; leave {_option(key)} out, or start a new run elsewhere"
            )
        setattr(args, key, value)
    args.data_dir = Path(args.data_dir)
    args.out = args.resume = path.parent
    args.resume_commands = [*saved.get("resume_commands", []), this_command]
    return state
