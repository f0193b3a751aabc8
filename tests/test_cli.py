"""The `capsroute` command (capsroute/cli.py): a tiny CPU benchmark run, its JSON and figures, and `plot`."""
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from capsroute import bench, cli  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`capsroute bench` at two small shapes that differ only in I; the floor is not measured (slow)."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "measure_bandwidth", lambda device: 10.0)
        mp.setattr(bench, "measure_peak_tflops", lambda device, dtype: 0.1)
        status = cli.main(["bench", "--device", "cpu", "--op", "dynamic", "--shape", "64,5,8", "32,5,8",
                           "--batch", "2", "4", "--no-compile", "--repeats", "3", "--warmup", "1",
                           "--out", str(out), "--plot", "--no-progress"])
    return status, out


def test_bench_writes_json(run):
    status, out = run
    assert status == 0
    [path] = out.glob("*.json")
    report = json.loads(path.read_text())
    assert {"kind", "device", "torch", "commit", "date", "results"} <= report.keys()
    assert (report["kind"], report["device"], report["complete"]) == ("bench", "cpu", True)
    cases = {(r["shape"]["I"], r["shape"]["B"], r["impl"]) for r in report["results"]}
    assert cases == {(I, B, impl) for I in (32, 64) for B in (2, 4) for impl in ("capsroute", "eager")}
    for r in report["results"]:
        assert (r["op"], r["dtype"]) == ("dynamic_routing", "float32")
        assert r["shape"]["J"] == 5 and r["shape"]["D"] == 8
        assert all(r[k] > 0 for k in ("fwd_ms", "fwd_bwd_ms", "peak_mb", "floor_ms"))


def test_bench_plots(run):
    _, out = run
    stem = next(out.glob("*.json")).stem
    names = {p.name for p in out.glob("*.png")}
    assert names == {f"{stem}-dynamic_routing-I32-J5-D8.png", f"{stem}-dynamic_routing-I64-J5-D8.png",
                     f"{stem}-dynamic_routing-J5-D8-vs-I.png"}
    assert all((out / n).read_bytes().startswith(PNG) for n in names)


def test_plot_redraws(run, tmp_path, capsys):
    _, out = run
    path = next(out.glob("*.json"))
    assert cli.main(["plot", str(path), "--out", str(tmp_path)]) == 0
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in out.glob("*.png")}
    assert capsys.readouterr().out.count("wrote ") == 3


def test_bad_option(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--op", "nonsense"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --op: unknown op 'nonsense'" in err and "dynamic_routing (dynamic)" in err


def test_default_out(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(bench.__file__).parent)
    assert bench.default_out() == Path(bench.__file__).resolve().parent.parent / "bench" / "results"
    monkeypatch.chdir(tmp_path)
    assert bench.default_out() == Path("bench-results")
