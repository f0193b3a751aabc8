"""How the `capsroute` commands refuse: one line on stderr, "capsroute train: error: <what, which
option or file, what to do>", and a non-zero exit, without a traceback (`--debug` shows it).

  CommandError                   a refusal; its message is the line the user reads
  ArgumentParser                 argparse with its usage errors on one line (exit status 2)
  refusing(prog, debug)          turns a CommandError into that line (exit status 1)
  whole_number(low, high)        argparse types that check a value's range as they parse it
  real_number(low, ...)
"""

from __future__ import annotations

import argparse
import contextlib
import math


class CommandError(Exception):
    """A command refused: what is wrong, which option or file, and what to do, in one line."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


class ArgumentParser(argparse.ArgumentParser):
    """argparse, whose usage errors are one line: argparse's own print the usage first (twenty
    lines for `capsroute train`), which hides the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


@contextlib.contextmanager
def refusing(prog: str, debug: bool = False):
    """A CommandError raised in the block exits with its line (status 1), and so does an exit whose
    code is a message (SystemExit("...")); debug=True lets a CommandError through with its traceback
    and the exception that caused it."""
    try:
        yield
    except CommandError as e:
        if debug:
            raise
        raise SystemExit(f"{prog}: error: {one_line(e)}") from None
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        raise SystemExit(f"{prog}: error: {one_line(e.code)}") from None


def _bounds(low, high, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"> {low} and <= {high}" if low_open else f"in {low}..{high}"


def whole_number(low: int, high: int | None = None):
    """An argparse type: an int in low..high (high None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be a whole number {_bounds(low, high)}, got {text!r}"
            )
        return value

    return parse


def real_number(low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite float >= low (> low when low_open) and <= high."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be a number {_bounds(low, high, low_open)}, got {text!r}"
            )
        return value

    return parse
