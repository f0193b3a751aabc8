"""pytest-benchmark cases for regression tracking: `pytest bench/ --benchmark-only`.

Forward+backward of capsroute and of the eager PyTorch reference, the eight routing ops of
`capsroute bench`, at a small MNIST-like shape (B=8, I=1152, J=10, D=16, Din=8), on CPU and, when
one is present, on CUDA. Not part of the test suite (tests/ is): kept light on purpose. For the
full comparison (torch.compile baseline, memory, floor) use `capsroute bench`.

Compare runs with e.g. `pytest bench/ --benchmark-only --benchmark-autosave` and
`pytest-benchmark compare`.
"""

import pytest
import torch

pytest.importorskip("pytest_benchmark")
rb = pytest.importorskip("capsroute.bench")

CASE = dict(shape_name="mnist-b8", B=8, I=1152, J=10, D=16, Din=8)
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["capsroute", "eager"])
@pytest.mark.parametrize("op", rb.OPS)
def test_fwd_bwd(benchmark, op, impl, device):
    device = torch.device(device)
    if impl == "capsroute" and not rb.capsroute_supports(op, device):
        pytest.skip(f"capsroute has no {device.type} kernel for {op} in this build")
    case = rb.Case(op=op, **CASE)
    inputs, grad = rb.make_inputs(op, case, torch.float32, device, seed=0)
    step = rb.fwd_bwd_step(rb.get_impl(case, impl), inputs, grad, iters=3)

    def run():
        rb.clear_grads(inputs)
        step()
        rb.synchronize(device)

    benchmark.group = f"{op} fwd+bwd {device.type} B={case.B}"
    benchmark.extra_info.update(
        shape=case.shape(),
        dtype="float32",
        iters=3,
        impl=impl,
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    run()  # warm-up outside the measurement
    benchmark.pedantic(
        run, rounds=10 if device.type == "cpu" else 50, warmup_rounds=1, iterations=1
    )
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in inputs)
