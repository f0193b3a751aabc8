"""The `capsroute` command (capsroute/cli.py): a tiny CPU benchmark run, its JSON and figures, and `plot`."""

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

import capsroute  # noqa: E402
from capsroute import bench, cli  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`capsroute bench` at two small shapes that differ only in I; the floor is not measured (slow)."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench.runner, "measure_bandwidth", lambda device: 10.0)
        mp.setattr(bench.runner, "measure_peak_tflops", lambda device, dtype: 0.1)
        status = cli.main(
            [
                "bench",
                "--device",
                "cpu",
                "--op",
                "dynamic",
                "--shape",
                "64,5,8",
                "32,5,8",
                "--batch",
                "2",
                "4",
                "--no-compile",
                "--repeats",
                "3",
                "--warmup",
                "1",
                "--out",
                str(out),
                "--plot",
                "--no-progress",
            ]
        )
    return status, out


def test_bench_writes_json(run):
    status, out = run
    assert status == 0
    [path] = out.glob("*.json")
    report = json.loads(path.read_text())
    assert {"kind", "device", "torch", "commit", "date", "results"} <= report.keys()
    assert (report["kind"], report["device"], report["complete"]) == ("bench", "cpu", True)
    # Every CAPSROUTE_* switch of the run, so that records of different paths compare.
    assert report["env"] == {k: v for k, v in os.environ.items() if k.startswith("CAPSROUTE_")}
    cases = {(r["shape"]["I"], r["shape"]["B"], r["impl"]) for r in report["results"]}
    assert cases == {
        (I, B, impl) for I in (32, 64) for B in (2, 4) for impl in ("capsroute", "eager")
    }
    for r in report["results"]:
        assert (r["op"], r["dtype"]) == ("dynamic_routing", "float32")
        assert r["shape"]["J"] == 5 and r["shape"]["D"] == 8
        assert all(r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb", "floor_ms"))
        assert r["faults_per_call"] >= 0


def test_bench_plots(run):
    _, out = run
    stem = next(out.glob("*.json")).stem
    names = {p.name for p in out.glob("*.png")}
    assert names == {
        f"{stem}-dynamic_routing-I32-J5-D8.png",
        f"{stem}-dynamic_routing-I64-J5-D8.png",
        f"{stem}-dynamic_routing-J5-D8-vs-I.png",
    }
    assert all((out / n).read_bytes().startswith(PNG) for n in names)


def test_plot_redraws(run, tmp_path, capsys):
    _, out = run
    path = next(out.glob("*.json"))
    assert cli.main(["plot", str(path), "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in out.glob("*.png")}
    assert capsys.readouterr().out.count("wrote ") == 3


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"capsroute {capsroute.__version__}\n"


def test_bad_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--op", "nonsense"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --op: unknown op 'nonsense'" in err and "dynamic_routing (dynamic)" in err
    assert "capsnet" in err and "matrixcapsnet" in err


def test_default_out(tmp_path, monkeypatch):
    root = Path(bench.__file__).resolve().parents[2]  # capsroute/bench/__init__.py -> the checkout
    monkeypatch.chdir(root / "capsroute" / "bench")
    assert bench.default_out() == root / "bench" / "results"
    monkeypatch.chdir(tmp_path)
    assert bench.default_out() == Path("bench-results")


# ----------------------------------------------------------------------------- model ops: a whole training step

MODEL_IMPLS = ("capsroute", "eager", "compiled")


@pytest.fixture(scope="module", params=["capsnet", "matrixcapsnet"])
def model_run(request, tmp_path_factory):
    """`capsroute bench --op <model>` with the three impls at B=2 (one compile: about 15 s for CapsNet and
    30 s for MatrixCapsNet on the 2-core build machine); --max-batch on the CPU only leaves a note."""
    import contextlib
    import io

    op = request.param
    out = tmp_path_factory.mktemp(f"bench-{op}")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = cli.main(
            [
                "bench",
                "--device",
                "cpu",
                "--op",
                op,
                "--batch",
                "2",
                "--repeats",
                "1",
                "--warmup",
                "1",
                "--max-seconds",
                "1",
                "--max-batch",
                "--out",
                str(out),
                "--plot",
                "--no-progress",
            ]
        )
    return op, status, out, stdout.getvalue()


@pytest.mark.slow  # model_run compiles both models: a minute or more
def test_model_bench_writes_json(model_run):
    op, status, out, _ = model_run
    assert status == 0
    [path] = out.glob("*.json")
    report = json.loads(path.read_text())
    assert (
        report["complete"] and report["bandwidth_gbs"] is None
    )  # no floor for model ops: not measured
    records = {r["impl"]: r for r in report["results"]}
    assert set(records) == set(MODEL_IMPLS) and len(report["results"]) == 3
    crash = bench.compile_crash(
        op, torch.device("cpu")
    )  # torch < 2.14: the compiled impl is skipped
    if crash is not None:
        assert records.pop("compiled")["skipped"] == crash
    for impl, r in records.items():
        assert "skipped" not in r, r
        assert (r["op"], r["shape"], r["dtype"], r["shape_name"]) == (
            op,
            {"B": 2, "model": op},
            "float32",
            "1x28x28",
        )
        assert r["floor_ms"] is None and r["floor_x"] is None
        assert all(
            r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb", "images_per_s", "state_mb")
        )
        assert r["images_per_s"] == pytest.approx(2 / (r["fwd_bwd_ms"] / 1e3))
        assert r["params"] == sum(p.numel() for p in bench.make_model(op).parameters())
        assert (
            len(r["losses"]) == 2 and r["losses"][1] < r["losses"][0]
        )  # one Adam step lowers the loss
        assert "max_batch" not in r  # CPU: not searched
    # same weights and inputs: the fused model and the compiled reference model agree with eager
    for impl in {"capsroute", "compiled"} & set(records):
        r = records[impl]
        # the loss after the Adam step is sensitive (Adam's first step moves every weight by +-lr, by the
        # sign of its gradient): the compiled MatrixCapsNet's differs by ~3e-3 of itself at B=2
        assert r["losses"][0] == pytest.approx(records["eager"]["losses"][0], rel=1e-4)
        assert r["losses"][1] == pytest.approx(records["eager"]["losses"][1], rel=1e-2)
        assert r["max_rel_err"] < 1e-2 and r["loss_rel_err"] < 5e-3
    for impl in {"eager", "compiled"} & set(records):
        vs = records[impl]["vs_capsroute"]
        assert vs["fwd_bwd"] == pytest.approx(
            records[impl]["fwd_bwd_ms"] / records["capsroute"]["fwd_bwd_ms"]
        )
        assert vs["peak_mb"] == pytest.approx(
            records[impl]["peak_mb"] / records["capsroute"]["peak_mb"]
        )
    if "compiled" in records:
        assert (records["compiled"]["graphs"], records["compiled"]["graph_breaks"]) == (
            1,
            0,
        )  # the whole model
    assert any("--max-batch of the model ops is CUDA-only" in n for n in report["notes"])


@pytest.mark.slow  # model_run compiles both models: a minute or more
def test_model_bench_table_and_plot(model_run):
    op, _, out, stdout = model_run
    assert "--max-batch of the model ops is CUDA-only" in stdout
    head = next(line for line in stdout.splitlines() if line.startswith("op "))
    assert head.split()[-1] == "img/s" and "max B" not in head
    rows = [line.split() for line in stdout.splitlines() if line.startswith(op + " ")]
    assert [row[3] for row in rows] == list(MODEL_IMPLS) and all(
        row[1:3] == ["1x28x28", "2"] for row in rows
    )
    stem = next(out.glob("*.json")).stem
    assert {p.name for p in out.glob("*.png")} == {f"{stem}-{op}-model{op}.png"}


def test_model_op_names():
    assert [bench.op_name(n) for n in ("capsnet", "matrixcapsnet", "dense")] == [
        "capsnet",
        "matrixcapsnet",
        "dense_capsules",
    ]
    cases = bench.make_cases(["capsnet", "dynamic_routing"], None, None, "cuda")
    assert [(c.op, c.B) for c in cases if c.op == "capsnet"] == [
        ("capsnet", 32),
        ("capsnet", 128),
        ("capsnet", 512),
    ]
    assert [c.B for c in bench.make_cases(["matrixcapsnet"], None, None, "cpu")] == [16]
    assert bench.make_cases(["capsnet"], None, [4], "cpu")[0].shape() == {
        "B": 4,
        "model": "capsnet",
    }


def test_model_cpu_memory_guard(monkeypatch):
    monkeypatch.setattr(bench.measure, "available_bytes", lambda device: 2**20)
    notes = []
    recs = bench.bench_model_case(
        bench.Case("matrixcapsnet", "1x28x28", 2, 0, 0, 0, 0),
        ["capsroute", "eager"],
        dtype=torch.float32,
        iters=3,
        device=torch.device("cpu"),
        repeats=1,
        warmup=1,
        max_seconds=1.0,
        inference=False,
        note=notes.append,
    )
    assert [r["impl"] for r in recs] == ["capsroute", "eager"]
    assert all(r["skipped"].startswith("estimated") for r in recs) and len(notes) == 2


def test_model_bench_skips_a_compile_known_to_crash(monkeypatch):
    """torch 2.11-2.13 crash the process compiling the MatrixCapsNet step on the CPU: that impl is
    skipped with the reason, the others still run (the check itself is version-based)."""
    cpu = torch.device("cpu")
    assert bench.compile_crash("matrixcapsnet", cpu, "2.14.1+cu130") is None
    assert bench.compile_crash("matrixcapsnet", torch.device("cuda"), "2.11.0") is None
    assert bench.compile_crash("capsnet", cpu, "2.11.0") is None
    assert "2.13.0" in bench.compile_crash("matrixcapsnet", cpu, "2.13.0")
    monkeypatch.setattr(bench.model_bench, "compile_crash", lambda op, device: "crashes here")
    recs = bench.bench_model_case(
        bench.Case("matrixcapsnet", "1x28x28", 2, 0, 0, 0, 0),
        ["eager", "compiled"],
        dtype=torch.float32,
        iters=3,
        device=cpu,
        repeats=1,
        warmup=1,
        max_seconds=1.0,
        inference=False,
        note=lambda line: None,
    )
    assert [r["impl"] for r in recs] == ["eager", "compiled"]
    assert "skipped" not in recs[0] and recs[1]["skipped"] == "crashes here"


# ----------------------------------------------------------------------------- --max-batch search


def _oom_above(limit, calls):
    def step(b):
        calls.append(b)
        if b > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} GiB")

    return step


@pytest.mark.parametrize(
    "limit, cap, best, tries",
    [
        (0, 2**15, None, [1]),  # nothing fits
        (1, 2**15, 1, [1, 2]),
        (100, 2**15, 64, [1, 2, 4, 8, 16, 32, 64, 128]),
        (4096, 2**15, 4096, [2**k for k in range(14)]),
        (10**9, 2**15, 2**15, [2**k for k in range(16)]),  # everything up to the cap fits
        (10**9, 100, 64, [1, 2, 4, 8, 16, 32, 64]),  # a cap that is not a power of two
    ],
)
def test_find_max_batch(limit, cap, best, tries):
    calls, freed = [], []
    found, log = bench.find_max_batch(
        _oom_above(limit, calls), cap, free=lambda: freed.append(len(calls))
    )
    assert found == best
    assert calls == tries and [b for b, _ in log] == tries
    assert [ok for _, ok in log] == [b <= limit for b in tries]
    assert freed == list(range(1, len(tries) + 1))  # memory freed after every try, OOM or not


def test_find_max_batch_other_errors_propagate():
    def step(b):
        if b == 4:
            raise ValueError("a bug, not an OOM")

    with pytest.raises(ValueError, match="a bug"):
        bench.find_max_batch(step, 64)
    # the other ways out-of-memory shows up count as OOM too
    for err in (
        MemoryError(),
        RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"),
    ):

        def step(b, err=err):
            if b > 8:
                raise err

        assert bench.find_max_batch(step, 64)[0] == 8


def test_model_max_batch(monkeypatch):
    """model_max_batch on the CPU with a training step that 'runs out of memory' above B=4: the real
    model, inputs and optimizer, only the OOM is fake (the search itself is CUDA-only in `capsroute bench`)."""
    real = bench.train_step
    sizes = []

    def fake_train_step(fn, optimizer, images, labels, device, amp=None):
        step = real(fn, optimizer, images, labels, device, amp)

        def wrapped():
            sizes.append(images.shape[0])
            if images.shape[0] > 4:
                raise torch.OutOfMemoryError("CUDA out of memory (fake)")
            return step()

        return wrapped

    monkeypatch.setattr(bench.model_bench, "train_step", fake_train_step)
    cpu = torch.device("cpu")
    found = bench.model_max_batch(
        "matrixcapsnet", "capsroute", device=cpu, dtype=torch.float32, cap=64
    )
    assert (found["max_batch"], found["capped"], found["tries"]) == (4, False, [1, 2, 4, 8])
    assert sizes == [1, 2, 4, 8]
    found = bench.model_max_batch(
        "matrixcapsnet", "capsroute", device=cpu, dtype=torch.float32, cap=2
    )
    assert (found["max_batch"], found["capped"]) == (2, True)


# What format_table reads of a run besides its results.
FAKE_RUN = {
    "device": "fake",
    "torch": "x",
    "commit": "0" * 40,
    "dtype": "float32",
    "iters": 3,
    "threads": 1,
}


def test_max_batch_in_report_and_table(monkeypatch):
    monkeypatch.setattr(
        bench.runner,
        "model_max_batch",
        lambda op, impl, *, cap, **kw: {
            "op": op,
            "impl": impl,
            "max_batch": {"capsroute": 4096, "eager": 512}.get(impl),
            "cap": cap,
            "capped": False,
        },
    )
    report = {
        **FAKE_RUN,
        "bandwidth_gbs": None,
        "results": [
            {
                "op": "capsnet",
                "shape": {"B": b, "model": "capsnet"},
                "shape_name": "1x28x28",
                "impl": impl,
                "fwd_ms": 1.0,
                "fwd_bwd_ms": 2.0,
                "peak_mb": 3.0,
                "floor_ms": None,
                "images_per_s": b / 2e-3,
            }
            for b in (32, 128)
            for impl in ("capsroute", "eager", "compiled")
        ],
    }
    bench.add_max_batches(
        report,
        [bench.Case("capsnet", "1x28x28", 32)],
        ["capsroute", "eager", "compiled"],
        device=torch.device("cpu"),
        dtype=torch.float32,
        iters=3,
        seed=0,
        cap=2**15,
        note=lambda msg: None,
    )
    assert [(m["impl"], m["max_batch"]) for m in report["max_batch"]] == [
        ("capsroute", 4096),
        ("eager", 512),
        ("compiled", None),
    ]
    assert [r["max_batch"] for r in report["results"]] == [4096, 512, None] * 2
    table = bench.format_table(report).splitlines()
    assert table[2].endswith("img/s  max B")
    assert [line.split()[-1] for line in table[4:]] == ["4096", "512", "none"] * 2


def test_cuda_rows_print_the_host_overhead():
    """A CUDA run's table has a host ms column: the forward+backward time the GPU was not busy."""
    row = {
        "op": "dynamic_routing",
        "shape": {"B": 32, "I": 1152, "J": 10, "D": 16},
        "shape_name": "mnist",
        "impl": "capsroute",
        "fwd_ms": 0.2,
        "fwd_bwd_ms": 0.43,
        "peak_mb": 30.0,
        "floor_ms": 0.02,
    }
    report = {**FAKE_RUN, "results": [row]}
    assert "host ms" not in bench.format_table(report)
    row.update(gpu_busy_ms=0.18, host_overhead_ms=0.25)
    table = bench.format_table(report).splitlines()
    assert table[1].endswith("host ms") and table[3].endswith("0.250")


def test_train_takes_efficientcapsnet(capsys):
    """`capsroute train --model efficientcapsnet` is offered with its recipe's options."""
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "efficientcapsnet" in text and "--augment {shift,efficientcapsnet}" in text
    assert "--min-lr" in text and "EfficientCapsNet trains by its paper's recipe" in text
