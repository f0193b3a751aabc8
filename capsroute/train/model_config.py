"""`capsroute train --model-config`: a model's keyword arguments from KEY=VALUE items, checked
against its signature, and the network of a run's arguments sized for its dataset's images."""

from __future__ import annotations

import ast
import inspect
import typing

from torch import nn

from .._utils.command import CommandError
from ..datasets import affine_mnist, multimnist
from ..models import MODELS, build_model

# The networks sized for the dataset's images: 36x36 MultiMNIST pairs, else 28x28.
PAIR_MODELS = ("capsnet", "efficientcapsnet", "cnn")
# The networks of 40x40 MNIST (--dataset mnist40): EfficientCapsNet's graphs take 28 and 36 only.
FORTY_MODELS = ("capsnet", "cnn", "matrixcapsnet")


def parse_model_config(items: list[str]) -> dict:
    """Constructor arguments from KEY=VALUE strings (`capsroute train --model-config`): each value
    as a Python literal (64, 0.5, (64, 128)) where it is one, else as the string."""
    config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"expected KEY=VALUE, got {item!r}")
        try:
            config[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            config[key] = value
    return config


def model_for_run(args: dict) -> nn.Module:
    """The network of a run's arguments (vars of `capsroute train`'s, or a checkpoint's "args"): --model
    with --model-config, sized for the dataset's images (36x36 MultiMNIST pairs, 40x40 mnist40,
    else 28x28)."""
    config = parse_model_config(args["model_config"])
    if args["model"] in PAIR_MODELS:
        sizes = {"multimnist": multimnist.SIZE, "mnist40": affine_mnist.SIZE}
        config.setdefault("image_size", sizes.get(args["dataset"], multimnist.DIGIT_SIZE))
    if args["model"] == "segcapsnet":
        config.setdefault("classes", 10)  # one segmentation capsule type per digit class
    return build_model(args["model"], args["backend"], config)


def model_options(model: str) -> dict[str, inspect.Parameter]:
    """The keyword-only parameters of a model (--model-config's keys): its sizes and routing
    settings; the classes, channels and image size come from the dataset, the backend from
    --backend."""
    parameters = inspect.signature(MODELS[model], eval_str=True).parameters.values()
    return {p.name: p for p in parameters if p.kind is p.KEYWORD_ONLY and p.name != "backend"}


def _value_error(parameter: inspect.Parameter, value) -> str | None:
    """What is wrong with value for parameter (None: nothing): it must have the type of the
    default, and numbers must be > 0."""
    default = parameter.default
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "must be True or False"
    if isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        return None if ok else "must be a whole number >= 1"
    if isinstance(default, float):
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and 0 < value < float("inf")
        )
        return None if ok else "must be a number > 0"
    if isinstance(default, tuple):  # tuple[int, ...] of any length, tuple[int, int, int] of three
        length = None if "..." in str(parameter.annotation) else len(default)
        ok = isinstance(value, tuple) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value
        )
        if ok and length in (None, len(value)):
            return None
        count = "whole numbers" if length is None else f"{length} whole numbers"
        return f"must be a tuple of {count} >= 1, like {default}"
    if isinstance(default, str):  # a Literal of the values it takes
        allowed = typing.get_args(parameter.annotation)
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return None


def check_model_config(model: str, items: list[str]) -> dict:
    """--model-config as the model's keyword arguments; refuses unknown keys and wrong values."""
    options = model_options(model)
    for item in items:
        [(key, value)] = parse_model_config([item]).items()
        if key not in options:
            raise CommandError(
                f"--model-config {item}: {model} has no option {key!r} "
                f"(its options: {', '.join(options)})"
            )
        problem = _value_error(options[key], value)
        if problem is not None:
            raise CommandError(f"--model-config {item}: {model}'s {key} {problem}")
    return parse_model_config(items)
