"""capsroute._utils.runinfo (what records say about a run, the device, atomic writes) and the model
configuration that `capsroute train --model-config` and the figures share (capsroute.models)."""

import json
import re
from pathlib import Path

import pytest
import torch

import capsroute
from capsroute import train
from capsroute._utils import runinfo
from capsroute.models import CapsNet, MatrixCapsNet, build_model
from capsroute.train.model_config import parse_model_config


def test_commit_of_this_checkout():
    if not (Path(capsroute.__file__).resolve().parents[1] / ".git").exists():
        pytest.skip("capsroute is not imported from a git checkout")
    commit = runinfo.git_commit()
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit)
    assert runinfo.short_commit(commit) == commit[:7] + (
        "-dirty" if commit.endswith("-dirty") else ""
    )


def test_short_commit():
    assert runinfo.short_commit("0123456789abcdef" * 2 + "01234567") == "0123456"
    assert runinfo.short_commit("0123456789abcdef" * 2 + "01234567-dirty") == "0123456-dirty"
    assert runinfo.short_commit("unknown") == "unknown"


def test_names():
    assert [runinfo.dtype_name(d) for d in (torch.float32, torch.bfloat16)] == [
        "float32",
        "bfloat16",
    ]
    assert runinfo.device_name(torch.device("cpu")) == "cpu"
    assert runinfo.cpu_model()


def test_cpu_id(monkeypatch):
    """The processor's family and model from /proc/cpuinfo's fields, or None without them."""
    monkeypatch.setattr(
        runinfo, "_cpuinfo", lambda: {"model name": "AMD EPYC", "cpu family": "26", "model": "2"}
    )
    assert runinfo.cpu_id() == "family 26 model 2" and runinfo.cpu_model() == "AMD EPYC"
    monkeypatch.setattr(runinfo, "_cpuinfo", lambda: {})
    assert runinfo.cpu_id() is None


def test_resolve_device():
    assert runinfo.resolve_device("cpu") == torch.device("cpu")
    assert runinfo.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--device cuda:1: no CUDA device"):
            runinfo.resolve_device("cuda:1")


def test_write_json_atomic(tmp_path):
    path = tmp_path / "new" / "report.json"
    assert runinfo.write_json_atomic({"a": [1, 2]}, path) == path
    runinfo.write_json_atomic({"a": 3}, path)
    assert json.loads(path.read_text()) == {"a": 3}
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_replacing_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "checkpoint.pt"
    path.write_text("old")
    with pytest.raises(RuntimeError), runinfo.replacing(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old"


def test_model_config():
    config = parse_model_config(["conv_channels=32", "decoder=(64, 128)", "iters=2", "name=abc"])
    assert config == {"conv_channels": 32, "decoder": (64, 128), "iters": 2, "name": "abc"}
    with pytest.raises(ValueError, match="expected KEY=VALUE, got 'conv_channels'"):
        parse_model_config(["conv_channels"])
    model = build_model(
        "capsnet", "reference", {"conv_channels": 32, "primary_types": 8, "decoder": (64, 128)}
    )
    assert (
        isinstance(model, CapsNet)
        and model.conv.out_channels == 32
        and model.classes.backend == "reference"
    )
    assert isinstance(build_model("matrixcapsnet"), MatrixCapsNet)


def test_bad_model_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--model-config", "conv_channels=32", "decoder"])
    assert e.value.code == 2
    assert "argument --model-config: expected KEY=VALUE, got 'decoder'" in capsys.readouterr().err


def test_command_line_under_torchrun(monkeypatch):
    """Under torchrun the record names the torchrun line (the parent's, where /proc shows it), else one
    that starts the same processes."""
    assert (
        runinfo.command_line("capsroute train", ["--epochs", "1"]) == "capsroute train --epochs 1"
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(runinfo.os, "getppid", lambda: 2**31 - 1)  # no such process
    assert (
        runinfo.command_line("capsroute train", ["--epochs", "1"])
        == "torchrun --nnodes 1 --nproc-per-node 2 -m capsroute.train --epochs 1"
    )


def test_cpu_caches_from_sysfs(monkeypatch, tmp_path):
    for index, (level, kind, size) in enumerate(
        [
            ("1", "Data", "48K"),
            ("1", "Instruction", "32K"),
            ("2", "Unified", "1024K"),
            ("3", "Unified", "32768K"),
        ]
    ):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, value in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(value + "\n")
    monkeypatch.setattr(runinfo, "_CACHES", tmp_path)
    assert runinfo.cpu_caches() == {"L1d": "48K", "L1i": "32K", "L2": "1024K", "L3": "32768K"}
    monkeypatch.setattr(runinfo, "_CACHES", tmp_path / "none")
    assert runinfo.cpu_caches() == {}


def test_cpu_machine_names_the_build_and_its_vector_width():
    machine = runinfo.cpu_machine("x86-64-v4")
    assert machine["cpu_arch"] == "x86-64-v4" and machine["vector_bits"] == 512
    assert runinfo.cpu_machine("x86-64")["vector_bits"] is None
    line = runinfo.describe_cpu({**machine, "caches": {"L1i": "32K", "L2": "1024K"}})
    assert "built for x86-64-v4 (512-bit vectors), L2 1024K" in line and "L1i" not in line
