"""The CUDA ops on the streams and graphs users run them in: a side stream, a CUDA graph captured
without warm-up, and a forced cluster path that a GPU may not schedule (they run on a GPU only)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import capsroute
from capsroute import reference
from helpers import HAS_CUDA, TOLERANCE, assert_rel_close, randn
from op_db import OP_DB

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]

TESTS = Path(__file__).resolve().parents[1]  # where helpers and op_db live
# Each op at its first float32 test shape of the op table.
SHAPES = {spec.name: spec.shapes[torch.float32][0] for spec in OP_DB}
# The paths the ops can take (csrc/cuda/kernel_options.h): the warp rows, and the dispatch's choice.
KERNEL_SWITCHES = [{"CAPSROUTE_ROUTING_CLUSTER": "0"}, {}]
# The same kernels on the same values; the dense and conv ops' GEMMs are cuBLAS's, whose algorithm
# may depend on the stream's workspace, so a last-bit difference there is not a failure.
SAME = dict(rtol=1e-6, atol=1e-7)


def switch_id(switches: dict) -> str:
    return ",".join(f"{k.removeprefix('CAPSROUTE_')}={v}" for k, v in switches.items()) or "auto"


@pytest.mark.parametrize("switches", KERNEL_SWITCHES, ids=switch_id)
@pytest.mark.parametrize("spec", OP_DB, ids=lambda spec: spec.name)
def test_side_stream_gives_the_default_streams_results(spec, switches, monkeypatch):
    for name, value in switches.items():
        monkeypatch.setenv(name, value)
    sample = spec.draw(SHAPES[spec.name], "cuda", torch.float32)
    on_default, cotangents = spec.run(spec.fn, sample)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the inputs were written on the default stream
    with torch.cuda.stream(side):
        on_side, _ = spec.run(spec.fn, sample, cotangents)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for name, a, b in zip(spec.names(sample), on_side, on_default):
        torch.testing.assert_close(
            a, b, **SAME, msg=f"{spec.name} {name}: differs on the side stream"
        )


# Run in a fresh process, so that no capsroute kernel has run before the capture (the first call
# sets the cluster kernels' attributes and queries their occupancy): each op's forward and
# backward captured into one CUDA graph, replayed on new inputs copied into the static ones, and
# compared with eager calls on the same inputs.
CAPTURE_SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r})
import capsroute
from op_db import OP_DB
SHAPES = {shapes!r}
SAME = {same!r}
# torch's own lazy set-up (cuBLAS handles and workspaces, the autograd engine), not capsroute's
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    x = torch.randn(8, 8, device="cuda", requires_grad=True)
    (x @ x).sum().backward()
torch.cuda.synchronize()
for spec in OP_DB:
    # The inputs made on the capture's stream: a backward run in the capture waits for the stream
    # each leaf was made on, and waiting for the default stream breaks the capture.
    with torch.cuda.stream(side):
        sample = spec.draw(SHAPES[spec.name], "cuda", torch.float32)
        outs = spec.outputs(spec.fn, sample)[:spec.grad_outputs]
        cotangents = [torch.randn_like(o, dtype=torch.float64) for o in outs]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        static = spec.run(spec.fn, sample, cotangents)[0]
    fresh = spec.draw(SHAPES[spec.name], "cuda", torch.float32)
    with torch.no_grad():
        for t, new in zip(sample.inputs(), fresh.inputs()):
            t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = spec.run(spec.fn, fresh, cotangents)[0]
    for name, a, b in zip(spec.names(sample), static, eager):
        torch.testing.assert_close(a, b, **SAME, msg=f"{{spec.name}} {{name}}: the replay differs")
    print(spec.name, "ok")
"""


@pytest.mark.parametrize("switches", KERNEL_SWITCHES, ids=switch_id)
def test_cuda_graph_captured_without_warm_up_replays_the_eager_results(switches):
    script = CAPTURE_SCRIPT.format(tests=str(TESTS), shapes=SHAPES, same=SAME)
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **switches},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == [word for spec in OP_DB for word in (spec.name, "ok")]


def test_forced_clusters_that_cannot_be_scheduled_refuse_or_run_and_say_so(monkeypatch):
    """float64 at the MNIST shape: the cluster backward's blocks need so many registers and so much
    shared memory that one fits an SM, and 16 of them must share a GPC. Forced, each direction
    either runs the clusters (and records so) or refuses with a message that names the switch;
    automatic, a direction that refused falls back to the warp rows, and the record says so."""
    votes = randn(4, 1152, 10, 16, device="cuda", scale=0.1, requires_grad=True)
    bias = randn(10, 16, device="cuda", scale=0.1, requires_grad=True)
    grad_v = randn(4, 10, 16, device="cuda")
    v_ref = reference.dynamic_routing(votes, bias=bias)
    expected = [v_ref, *torch.autograd.grad(v_ref, (votes, bias), grad_v)]

    def run_directions():
        """{direction: the path it ran, or its refusal}; the results checked where both ran."""
        capsroute.clear_kernel_paths()
        try:
            v = capsroute.dynamic_routing(votes, bias=bias)
        except RuntimeError as e:
            return {"forward": e}
        ran = {"forward": capsroute.last_kernel_path("dynamic_routing", "forward")}
        try:
            got = [v, *torch.autograd.grad(v, (votes, bias), grad_v)]
        except RuntimeError as e:
            return {**ran, "backward": e}
        for a, b in zip(got, expected):
            assert_rel_close(a, b, TOLERANCE[torch.float64])
        return {**ran, "backward": capsroute.last_kernel_path("dynamic_routing", "backward")}

    monkeypatch.setenv("CAPSROUTE_ROUTING_CLUSTER", "force")
    forced = run_directions()
    monkeypatch.delenv("CAPSROUTE_ROUTING_CLUSTER")
    automatic = run_directions()
    for direction, outcome in forced.items():
        if isinstance(outcome, RuntimeError):
            assert "CAPSROUTE_ROUTING_CLUSTER=force, but" in str(outcome), str(outcome)
            assert automatic[direction] == "v2-warp-rows", automatic
        else:
            assert outcome == "v2-cluster", forced
            assert automatic[direction] in ("v2-cluster", "v2-warp-rows"), automatic
