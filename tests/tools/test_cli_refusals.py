"""Every refusal of `capsroute train` and `capsroute plot` is one line on stderr and a non-zero
exit, without a traceback, and comes before any data is read where it needs none. Run in-process
through capsroute.cli.main: a refusal raises SystemExit with the line (the interpreter prints it,
status 1) or, for argparse's usage errors, prints it and exits with status 2."""

import gzip
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import capsroute
from capsroute import cli
from capsroute._utils.command import CommandError
from capsroute.datasets import mnist
from capsroute.train.args import CHECKPOINT_KEYS
from capsroute.train.model_config import model_options

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"
SMALL_CAPSNET = ["--model-config", "conv_channels=8", "primary_types=2", "decoder=(16,16)"]


def stderr_of_refusal(capsys, argv: list[str]) -> list[str]:
    """The lines a process running `capsroute ARGV` would print on stderr; asserts a non-zero exit
    and no traceback."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    code = e.value.code
    if isinstance(code, str):  # printed by the interpreter on the way out, with status 1
        err, code = err + code + "\n", 1
    assert code not in (0, None), err
    assert "Traceback" not in err
    return err.splitlines()


def refusal(capsys, argv: list[str]) -> str:
    lines = stderr_of_refusal(capsys, argv)
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def empty(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("no-data")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run of one step of a tiny CapsNet on the committed MNIST subset, to resume."""
    out = tmp_path_factory.mktemp("run")
    assert (
        cli.main(
            [
                "train",
                "--data-dir",
                str(DATA),
                "--out",
                str(out),
                "--batch-size",
                "8",
                "--train-subset",
                "16",
                "--test-subset",
                "8",
                "--max-steps",
                "1",
                "--no-progress",
                "--no-plots",
                *SMALL_CAPSNET,
            ]
        )
        == 0
    )
    return out


# The refusals that need no data: (options after `capsroute train`, words the line must contain).
BEFORE_DATA = [
    (["--batch-size", "0"], "--batch-size: must be a whole number >= 1, got '0'"),
    (["--batch-size", "many"], "--batch-size: must be a whole number >= 1, got 'many'"),
    (["--epochs", "0"], "--epochs: must be a whole number >= 1"),
    (["--max-steps", "-1"], "--max-steps: must be a whole number >= 1"),
    (["--train-subset", "0"], "--train-subset: must be a whole number >= 1"),
    (["--test-subset=-3"], "--test-subset: must be a whole number >= 1, got '-3'"),
    (["--lr", "0"], "--lr: must be a number > 0"),
    (["--lr", "nan"], "--lr: must be a number > 0"),
    (["--lr-decay", "1.5"], "--lr-decay: must be a number > 0 and <= 1"),
    (["--decay-steps=-1"], "--decay-steps: must be a whole number >= 0, got '-1'"),
    (["--min-lr=-1e-5"], "--min-lr: must be a number >= 0, got '-1e-5'"),
    (["--augment", "flip"], "--augment: invalid choice: 'flip'"),
    (
        ["--model", "efficientcapsnet", "--shift", "3"],
        "--shift 3: --augment efficientcapsnet shifts as its own generator does",
    ),
    (["--weight-decay", "inf"], "--weight-decay: must be a number >= 0"),
    (["--seed=-1"], "--seed: must be a whole number in 0..2147483647"),
    (["--pairs-per-digit", "1001"], "--pairs-per-digit: must be a whole number in 1..1000"),
    (["--device", "gpu"], "--device: must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["--model", "resnet"], "--model: invalid choice: 'resnet'"),
    (["--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["--model-config", "decoder"], "--model-config: expected KEY=VALUE, got 'decoder'"),
    (
        ["--model-config", "conv_channels=abc"],
        "--model-config conv_channels=abc: capsnet's conv_channels must be a whole number >= 1",
    ),
    (["--model-config", "foo=bar"], "--model-config foo=bar: capsnet has no option 'foo'"),
    (["--model-config", "iters=0"], "capsnet's iters must be a whole number >= 1"),
    (["--model-config", "iters=True"], "capsnet's iters must be a whole number >= 1"),
    (["--model-config", "decoder=64"], "capsnet's decoder must be a tuple of whole numbers >= 1"),
    (["--model-config", "backend=reference"], "capsnet has no option 'backend'"),
    (["--model-config", "image_size=36"], "capsnet has no option 'image_size'"),
    (
        ["--model", "cnn", "--model-config", "channels=(8,8)"],
        "cnn's channels must be a tuple of 3 whole numbers",
    ),
    (
        ["--model", "efficientcapsnet", "--model-config", "channels=(32,64,64)"],
        "efficientcapsnet's channels must be a tuple of 4 whole numbers",
    ),
    (
        ["--model", "efficientcapsnet", "--model-config", "iters=3"],
        "efficientcapsnet has no option 'iters'",
    ),
    (
        ["--model", "matrixcapsnet", "--model-config", "A=1.5"],
        "matrixcapsnet's A must be a whole number >= 1",
    ),
    (
        ["--model", "matrixcapsnet", "--model-config", "final_lambda=-1"],
        "final_lambda must be a number > 0",
    ),
    (
        ["--model", "matrixcapsnet", "--model-config", "pose_norm=yes"],
        "pose_norm must be True or False",
    ),
    (
        ["--model", "matrixcapsnet", "--model-config", "conv_routing=paper"],
        "matrixcapsnet's conv_routing must be one of window, cross-window",
    ),
    (
        ["--dataset", "multimnist", "--model", "matrixcapsnet"],
        "--dataset multimnist trains capsnet, efficientcapsnet or cnn",
    ),
    (["--evaluate"], "--evaluate needs --resume RUN_DIR"),
    (["--val-split", "0"], "--val-split: must be a whole number >= 1"),
    (["--stop-at-val-accuracy", "1.5"], "--stop-at-val-accuracy: must be a number > 0 and <= 1"),
    (["--stop-at-val-accuracy", "0.99"], "--stop-at-val-accuracy 0.99: needs --val-split N"),
    (
        ["--dataset", "multimnist", "--val-split", "100"],
        "--val-split 100: holds out training images of mnist, fashion-mnist or mnist40",
    ),
    (
        ["--cuda-graph", "--amp", "fp16"],
        "--cuda-graph: --amp fp16 checks its loss scale on the host",
    ),
    (
        ["--cuda-graph", "--device", "cpu"],
        "--cuda-graph replays the step on a CUDA device; this run is on cpu",
    ),
]


@pytest.mark.parametrize("options, words", BEFORE_DATA, ids=[" ".join(o) for o, _ in BEFORE_DATA])
def test_refused_before_any_data(capsys, empty, options, words):
    """--data-dir is an empty folder: a refusal about the data would say "could not find"."""
    line = refusal(
        capsys, ["train", "--data-dir", str(empty), "--out", str(empty / "run"), *options]
    )
    assert line.startswith("capsroute train: error: ") and words in line, line
    assert not (empty / "run").exists()


def test_missing_data(capsys, empty):
    line = refusal(capsys, ["train", "--data-dir", str(empty), "--out", str(empty / "run")])
    assert (
        "could not find the mnist IDX files" in line
        and "--download" in line
        and "shared" not in line
    )


def test_out_is_a_file(capsys, tmp_path):
    (tmp_path / "taken").write_text("")
    line = refusal(capsys, ["train", "--data-dir", str(tmp_path), "--out", str(tmp_path / "taken")])
    assert f"--out {tmp_path / 'taken'}: a file, not a folder" in line


def test_out_cannot_be_made(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    *warnings, line = stderr_of_refusal(
        capsys,
        [
            "train",
            "--data-dir",
            str(DATA),
            "--out",
            str(tmp_path / "file" / "run"),
            "--train-subset",
            "8",
            "--test-subset",
            "8",
            *SMALL_CAPSNET,
        ],
    )
    assert [w.split(":")[0] for w in warnings] == ["warning"]  # mnist-small is a subset
    assert f"--out {tmp_path / 'file' / 'run'}: cannot make the folder" in line


def copy_of_the_data(tmp_path: Path) -> Path:
    folder = tmp_path / "mnist"
    shutil.copytree(DATA, folder)
    return folder


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda raw: raw[: len(raw) // 2], "corrupt or truncated gzip stream"),
        (lambda raw: gzip.compress(gzip.decompress(raw)[:-5]), "truncated IDX payload"),
        (lambda raw: b"not an IDX file", "bad IDX magic number"),
    ],
)
def test_damaged_idx_file(capsys, tmp_path, damage, words):
    folder = copy_of_the_data(tmp_path)
    labels = folder / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(damage(labels.read_bytes()))
    line = refusal(capsys, ["train", "--data-dir", str(folder), "--out", str(tmp_path / "run")])
    assert f"{labels}: {words}" in line and "--download" in line, line


def test_another_datasets_files(capsys, tmp_path):
    """mnist-small is not the published MNIST (a subset): told from Fashion-MNIST by content."""
    line = refusal(
        capsys,
        [
            "train",
            "--dataset",
            "fashion-mnist",
            "--data-dir",
            str(DATA),
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert (
        f"the images in {DATA} look like mnist's, not fashion-mnist's: pass --dataset mnist" in line
    )


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_published_files_of_the_other_dataset(capsys, tmp_path, name):
    shared = REPO.parent / "shared" / "data" / name
    if not shared.is_dir():
        pytest.skip(f"no {shared}")
    other = {"mnist": "fashion-mnist", "fashion-mnist": "mnist"}[name]
    line = refusal(
        capsys,
        ["train", "--dataset", other, "--data-dir", str(shared), "--out", str(tmp_path / "r")],
    )
    assert (
        f"the files in {shared} are the published {name} files, not {other}'s: pass --dataset {name}"
        in line
    )


def test_not_the_published_files_is_a_warning(capsys, tmp_path):
    """A subset of MNIST (not the published files) trains, with a one-line warning."""
    assert (
        cli.main(
            [
                "train",
                "--data-dir",
                str(DATA),
                "--out",
                str(tmp_path),
                "--batch-size",
                "8",
                "--train-subset",
                "8",
                "--test-subset",
                "8",
                "--max-steps",
                "1",
                "--no-progress",
                "--no-plots",
                *SMALL_CAPSNET,
            ]
        )
        == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: {DATA} does not hold the published mnist files (a subset, or another copy): "
        f"their checksums are not checked"
    ]


def test_too_few_digits_to_pair(capsys, tmp_path):
    line = refusal(
        capsys,
        [
            "train",
            "--dataset",
            "multimnist",
            "--data-dir",
            str(DATA),
            "--train-subset",
            "1",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert (
        "--dataset multimnist --train-subset 1: MultiMNIST: the digits must span at least two classes"
        in line
    )


def test_failed_download(capsys, tmp_path, monkeypatch):
    def offline(url, timeout):
        raise OSError("offline")

    monkeypatch.setattr(mnist, "_urlopen", offline)
    line = refusal(
        capsys, ["train", "--download", "--data-dir", str(tmp_path), "--out", str(tmp_path / "run")]
    )
    assert (
        "--download: could not download mnist file train-images-idx3-ubyte.gz" in line
        and "offline" in line
    )


def test_fp16_on_a_cpu_is_a_warning(capsys, empty):
    lines = stderr_of_refusal(
        capsys,
        [
            "train",
            "--amp",
            "fp16",
            "--device",
            "cpu",
            "--data-dir",
            str(empty),
            "--out",
            str(empty / "run"),
        ],
    )
    assert len(lines) == 2 and lines[0].startswith(
        "warning: --amp fp16 on a CPU runs about 15x slower"
    )
    assert "could not find" in lines[1]


def test_debug_shows_the_traceback(empty):
    with pytest.raises(CommandError, match="could not find") as e:
        cli.main(["train", "--debug", "--data-dir", str(empty), "--out", str(empty / "run")])
    assert isinstance(e.value.__cause__, FileNotFoundError)


def test_one_line_from_a_real_process(empty):
    proc = subprocess.run(
        [sys.executable, "-m", "capsroute.cli", "train", "--batch-size", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--batch-size" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "capsroute.cli", "train", "--data-dir", str(empty)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "could not find" in proc.stderr


# ---------------------------------------------------------------------- checkpoints and --resume


def resume_refusal(capsys, checkpoint_dir: Path, *options: str) -> str:
    return refusal(capsys, ["train", "--resume", str(checkpoint_dir), "--no-progress", *options])


def test_resume_without_a_checkpoint(capsys, tmp_path):
    line = resume_refusal(capsys, tmp_path / "nowhere")
    assert f"--resume {tmp_path / 'nowhere'}: no checkpoint at {tmp_path / 'nowhere'}" in line


class RunsCode:
    """Unpickling this creates the file `marker`: what a checkpoint loaded unsafely could do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("kind", ["garbage", "truncated", "code", "pickle"])
def test_unsafe_or_damaged_checkpoint(capsys, tmp_path, run_dir, kind):
    path = tmp_path / "checkpoint.pt"
    marker = tmp_path / "code-ran"
    if kind == "garbage":
        path.write_bytes(b"\x00garbage" * 100)
    elif kind == "truncated":
        path.write_bytes((run_dir / "checkpoint.pt").read_bytes()[:5000])
    elif kind == "code":
        torch.save({"args": RunsCode(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"args": RunsCode(marker)}))
    line = resume_refusal(capsys, tmp_path)
    assert f"{path}: not a checkpoint capsroute {capsroute.__version__} can load safely" in line
    assert not marker.exists()


def test_foreign_checkpoint(capsys, tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "checkpoint.pt")
    line = resume_refusal(capsys, tmp_path)
    assert f"{tmp_path / 'checkpoint.pt'}: not a capsroute train checkpoint" in line


@pytest.mark.parametrize("version", ["0.0.1", None])
def test_checkpoint_of_another_version(capsys, tmp_path, run_dir, version):
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state.keys() == CHECKPOINT_KEYS and state["capsroute"] == capsroute.__version__
    if version is None:
        del state["capsroute"]
    else:
        state["capsroute"] = version
    torch.save(state, tmp_path / "checkpoint.pt")
    line = resume_refusal(capsys, tmp_path)
    written = f"capsroute {version}" if version else "an older capsroute (no version recorded)"
    assert f"written by {written}, this is capsroute {capsroute.__version__}" in line


@pytest.mark.parametrize(
    "options, words",
    [
        (
            ["--model", "matrixcapsnet"],
            "--model matrixcapsnet: the run in {run} has capsnet, which --resume keeps",
        ),
        (["--model", "capsnet", "--batch-size", "64"], "--batch-size 64: the run in {run} has 8"),
        (["--dataset", "fashion-mnist"], "--dataset fashion-mnist: the run in {run} has mnist"),
        (
            ["--model-config", "conv_channels=9"],
            "--model-config conv_channels=9: the run in {run} has conv_channels=8 "
            "primary_types=2 decoder=(16,16)",
        ),
        (["--seed", "1"], "--seed 1: the run in {run} has 0"),
        (["--out", "elsewhere"], "--out elsewhere: a resumed run stays in its folder {run}"),
    ],
)
def test_resume_refuses_what_it_cannot_change(capsys, run_dir, options, words):
    line = resume_refusal(capsys, run_dir, *options)
    assert words.format(run=run_dir) in line, line


def test_resume_accepts_the_runs_own_values(run_dir, tmp_path):
    """Options given with the run's values (in another spelling too) and those --resume may
    change."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert (
        cli.main(
            [
                "train",
                "--resume",
                str(copy),
                "--model",
                "capsnet",
                "--batch-size",
                "8",
                "--model-config",
                "conv_channels=8",
                "primary_types=2",
                "decoder=(16, 16)",
                "--epochs",
                "3",
                "--max-steps",
                "2",
                "--no-progress",
                "--no-plots",
            ]
        )
        == 0
    )
    args = torch.load(copy / "checkpoint.pt", weights_only=True)["args"]
    assert (
        args["epochs"] == 3
        and args["max_steps"] == 2
        and args["model_config"][2] == "decoder=(16,16)"
    )
    assert args["invocation"].startswith("capsroute train --data-dir")  # the first command stays
    assert args["resume_commands"] == [
        f"capsroute train --resume {copy} --model capsnet --batch-size 8 "
        "--model-config conv_channels=8 primary_types=2 'decoder=(16, 16)' "
        "--epochs 3 --max-steps 2 --no-progress --no-plots"
    ]


# ------------------------------------------------------------------------------ capsroute plot


def test_plot_refusals(capsys, tmp_path):
    assert (
        refusal(capsys, ["plot", str(tmp_path / "nothing")])
        == f"capsroute plot: error: {tmp_path / 'nothing'}: no such file or folder; pass a benchmark JSON or a run folder"
    )
    assert "not a capsroute train run (no metrics.json)" in refusal(capsys, ["plot", str(tmp_path)])
    (tmp_path / "x.json").write_text("{not json")
    assert "x.json: not a capsroute bench report (not JSON" in refusal(
        capsys, ["plot", str(tmp_path / "x.json")]
    )
    (tmp_path / "y.json").write_text("[1, 2]")
    assert "y.json: not a capsroute bench report" in refusal(
        capsys, ["plot", str(tmp_path / "y.json")]
    )


# ---------------------------------------------------------------- the numeric options, fuzzed

NUMERIC_OPTIONS = [
    "--batch-size",
    "--epochs",
    "--lr",
    "--train-subset",
    "--test-subset",
    "--max-steps",
    "--val-split",
    "--lr-decay",
    "--decay-steps",
    "--min-lr",
    "--weight-decay",
    "--shift",
    "--seed",
    "--margin-ramp-epochs",
    "--pairs-per-digit",
]
VALUES = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.floats().map(repr),
    st.floats().map(str),
    st.text(max_size=12),
    st.sampled_from(["1e400", "-0", "0x10", "1_0", " 7 ", "(1,)", "True"]),
)
MODEL_KEYS = sorted(
    {
        (model, key)
        for model in ("capsnet", "efficientcapsnet", "matrixcapsnet", "cnn")
        for key in model_options(model)
    }
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(option=st.sampled_from(NUMERIC_OPTIONS), value=VALUES)
def test_fuzzed_numeric_options(capsys, empty, option, value):
    """Any value: refused in one line; or accepted, and then the empty data folder refuses."""
    line = refusal(
        capsys,
        ["train", "--data-dir", str(empty), "--out", str(empty / "run"), f"{option}={value}"],
    )
    assert line.startswith("capsroute train: error: ")
    assert (
        line.startswith(f"capsroute train: error: argument {option}: must be ")
        or "could not find" in line
    )


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(model_key=st.sampled_from(MODEL_KEYS), value=VALUES)
def test_fuzzed_model_config(capsys, empty, model_key, value):
    model, key = model_key
    line = refusal(
        capsys,
        [
            "train",
            "--model",
            model,
            "--data-dir",
            str(empty),
            "--out",
            str(empty / "run"),
            "--model-config",
            f"{key}={value}",
        ],
    )
    assert line.startswith("capsroute train: error: ")
    assert (
        f"{model}'s {key} must be" in line or "--model-config" in line or "could not find" in line
    )
