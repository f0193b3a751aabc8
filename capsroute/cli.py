"""The `capsroute` command (also `python -m capsroute.cli`).

  capsroute bench ...            routing benchmark: capsroute vs the PyTorch reference, eager and compiled
  capsroute train ...            train a capsule network (CapsNet, EfficientCapsNet, MatrixCapsNet, SegCapsNet)
                                 or the CNN baseline on MNIST, Fashion-MNIST or MultiMNIST
  capsroute plot PATH ...        redraw figures: of saved benchmark results (a JSON) or of a training run (its folder)
  capsroute doctor ...           check this install: every op and kernel path against the reference

An error is one line on stderr and a non-zero exit; `--debug` (train, plot) shows its traceback.
"""

import argparse
import json
import sys
from pathlib import Path

import capsroute
from capsroute import bench, doctor, train
from capsroute._utils.command import ArgumentParser, CommandError, refusing
from capsroute._utils.runinfo import command_line


def plot(args: argparse.Namespace) -> int:
    from capsroute.bench.plot import plot_report
    from capsroute.train.plot import plot_run

    for path in args.results:
        if path.is_dir():
            if not (path / "metrics.json").exists():
                raise CommandError(
                    f"{path}: not a capsroute train run (no metrics.json); pass a run folder "
                    f"or a benchmark JSON"
                )
            for png in plot_run(path, out=args.out):
                print(f"wrote {png}")
            if not (path / "checkpoint.pt").exists():
                print(
                    f"{path}: no checkpoint.pt, so only the curves (the other figures need the network)"
                )
            continue
        if not path.is_file():
            raise CommandError(
                f"{path}: no such file or folder; pass a benchmark JSON or a run folder"
            )
        try:
            report = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CommandError(f"{path}: not a capsroute bench report (not JSON: {e})") from e
        if not isinstance(report, dict) or report.get("kind") != "bench":
            raise CommandError(f'{path}: not a capsroute bench report (no "kind": "bench")')
        for png in plot_report(report, path, args.out):
            print(f"wrote {png}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = ArgumentParser(
        prog="capsroute", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--version", action="version", version=f"capsroute {capsroute.__version__}")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    b = commands.add_parser(
        "bench",
        help="routing benchmark",
        description=bench.__doc__.split("\n\n")[0],
        epilog="See bench/README.md for the columns and the floor model.",
    )
    bench.add_arguments(b)
    b.set_defaults(run=bench.run, debug=False)

    t = commands.add_parser(
        "train",
        help="train a capsule network",
        description=train.__doc__,
        formatter_class=train.HelpFormatter,
    )
    train.add_arguments(t)
    t.set_defaults(run=train.run)

    pl = commands.add_parser(
        "plot",
        help="figures from saved benchmark results or training runs",
        description="Draws the PNG figures of `capsroute bench --plot` from saved JSON results, "
        "or of a `capsroute train` run from its folder.",
    )
    pl.add_argument("results", nargs="+", type=Path, metavar="RESULTS.json|RUN_DIR")
    pl.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the PNGs (default: next to each JSON, in each run folder)",
    )
    pl.add_argument("--debug", action="store_true", help="show the traceback of an error")
    pl.set_defaults(run=plot)

    d = commands.add_parser(
        "doctor",
        help="check this install on a device",
        description=doctor.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_arguments(d)
    d.set_defaults(run=doctor.run, debug=False)

    args, unknown = p.parse_known_args(argv)
    if unknown:  # said by the command's parser, which names the command
        {"bench": b, "train": t, "plot": pl, "doctor": d}[args.command].error(
            f"unrecognized arguments: {' '.join(unknown)}"
        )
    args.invocation = command_line("capsroute", argv)  # for the run records
    args.argv = argv[
        argv.index(args.command) + 1 :
    ]  # the command's own options (train --resume checks them)
    with refusing(f"capsroute {args.command}", args.debug):
        return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
