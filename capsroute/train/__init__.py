"""`capsroute train`: train CapsNet, EfficientCapsNet or MatrixCapsNet on MNIST or Fashion-MNIST,
CapsNet or EfficientCapsNet on MultiMNIST, or SegCapsNet to segment MultiMNIST pairs.

  capsroute train --model capsnet --data-dir DATA --epochs 30     (DATA: a folder with the IDX files)
  capsroute train --model efficientcapsnet --data-dir DATA        (its paper's recipe, below)
  capsroute train --model capsnet --data-dir data --download       (fetches MNIST into data/mnist)
  capsroute train --dataset multimnist --data-dir DATA --pairs-per-digit 1 --epochs 1
  capsroute train --model segcapsnet --dataset multimnist-seg --data-dir DATA --epochs 1
  capsroute train --dataset mnist40 --data-dir DATA --out RUN       (40x40 MNIST, placed at random)
  capsroute train --resume RUN --evaluate --eval-dataset affine-mnist  (affine-transformed digits)
  torchrun --nproc-per-node 4 -m capsroute.train --model capsnet ...      (one process per GPU)

Everything a run writes goes to --out (default runs/<model>-<dataset>): metrics.csv and
metrics.json after every epoch, checkpoint.pt (written atomically after every epoch, on Ctrl-C
and at --max-steps), result.json at the end (the "train" record of bench/README.md) and the PNG figures.
`--resume DIR` continues exactly where the checkpoint stopped: same step, optimizer, scheduler
and data order (the order and the augmentation are functions of the seed, epoch and step); it may
change --epochs, --max-steps, --device, --cuda-graph, --data-dir and --test-subset, and refuses
other changes.
Errors are one line (--debug shows the traceback).

EfficientCapsNet trains by its paper's recipe (the official code's) unless the command gives these
options: --batch-size 16 --epochs 150 --lr 5e-4 --lr-decay 0.97 --decay-steps 0 (one epoch)
--min-lr 5e-5, with --augment efficientcapsnet on MNIST and Fashion-MNIST and --pairs-per-digit 10
on MultiMNIST.
"""

import sys

from .._utils.command import ArgumentParser, refusing
from .._utils.runinfo import command_line
from .args import HelpFormatter, add_arguments
from .trainer import Trainer, run


def main(argv=None) -> int:
    p = ArgumentParser(prog="capsroute train", description=__doc__, formatter_class=HelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.invocation = command_line("capsroute train", argv)
    with refusing("capsroute train", args.debug):
        return run(args)


__all__ = ["HelpFormatter", "Trainer", "add_arguments", "main", "run"]
