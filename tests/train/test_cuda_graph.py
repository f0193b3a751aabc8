"""`capsroute train --cuda-graph`: the training step captured in a CUDA graph (capsroute.train.cuda_graph)
computes what the eager step computes, shorter batches and changing scalars included. The refusals
are in test_cli_refusals.py."""

import argparse
import copy
from pathlib import Path

import pytest
import torch

from capsroute import train
from capsroute._utils.command import CommandError
from capsroute.train.args import choose_cuda_graph
from capsroute.train.cuda_graph import GraphedStep
from helpers import HAS_CUDA, SMALL_CAPSNET, SMALL_MATRIXCAPSNET

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "mnist-small"
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


def test_refuses_an_optimizer_it_cannot_capture():
    weight = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="capturable=True"):
        GraphedStep(lambda: None, torch.optim.Adam([weight]))


def step_of(model, optimizer):
    """A step whose loss depends on a float that changes every step (as the spread-loss margin)."""

    def step(x, y, margin):
        loss = (torch.relu(margin - model(x).squeeze(-1) * y) ** 2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    return step


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "foreach"])
@pytest.mark.cuda
@needs_gpu
def test_replays_what_the_eager_step_computes(fused):
    """Ten steps of a small network, one of them on a shorter batch, with the margin and the
    learning rate changed every step: the graphed twin's losses and weights follow the eager
    one's, and it did capture."""
    torch.manual_seed(0)
    eager_model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
    ).cuda()
    graphed_model = copy.deepcopy(eager_model)
    optimizers = [
        torch.optim.Adam(m.parameters(), lr=1e-2, fused=fused, capturable=True)
        for m in (eager_model, graphed_model)
    ]
    eager_step = step_of(eager_model, optimizers[0])
    graphed_step = GraphedStep(step_of(graphed_model, optimizers[1]), optimizers[1])
    for i, batch in enumerate([64] * 6 + [40] + [64] * 3):
        x, y = torch.randn(batch, 16, device="cuda"), torch.randn(batch, device="cuda").sign()
        margin = 0.2 + 0.07 * i
        for optimizer in optimizers:
            optimizer.param_groups[0]["lr"] = 1e-2 * 0.9**i
        expected = eager_step(x, y, margin)
        got = graphed_step(x, y, margin)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=f"step {i}")
    assert graphed_step.graph is not None
    for a, b in zip(eager_model.parameters(), graphed_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def train_args(out: Path, model: list[str], *extra: str) -> list[str]:
    return [
        *model,
        "--data-dir",
        str(DATA),
        "--out",
        str(out),
        "--device",
        "cuda",
        "--no-progress",
        "--no-plots",
        "--batch-size",
        "32",
        "--train-subset",
        "304",  # 9 batches of 32 and one of 16 an epoch
        "--test-subset",
        "64",
        "--epochs",
        "2",
        *extra,
    ]


MODELS = {
    "capsnet": SMALL_CAPSNET,
    # the spread-loss margin grows every step of the first epoch
    "matrixcapsnet": [*SMALL_MATRIXCAPSNET, "--margin-ramp-epochs", "1"],
    # autocast inside the graph
    "capsnet-bf16": [*SMALL_CAPSNET, "--amp", "bf16"],
}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.cuda
@needs_gpu
def test_train_with_cuda_graph_trains_as_eager(tmp_path, monkeypatch, model):
    """Two epochs of 9 full batches and a short one, with and without --cuda-graph (cuDNN
    deterministic in both): the same weights and metrics, with 15 steps replayed (the full batches
    after 3 eager ones). The learning rate halves every step down to its floor at step 6, while
    replays run: powers of two, the same in float32 and float64, so a stale one shows."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(
        torch.cuda.CUDAGraph, "replay", lambda graph: replays.append(1) or replay(graph)
    )
    schedule = [
        "--lr",
        str(2**-8),
        "--lr-decay",
        "0.5",
        "--decay-steps",
        "1",
        "--min-lr",
        str(2**-14),
    ]
    for name, extra in (("eager", ["--no-cuda-graph"]), ("graph", ["--cuda-graph"])):
        assert train.main(train_args(tmp_path / name, MODELS[model], *schedule, *extra)) == 0
        assert len(replays) == (15 if name == "graph" else 0)
    eager, graph = (
        torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu", weights_only=True)
        for name in ("eager", "graph")
    )
    assert graph["args"]["cuda_graph"] and graph["step"] == eager["step"] == 20
    for name, tensor in eager["model"].items():
        torch.testing.assert_close(graph["model"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(eager["history"], graph["history"]):
        for key in ("train_loss", "test_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        # an image near a tie between two classes may go either way
        assert b["train_accuracy"] == pytest.approx(a["train_accuracy"], abs=2 / 304)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=2 / 64)


CUDA, CPU = torch.device("cuda"), torch.device("cpu")
CHECKED = dict(model="capsnet", backend="fused", amp="none")


@pytest.mark.parametrize(
    "cuda_graph, device, world_size, options, expected",
    [
        (None, CUDA, 1, CHECKED, (True, None)),  # the default where the graph was checked
        (None, CPU, 1, CHECKED, (False, None)),
        (False, CUDA, 1, CHECKED, (False, None)),
        (True, CUDA, 1, dict(CHECKED, model="matrixcapsnet"), (True, None)),
        (None, CUDA, 2, CHECKED, (False, "torchrun started 2 processes and a graph replays one")),
        (None, CUDA, 1, dict(CHECKED, amp="fp16"), (False, "--amp fp16 checks its loss scale")),
        (
            None,
            CUDA,
            1,
            dict(CHECKED, model="matrixcapsnet"),
            (False, "--model matrixcapsnet --backend fused --amp none is not yet checked"),
        ),
        (None, CUDA, 1, dict(CHECKED, amp="bf16"), (False, "--amp bf16 is not yet checked")),
        (None, CUDA, 1, dict(CHECKED, backend="reference"), (False, "--backend reference")),
    ],
)
def test_the_graph_is_the_default_where_it_was_checked(
    cuda_graph, device, world_size, options, expected
):
    """Needs no GPU: the choice reads the device's type, the process count and the options."""
    args = argparse.Namespace(cuda_graph=cuda_graph, **options)
    use, reason = choose_cuda_graph(args, device, world_size)
    assert use == expected[0]
    assert (reason is None) == (expected[1] is None)
    assert reason is None or expected[1] in reason


@pytest.mark.parametrize(
    "device, world_size, words",
    [
        (CPU, 1, "--cuda-graph replays the step on a CUDA device; this run is on cpu"),
        (CUDA, 2, "--cuda-graph runs in one process; torchrun started 2"),
    ],
)
def test_an_asked_for_graph_is_refused_where_it_cannot_run(device, world_size, words):
    args = argparse.Namespace(cuda_graph=True, **CHECKED)
    with pytest.raises(CommandError, match=words):
        choose_cuda_graph(args, device, world_size)
