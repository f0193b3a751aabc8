"""`capsroute train --dataset mnist40` and the robustness evaluation of its runs
(`--evaluate --eval-dataset affine-mnist | affnist`, capsroute.train.robustness), on the committed
MNIST subset and a small affNIST-format file the test writes."""

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from capsroute import cli
from capsroute.datasets import affine_mnist, mnist
from capsroute.models import CNN, CapsNet
from capsroute.train import robustness, tasks
from capsroute.train.model_config import model_for_run
from mat5 import affnist_struct, write_mat

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"
TINY = ["--model-config", "conv_channels=8", "primary_types=2", "decoder=(16,16)"]


def train(out: Path, *options: str) -> None:
    argv = ["train", "--dataset", "mnist40", "--data-dir", str(DATA), "--out", str(out)]
    argv += ["--batch-size", "8", "--train-subset", "16", "--test-subset", "10", "--max-steps", "2"]
    assert cli.main([*argv, "--no-progress", "--no-plots", *options]) == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mnist40")
    train(out, *TINY)
    return out


def refusal(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err + (e.value.code if isinstance(e.value.code, str) else "")
    *warnings, line = err.strip().splitlines()
    # mnist-small is a subset: a run that reads it warns so first, in one line
    assert all(w.startswith("warning: ") for w in warnings) and "Traceback" not in err, err
    return line


@pytest.mark.parametrize("model", ["capsnet", "cnn", "matrixcapsnet"])
def test_the_networks_build_for_forty_pixels(model):
    args = {"model": model, "model_config": [], "dataset": "mnist40", "backend": "reference"}
    if model == "matrixcapsnet":
        args["model_config"] = ["A=8", "B=2", "C=2", "D=2"]
    net = model_for_run(args)
    out = net(torch.rand(2, 1, 40, 40))
    assert out.scores.shape == (2, 10)
    if isinstance(net, CapsNet):
        assert net.image_shape == (1, 40, 40) and out.reconstructions.shape == (2, 1600)
        assert robustness.parameters_without_decoder(net) == sum(
            p.numel() for n, p in net.named_parameters() if not n.startswith("decoder.")
        )
    if isinstance(net, CNN):
        everything = sum(p.numel() for p in net.parameters())
        assert robustness.parameters_without_decoder(net) == everything


def test_the_mnist40_task_centres_the_test_digits():
    args = argparse.Namespace(train_subset=20, test_subset=12, val_split=None)
    train_split = mnist.load_dataset("mnist", DATA, "train")
    test_split = mnist.load_dataset("mnist", DATA, "test")
    task = tasks.task_class("mnist40")(args, train_split, test_split)
    assert tasks.source_dataset("mnist40") == "mnist"
    images, labels, targets = task.test_batch(torch.arange(12))
    assert images.shape == (12, 1, 40, 40) and targets is images
    assert torch.equal(images, affine_mnist.centred(test_split[0][:12]).float() / 255)
    assert torch.equal(labels, test_split[1][:12])
    assert torch.equal(task.test_digits, test_split[0][:12])
    assert torch.equal(task.figure_inputs()["images"], affine_mnist.centred(test_split[0][:12]))
    # training batches are 28x28 until the trainer's augmentation places them (pad_shifted)
    placed = [images for images, _, _ in task.training_batches(8, lambda x: x)]
    assert placed[0].shape[-2:] == (28, 28)


def test_a_mnist40_run_trains_at_forty_pixels(run_dir, tmp_path):
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["args"]["dataset"] == "mnist40" and state["step"] == 2
    assert state["model"]["decoder.4.weight"].shape[0] == 1600  # reconstructs 40x40 images
    # its figures draw from the 40x40 test digits
    assert cli.main(["plot", str(run_dir), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "reconstructions.png").is_file()


def test_the_trainer_places_each_training_digit_at_random(run_dir, monkeypatch):
    """--dataset mnist40's augmentation: affine_mnist.pad_shifted, a function of seed and step."""
    seen = []
    place = affine_mnist.pad_shifted
    monkeypatch.setattr(affine_mnist, "pad_shifted", lambda x, g: seen.append(x) or place(x, g))
    out = run_dir.parent / "placed"
    train(out, *TINY)
    assert len(seen) == 2 and seen[0].shape == (8, 1, 28, 28)


def test_the_affine_mnist_record(capsys, run_dir):
    argv = ["train", "--resume", str(run_dir), "--evaluate", "--eval-dataset", "affine-mnist"]
    assert cli.main([*argv, "--eval-seed", "5", "--eval-transforms", "3", "--no-progress"]) == 0
    assert "(generated; not affNIST)" in capsys.readouterr().out
    record = json.loads((run_dir / "robustness-affine-mnist-seed5.json").read_text())
    assert record["kind"] == "robustness" and record["generated"] is True
    assert "not affNIST's" in record["note"]
    assert record["eval_dataset"] == "affine-mnist" and record["eval_seed"] == 5
    assert record["eval_samples"] == 30 and record["mnist40_test_samples"] == 10
    test_digits = [t[:10] for t in mnist.load_dataset("mnist", DATA, "test")]
    expected = affine_mnist.checksum(affine_mnist.AffineMNIST(*test_digits, 3, seed=5))
    assert record["eval_checksum"] == expected
    assert 0 <= record["eval_accuracy"] <= 1 and 0 <= record["mnist40_test_accuracy"] <= 1
    assert 0 < record["parameters_without_decoder"] < record["parameters"]
    for kind, rows in record["bins"].items():
        assert sum(row["count"] for row in rows) == 30, kind
    assert record["ranges"] == {"rotation_degrees": 20.0, "shear": 0.2, "scale": [0.8, 1.2]}


def test_the_affnist_record(capsys, run_dir, tmp_path):
    write_mat(tmp_path / "test.mat", {"affNISTdata": affnist_struct(40)[0]})
    argv = ["train", "--resume", str(run_dir), "--evaluate", "--eval-dataset", "affnist"]
    assert cli.main([*argv, "--affnist-dir", str(tmp_path), "--test-subset", "1"]) == 0
    record = json.loads((run_dir / "robustness-affnist.json").read_text())
    assert record["generated"] is False and record["eval_samples"] == 32  # 32 per test digit
    assert record["eval_files"] == [str(tmp_path / "test.mat")] and record["bins"] is None


def test_transformation_bins():
    params = np.array(
        [[0, 0, 0.8, 1.2, 0, 0], [20, -0.2, 1.2, 0.8, 3, 4], [-7, 0.07, 1.0, 1.0, 20, 0]]
    )
    bins = robustness.transformation_bins(params, np.array([True, False, True]))
    assert [row["count"] for row in bins["rotation"]] == [1, 1, 0, 1]
    assert bins["rotation"][3]["accuracy"] == 0.0 and bins["rotation"][2]["accuracy"] is None
    assert [row["count"] for row in bins["shear"]] == [1, 1, 0, 1]
    assert [row["count"] for row in bins["translation"]] == [1, 1, 0, 0, 1]


@pytest.mark.parametrize(
    "options, words",
    [
        (
            ["--dataset", "mnist40", "--model", "efficientcapsnet"],
            "--dataset mnist40 trains capsnet, cnn, matrixcapsnet (40x40 inputs), not efficientcapsnet",
        ),
        (
            ["--dataset", "mnist40", "--shift", "3"],
            "--shift 3: --dataset mnist40 places each training digit at random",
        ),
        (
            ["--dataset", "mnist40", "--augment", "efficientcapsnet"],
            "--augment efficientcapsnet: --dataset mnist40 places",
        ),
        (
            ["--eval-dataset", "affine-mnist"],
            "--eval-dataset affine-mnist scores a trained run: pass --evaluate --resume RUN_DIR",
        ),
        (["--eval-dataset", "mnist"], "--eval-dataset: invalid choice: 'mnist'"),
        (["--eval-seed", "3"], "--eval-seed: an option of --eval-dataset affine-mnist"),
        (["--eval-transforms", "33"], "--eval-transforms: must be a whole number in 1..32"),
        (["--affnist-dir", "x"], "--affnist-dir: an option of --eval-dataset affnist"),
    ],
)
def test_bad_options_are_refused_in_one_line(capsys, tmp_path, options, words):
    line = refusal(
        capsys, ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path / "r"), *options]
    )
    assert line.startswith("capsroute train: error: ") and words in line, line
    assert not (tmp_path / "r").exists()


def test_bad_evaluations_are_refused_in_one_line(capsys, run_dir, tmp_path):
    mnist_run = tmp_path / "mnist-run"
    argv = ["train", "--data-dir", str(DATA), "--out", str(mnist_run), "--batch-size", "8"]
    argv += ["--train-subset", "8", "--test-subset", "8", "--max-steps", "1", "--no-progress"]
    assert cli.main([*argv, "--no-plots", *TINY]) == 0
    evaluate = ["train", "--evaluate", "--resume"]
    line = refusal(capsys, [*evaluate, str(mnist_run), "--eval-dataset", "affine-mnist"])
    assert (
        f"scores networks of 40x40 MNIST; the run in {mnist_run} trained on --dataset mnist" in line
    )
    line = refusal(capsys, [*evaluate, str(run_dir), "--eval-dataset", "affnist"])
    assert "--eval-dataset affnist needs --affnist-dir FOLDER" in line
    line = refusal(
        capsys,
        [*evaluate, str(run_dir), "--eval-dataset", "affnist", "--affnist-dir", str(tmp_path)],
    )
    assert f"--affnist-dir {tmp_path}: no affNIST test files in {tmp_path}" in line


def test_the_robustness_figure(tmp_path):
    from capsroute.train.plot import plot_robustness

    g = np.random.default_rng(0)
    params = affine_mnist.draw_params(0, np.arange(200), np.full((200, 4), [-8.0, -8.0, 8.0, 8.0]))
    records = [
        {
            "model": model,
            "eval_dataset": "affine-mnist",
            "generated": True,
            "eval_seed": 0,
            "bins": robustness.transformation_bins(params, g.random(200) < 0.8),
            "eval_accuracy": accuracy,
        }
        for model, accuracy in (("capsnet", 0.78), ("capsnet", 0.80), ("cnn", 0.66))
    ]
    fig = plot_robustness(records, tmp_path / "robustness.png")
    assert (tmp_path / "robustness.png").stat().st_size > 1000
    assert len(fig.axes) == len(robustness.BINS)
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    # capsnet: mean 79%, sd 1.414 points, t(1) = 12.706: half-width 12.706 x 1.414 / sqrt(2) = 12.7
    assert labels == ["capsnet: 79.0 +- 12.7% (2 runs)", "cnn: 66.0% (1 run)"]


def test_the_interval_over_seeds():
    """The mean of 3 runs and its 95% half-width: t(2) = 4.303 times the standard error."""
    mean, half = robustness.seed_interval([0.930, 0.907, 0.92])
    assert mean == pytest.approx(0.919)
    sd = np.std([0.930, 0.907, 0.92], ddof=1)
    assert half == pytest.approx(4.303 * sd / np.sqrt(3))
    with pytest.raises(ValueError, match="an interval needs 2 runs or more, got 1"):
        robustness.seed_interval([0.9])
