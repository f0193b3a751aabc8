"""The benchmark's attention routings (capsroute/bench): their shapes and default cases, inputs as
the layers make them, the floor and memory estimate, the calls of each impl, and a tiny end-to-end
run. Checks the machinery, not speed."""

import math

import pytest
import torch

from capsroute import bench, reference, testing
from capsroute.bench import op_bench, runner

CPU = torch.device("cpu")
ATTENTION = ("self_attention_routing", "inverted_attention_routing")
TINY = "24,5,8,4"  # I, J, D, Din


def tiny_case(op, B=3, layout="contiguous"):
    name, dims = bench.parse_shape(TINY)
    return bench.Case(op, name, B, **dims, layout=layout)


def test_names_and_default_cases():
    assert bench.op_name("self-attention") == "self_attention_routing"
    assert bench.op_name("inverted-attention") == "inverted_attention_routing"
    assert set(ATTENTION) <= set(bench.OPS)  # in the default run, kernel paths recorded
    assert bench.SHAPES["efficientcapsnet"] == dict(I=16, J=10, D=16, Din=8)
    assert bench.SHAPES["large-16k"] == dict(I=16384, J=100, D=16, Din=8)
    got = bench.make_cases(list(ATTENTION), None, None, "cpu")
    assert [(c.op, c.shape_name, c.B) for c in got] == [
        (op, shape, 32) for op in ATTENTION for shape in ("efficientcapsnet", "mnist")
    ]
    got = bench.make_cases(["inverted_attention_routing"], None, None, "cuda")
    assert [(c.shape_name, c.B) for c in got] == [
        *((s, B) for s in ("efficientcapsnet", "mnist") for B in (32, 128, 512, 2048)),
        *(("large-16k", B) for B in (8, 32, 128)),
    ]
    assert got[0].shape() == {"B": 32, "I": 16, "J": 10, "D": 16}
    # the dynamic-routing ops keep their defaults
    got = bench.make_cases(["dynamic_routing"], None, None, "cpu")
    assert [(c.shape_name, c.B) for c in got] == [("mnist", 32)]


@pytest.mark.parametrize("op", ATTENTION)
def test_inputs_are_the_layers(op):
    """Votes as the layer computes them from its weight and primary capsules (never zeros), the
    layer's other parameters near their initial values; the same seed, the same tensors."""
    case = tiny_case(op)
    inputs, grad = bench.make_inputs(op, case, torch.float32, CPU, seed=1)
    assert all(t.requires_grad and t.is_leaf and t.abs().sum() > 0 for t in inputs)
    votes = inputs[0]
    assert votes.shape == (3, 24, 5, 8) and votes.is_contiguous() and grad.shape == (3, 5, 8)
    if op == "self_attention_routing":
        assert inputs[1].shape == (24, 5) and inputs[1].abs().max() < 0.1
        std = math.sqrt(2 / (24 * 5 * 4))  # he_normal of the layer's weight
    else:
        assert [t.shape for t in inputs[1:]] == [(8,), (8,)]
        assert (inputs[1] - 1).abs().max() < 0.6 and inputs[2].abs().max() < 0.6
        std = math.sqrt(5 / (24 * 4))  # N(0, J / (I Din)), Tsai et al.'s
    # a vote is W_ij u_i with |u_i| <= 1 (Efficient-CapsNet's squash) or |u_i|^2 = Din (LayerNorm)
    norm = 1.0 if op == "self_attention_routing" else 2.0
    assert 0.3 < votes.std().item() / (std * norm) < 2.0
    # an input capsule's votes are W_i u_i, one weight for the batch: B = 6 of them span the
    # space of the u_i, Din = 4 dimensions (3 for LayerNorm outputs, whose values sum to 0)
    many, _ = bench.make_inputs(op, tiny_case(op, B=6), torch.float32, CPU)
    rank = torch.linalg.matrix_rank(many[0].detach()[:, 0].reshape(6, -1), rtol=1e-4)
    assert rank == (4 if op == "self_attention_routing" else 3)
    again, _ = bench.make_inputs(op, case, torch.float32, CPU, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(inputs, again))
    einsum, _ = bench.make_inputs(op, tiny_case(op, layout="einsum"), torch.float32, CPU, seed=1)
    assert torch.equal(einsum[0], votes) and einsum[0].stride()[1] == 5 * 8 * 3
    half, _ = bench.make_inputs(op, case, torch.bfloat16, CPU, seed=1)
    assert all(t.dtype == torch.bfloat16 for t in half)


def test_layer_votes_draw_the_weight_in_chunks(monkeypatch):
    u = torch.randn(2, 7, 3)

    def votes(chunk):
        monkeypatch.setattr(testing, "VOTE_CHUNK", chunk)
        gen = torch.Generator().manual_seed(0)
        drawn = []

        def randn(*shape, std=1.0, cast=True):
            drawn.append(torch.randn(*shape, generator=gen).mul_(std))
            return drawn[-1]

        return testing.layer_votes(u, 4, 5, 0.5, randn), torch.cat(drawn)

    got, weight = votes(3)
    torch.testing.assert_close(got, reference.dense_votes(u, weight))
    assert weight.shape == (7, 4, 5, 3)


@pytest.mark.parametrize("op", ATTENTION)
def test_impls_compute_the_op(op):
    """eager is the reference with the layer's arguments, capsroute the fused op on the same
    inputs; both reach every input's gradient."""
    case = tiny_case(op)
    inputs, grad = bench.make_inputs(op, case, torch.float64, CPU)
    iters = 3
    eager = bench.get_impl(case, "eager")(*inputs, iters)
    if op == "self_attention_routing":
        want = reference.self_attention_routing(inputs[0], coupling_bias=inputs[1])
    else:
        want = reference.inverted_attention_routing(
            inputs[0], iters, norm_weight=inputs[1], norm_bias=inputs[2]
        )
    torch.testing.assert_close(eager, want)
    assert not torch.allclose(want, getattr(reference, op)(inputs[0].detach()))  # params count
    got = bench.get_impl(case, "capsroute")(*inputs, iters)
    torch.testing.assert_close(got, eager)
    got.backward(grad)
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in inputs)


def test_floor_and_estimate():
    I, J, D, B = 24, 5, 8, 3
    votes = B * I * J * D * 4
    fm = bench.floor_model(tiny_case("self_attention_routing"), 4, 3)
    # sum of the votes for j (I J D adds), agreements and weighted sum (2 I J D each); no iters
    assert fm["flops_fwd"] == B * 5 * I * J * D
    assert fm["bytes_fwd"] == votes + I * J * 4 + B * J * D * 4
    assert fm == bench.floor_model(tiny_case("self_attention_routing"), 4, 1)
    fm = bench.floor_model(tiny_case("inverted_attention_routing"), 4, 3)
    assert fm["flops_fwd"] == B * 2 * I * J * D * 5  # 3 weighted sums, 2 agreements
    assert fm["bytes_fwd"] == votes + 2 * D * 4 + B * J * D * 4
    # the backward reads grad_v and the votes and parameters again, and writes their gradients
    inputs = votes + 2 * D * 4
    assert fm["bytes_fwd_bwd"] == 2 * fm["bytes_fwd"] + inputs
    assert fm["flops_fwd_bwd"] == 3 * fm["flops_fwd"]
    for op in ATTENTION:
        case = tiny_case(op)
        assert op_bench.estimated_bytes(case, "capsroute", 4) == 2 * votes + votes // 2
        assert op_bench.estimated_bytes(case, "eager", 4) == 2 * votes + 8 * votes


def test_tiny_attention_run(monkeypatch):
    """run_benchmarks on both attention routings at a tiny shape, without torch.compile: the
    records, the kernel paths, the checks against eager, the ratios."""
    monkeypatch.setattr(runner, "measure_bandwidth", lambda device: 10.0)
    monkeypatch.setattr(runner, "measure_peak_tflops", lambda device, dtype: 0.1)
    got = bench.make_cases(list(ATTENTION), [bench.parse_shape(TINY)], [2], "cpu")
    report = bench.run_benchmarks(
        got,
        ["capsroute", "eager"],
        device=CPU,
        iters=2,
        repeats=3,
        warmup=1,
        max_seconds=1.0,
        progress=False,
    )
    rows = [(r["op"], r["impl"]) for r in report["results"]]
    assert rows == [(op, impl) for op in ATTENTION for impl in ("capsroute", "eager")]
    for r in report["results"]:
        assert "skipped" not in r, r
        assert all(r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb", "floor_ms"))
        assert r["shape"] == {"B": 2, "I": 24, "J": 5, "D": 8}
        assert r["iters"] == (None if r["op"] == "self_attention_routing" else 2)
        if r["impl"] == "capsroute":
            assert r["max_rel_err"] < 1e-3
            assert r["kernel_paths"] == {r["op"]: {"forward": "cpu", "backward": "cpu"}}
            assert {"eager_fwd_bwd", "eager_peak_mb"} <= r["ratios"].keys()
        else:
            assert "kernel_paths" not in r
    assert "self_attention_routing" in bench.format_table(report)


def test_efficientcapsnet_model_op(monkeypatch):
    """`--op efficientcapsnet`: a training step of EfficientCapsNet (one routing step: --iters does
    not reach its constructor), fused and reference, the self-attention kernel paths recorded."""
    assert bench.op_name("efficientcapsnet") == "efficientcapsnet"
    assert "efficientcapsnet" in bench.MODEL_OPS
    model = bench.make_model("efficientcapsnet", iters=5)
    assert type(model).__name__ == "EfficientCapsNet" and model.training
    got = bench.make_cases(["efficientcapsnet"], None, [2], "cpu")
    assert [(c.op, c.shape_name, c.B) for c in got] == [("efficientcapsnet", "1x28x28", 2)]
    report = bench.run_benchmarks(
        got,
        ["capsroute", "eager"],
        device=CPU,
        repeats=2,
        warmup=1,
        max_seconds=1.0,
        progress=False,
    )
    caps, eager = report["results"]
    assert (caps["impl"], eager["impl"]) == ("capsroute", "eager")
    for r in (caps, eager):
        assert "skipped" not in r, r
        assert r["fwd_bwd_ms"] > 0 and r["params"] == sum(p.numel() for p in model.parameters())
    assert caps["max_rel_err"] < 1e-2
    paths = caps["kernel_paths"]["dense_self_attention_routing"]
    assert paths == {"forward": "cpu", "backward": "cpu"}
    assert "kernel_paths" not in eager


DENSE_ATTENTION = ("dense_self_attention_routing", "dense_inverted_attention_routing")


@pytest.mark.parametrize("dense,op", list(zip(DENSE_ATTENTION, ATTENTION)), ids=DENSE_ATTENTION)
def test_dense_forms_route_the_vote_input_ops_votes(dense, op):
    """The dense forms get the u and weight that the vote-input op's votes are made from, and the
    same parameters; each impl (eager: einsum votes, then the reference's routing) computes the op,
    a record per case with Din in its shape and the vote-input op's iterations rule."""
    dense_inputs, _ = bench.make_inputs(dense, tiny_case(dense), torch.float64, CPU)
    inputs, grad = bench.make_inputs(op, tiny_case(op), torch.float64, CPU)
    u, weight, *params = dense_inputs
    torch.testing.assert_close(reference.dense_votes(u, weight), inputs[0], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(params, inputs[1:]))
    # The want from the dense votes themselves: make_inputs draws float32 and casts, so its votes
    # and the dense ones differ by float32 rounding, which a LayerNorm over s can amplify.
    want = bench.get_impl(tiny_case(op), "eager")(reference.dense_votes(u, weight), *inputs[1:], 2)
    for impl in ("eager", "capsroute"):
        got = bench.get_impl(tiny_case(dense), impl)(*dense_inputs, 2)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert tiny_case(dense).shape() == {"B": 3, "I": 24, "J": 5, "D": 8, "Din": 4}
    assert [c.shape_name for c in bench.make_cases([dense], None, None, "cpu")] == [
        "efficientcapsnet",
        "mnist",
    ]


def test_dense_forms_floor_and_estimate():
    I, J, D, Din, B = 24, 5, 8, 4, 3
    dense_bytes = (B * I * Din + I * J * D * Din) * 4
    self_attention = bench.floor_model(tiny_case("dense_self_attention_routing"), 4, 3)
    assert self_attention["flops_fwd"] == B * (2 * I * J * D * Din + 5 * I * J * D)
    assert self_attention["bytes_fwd"] == dense_bytes + I * J * 4 + B * J * D * 4
    inverted = bench.floor_model(tiny_case("dense_inverted_attention_routing"), 4, 3)
    assert inverted["bytes_fwd"] == dense_bytes + 2 * D * 4 + B * J * D * 4
    for dense in DENSE_ATTENTION:
        case = tiny_case(dense)
        assert op_bench.estimated_bytes(case, "capsroute", 4) == 2 * dense_bytes + 6 * (
            I * J * D * Din * 4
        )
