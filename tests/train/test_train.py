"""`capsroute train` end to end on CPU, on the committed MNIST subset (tests/data/mnist-small):
learning, exact resume, Ctrl-C, torch.distributed with two gloo processes, figures."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import capsroute
from capsroute import train
from capsroute._utils.runinfo import cpu_model
from capsroute.cli import main as cli_main
from capsroute.train.trainer import FlooredExponentialLR
from helpers import SMALL_CAPSNET

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"


def train_args(out: Path, *extra: str) -> list[str]:
    return [
        "--data-dir",
        str(DATA),
        "--out",
        str(out),
        "--no-progress",
        "--no-plots",
        "--batch-size",
        "32",
        *SMALL_CAPSNET,
        *extra,
    ]


def checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_capsnet_learns(tmp_path):
    """About 280 steps of a small CapsNet on 3000 images: the loss falls and test accuracy on
    1000 unseen images clears 90% (a trained network gets over 99% on the full data)."""
    assert train.main(train_args(tmp_path, "--epochs", "3", "--lr", "3e-3")) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert result["test_accuracy"] >= 0.90, result
    assert (
        result["kind"] == "train" and result["model"] == "capsnet" and result["backend"] == "fused"
    )
    assert result["epochs"] == 3 and result["sec_per_epoch"] > 0 and result["images_per_sec"] > 0
    csv_lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("epoch,step,lr,train_loss") and len(csv_lines) == 4


def test_resume_is_bit_identical(tmp_path):
    """Stopping at step 13 (inside the second epoch of 10 steps) and resuming to step 30 gives
    the same parameters, optimizer state and metrics as running 30 steps straight."""
    common = ["--train-subset", "320", "--test-subset", "64", "--epochs", "5"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main(train_args(straight, *common, "--max-steps", "30")) == 0
    assert train.main(train_args(resumed, *common, "--max-steps", "13")) == 0
    assert checkpoint(resumed)["step"] == 13 and checkpoint(resumed)["step_in_epoch"] == 3
    assert train.main(["--resume", str(resumed), "--max-steps", "30", "--no-progress"]) == 0
    a, b = checkpoint(straight), checkpoint(resumed)
    assert a["step"] == b["step"] == 30
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    for key, state in a["optimizer"]["state"].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, b["optimizer"]["state"][key][name]), (key, name)
    timing = {"epoch_seconds", "images_per_sec"}
    assert [{k: v for k, v in m.items() if k not in timing} for m in a["history"]] == [
        {k: v for k, v in m.items() if k not in timing} for m in b["history"]
    ]


def test_resume_finishes_the_run(tmp_path):
    """Started from the `capsroute` command, resumed through the module: the record's command is
    the one that started the run, runnable as written, and the resume commands follow it."""
    started = train_args(
        tmp_path,
        "--train-subset",
        "128",
        "--test-subset",
        "64",
        "--epochs",
        "2",
        "--max-steps",
        "5",
    )
    assert cli_main(["train", *started]) == 0
    assert not (tmp_path / "result.json").exists()
    resumed = ["--resume", str(tmp_path), "--no-progress", "--no-plots"]
    assert train.main(resumed) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["epochs"] == 2 and checkpoint(tmp_path)["step"] == 8
    assert result["command"] == "capsroute train " + shlex.join(started)
    assert result["resume_commands"] == ["capsroute train " + shlex.join(resumed)]
    assert result["capsroute"] == capsroute.__version__
    # the machine: what a CPU record's speed depends on
    assert result["cpu"] == cpu_model() and result["threads"] == torch.get_num_threads()
    # and the float32 modes of torch's kernels (TF32 convolutions on a GPU)
    assert result["cudnn_allow_tf32"] == torch.backends.cudnn.allow_tf32
    assert result["float32_matmul_precision"] == torch.get_float32_matmul_precision()


def test_validation_part(tmp_path):
    """--val-split scores the held-out images each epoch in place of the test set, which is scored
    once at the end; --stop-at-val-accuracy ends the run at the first epoch that reaches it, and
    resuming a run that reached it trains no further."""
    common = ["--train-subset", "192", "--val-split", "64", "--test-subset", "64"]
    stopped, unreached = tmp_path / "stopped", tmp_path / "unreached"
    assert (
        train.main(train_args(stopped, *common, "--epochs", "3", "--stop-at-val-accuracy", "0.01"))
        == 0
    )
    result = json.loads((stopped / "result.json").read_text())
    history = json.loads((stopped / "metrics.json").read_text())["epochs"]
    assert result["epochs"] == len(history) == 1 and result["val_accuracy_reached"] is True
    assert result["val_accuracy"] == history[0]["val_accuracy"] >= 0.01
    assert "test_accuracy" not in history[0] and 0 <= result["test_accuracy"] <= 1
    assert result["val_images"] == 64
    header = (stopped / "metrics.csv").read_text().splitlines()[0]
    assert header.startswith(
        "epoch,step,lr,train_loss,train_accuracy,val_loss,val_accuracy,val_error,"
    )
    step = checkpoint(stopped)["step"]
    assert step == 4  # 128 training images in batches of 32
    assert train.main(["--resume", str(stopped), "--no-progress", "--no-plots"]) == 0
    assert checkpoint(stopped)["step"] == step
    plotted = [
        a
        for a in train_args(unreached, *common, "--epochs", "2", "--stop-at-val-accuracy", "1")
        if a != "--no-plots"
    ]
    assert train.main(plotted) == 0
    result = json.loads((unreached / "result.json").read_text())
    assert result["epochs"] == 2 and result["val_accuracy_reached"] is (result["val_accuracy"] == 1)
    assert (unreached / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_writes_a_checkpoint(tmp_path):
    """SIGINT in the middle of training: exit code 130, a checkpoint to resume from."""
    cmd = [
        sys.executable,
        "-m",
        "capsroute.train",
        *train_args(tmp_path, "--train-subset", "64", "--test-subset", "32", "--epochs", "100000"),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.json").exists():  # past the first epoch: inside the loop
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr
    state = checkpoint(tmp_path)
    assert state["step"] >= 2 and state["epoch"] >= 1


def test_two_gloo_processes(tmp_path):
    """torchrun with two CPU processes (DDP over gloo): both shards train, the result counts
    two devices and the global batch."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "capsroute.train",
        *train_args(tmp_path, "--train-subset", "256", "--test-subset", "64", "--epochs", "2"),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:  # a hung rendezvous must not leave worker processes behind
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["devices"] == 2 and result["batch_size"] == 64 and result["epochs"] == 2
    # the torchrun line that started the run (the world size is "devices")
    assert result["command"] == shlex.join(cmd) and result["resume_commands"] == []
    assert checkpoint(tmp_path)["step"] == 2 * 4  # 256 images / (2 ranks x 32) per epoch
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert history[-1]["train_loss"] < history[0]["train_loss"]


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision(tmp_path, amp):
    assert (
        train.main(
            train_args(
                tmp_path,
                "--train-subset",
                "128",
                "--test-subset",
                "32",
                "--epochs",
                "2",
                "--amp",
                amp,
            )
        )
        == 0
    )
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert all(torch.isfinite(torch.tensor(m["train_loss"])) for m in history)
    assert history[-1]["train_loss"] < history[0]["train_loss"]


def test_reference_backend_trains_the_same_network(tmp_path):
    common = ["--train-subset", "64", "--test-subset", "32", "--epochs", "1", "--shift", "0"]
    assert train.main(train_args(tmp_path / "fused", *common)) == 0
    assert train.main(train_args(tmp_path / "reference", *common, "--backend", "reference")) == 0
    fused, reference = (
        checkpoint(tmp_path / "fused")["model"],
        checkpoint(tmp_path / "reference")["model"],
    )
    for name in fused:
        torch.testing.assert_close(fused[name], reference[name], rtol=1e-4, atol=1e-5)


def test_missing_data_says_how_to_get_it(tmp_path):
    with pytest.raises(SystemExit, match="--download"):
        train.main(
            [
                "--data-dir",
                str(tmp_path / "nowhere"),
                "--out",
                str(tmp_path / "run"),
                "--no-progress",
            ]
        )


def test_figures_from_a_run(tmp_path, capsys):
    assert (
        train.main(
            train_args(tmp_path, "--train-subset", "64", "--test-subset", "32", "--epochs", "1")
        )
        == 0
    )
    capsys.readouterr()
    assert cli_main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    for name in ("curves.png", "reconstructions.png", "perturbations.png"):
        assert f"wrote {tmp_path / name}" in printed
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    elsewhere = tmp_path / "figures"
    assert cli_main(["plot", str(tmp_path), "--out", str(elsewhere)]) == 0
    assert sorted(p.name for p in elsewhere.iterdir()) == [
        "curves.png",
        "perturbations.png",
        "reconstructions.png",
    ]
    capsys.readouterr()
    # A run kept without its checkpoint (as bench/results keeps them): the curves alone.
    (tmp_path / "checkpoint.pt").unlink()
    assert cli_main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'curves.png'}" in printed and "reconstructions" not in printed
    assert "no checkpoint.pt" in printed


def efficientcapsnet_args(out: Path, *extra: str) -> list[str]:
    return [
        "--model",
        "efficientcapsnet",
        "--data-dir",
        str(DATA),
        "--out",
        str(out),
        "--no-progress",
        "--no-plots",
        *extra,
    ]


def test_efficientcapsnet_trains_by_its_recipe(tmp_path, capsys):
    """The options left out come from the paper's recipe (batch 16, Adam 5e-4 decayed by 0.97 an
    epoch, the official augmentation), those given win; a run stopped mid-epoch resumes to the
    same network."""
    common = ["--train-subset", "64", "--test-subset", "32", "--epochs", "2"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert train.main(efficientcapsnet_args(straight, *common)) == 0
    recipe = capsys.readouterr().out.split("efficientcapsnet on mnist: its recipe gives ")[1]
    assert recipe.splitlines()[0] == (
        "--batch-size 16 --lr 0.0005 --lr-decay 0.97 --decay-steps 0 --min-lr 5e-05 "
        "--augment efficientcapsnet"
    )
    state = checkpoint(straight)
    args = {key: state["args"][key] for key in ("batch_size", "epochs", "lr", "augment")}
    assert args == {"batch_size": 16, "epochs": 2, "lr": 5e-4, "augment": "efficientcapsnet"}
    assert state["step"] == 8 and state["history"][-1]["lr"] == pytest.approx(5e-4 * 0.97**2)
    assert train.main(efficientcapsnet_args(resumed, *common, "--max-steps", "5")) == 0
    assert train.main(["--resume", str(resumed), "--no-progress", "--no-plots"]) == 0
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, checkpoint(resumed)["model"][name]), name


@pytest.mark.slow
def test_efficientcapsnet_learns(tmp_path):
    """300 steps of 16 augmented images by the recipe: the loss falls and the network gets 80% of
    1000 unseen digits (90% when written; the test lags training while batch norm's running
    statistics, updated by 1% a step as in Keras, catch up)."""
    extra = ["--train-subset", "1600", "--test-subset", "1000", "--epochs", "3"]
    assert train.main(efficientcapsnet_args(tmp_path, *extra)) == 0
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert history[-1]["train_loss"] < 0.5 * history[0]["train_loss"]
    assert history[-1]["test_accuracy"] >= 0.8, history


def test_efficientcapsnet_on_multimnist_pairs(tmp_path):
    """The 36x36 graph on pairs: each digit reconstructed from its label's capsule."""
    extra = ["--dataset", "multimnist", "--train-subset", "64", "--pairs-per-digit", "1"]
    extra += ["--test-subset", "32", "--epochs", "1", "--batch-size", "32"]
    assert train.main(efficientcapsnet_args(tmp_path, *extra)) == 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["model"] == "efficientcapsnet" and result["train_pairs"] == 64
    assert 0 < result["test_error"] <= 1
    history = json.loads((tmp_path / "metrics.json").read_text())["epochs"]
    assert 0 < history[-1]["test_recon_error"] < 1


def test_floored_exponential_lr():
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = FlooredExponentialLR(optimizer, 0.5, min_lr=0.2)
    lrs = []
    for _ in range(4):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == [0.5, 0.25, 0.2, 0.2]
