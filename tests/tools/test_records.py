"""bench/RESULTS.md is what capsroute.bench.records makes of bench/results/: up to date, every record
in it current or superseded, the manifest naming only records that exist, and a table's cells the
values of its JSON. Reads files only: nothing is measured."""

import ast
import json

import pytest

from capsroute.bench import floor, records
from capsroute.bench.cases import DTYPES

RESULTS = records.RESULTS
MANIFEST = json.loads((records.RESULTS / records.MANIFEST).read_text())


@pytest.fixture(scope="module")
def rendered() -> str:
    return records.render()


def test_results_md_is_up_to_date(rendered):
    assert records.OUT.read_text() == rendered, (
        "bench/RESULTS.md is out of date: run `python -m capsroute.bench.records`"
    )


def test_check_exits_1_on_a_stale_file(tmp_path, monkeypatch, rendered, capsys):
    monkeypatch.setattr(records, "render", lambda: rendered)
    monkeypatch.setattr(records, "OUT", tmp_path / "RESULTS.md")
    assert records.main(["--check"]) == 1  # no file
    records.OUT.write_text(rendered + "a hand-written line\n")
    assert records.main(["--check"]) == 1
    assert capsys.readouterr().out.count("\n") == 2  # one line each time
    assert records.main([]) == 0 and records.OUT.read_text() == rendered
    assert records.main(["--check"]) == 0


def test_every_record_is_current_or_superseded(rendered):
    current = records.current(MANIFEST)
    superseded = rendered.split("\n## Superseded records\n")[1]
    listed = {
        line.split("](")[0][3:].rstrip("/")
        for line in superseded.splitlines()
        if line.startswith("| [")
    }
    units = set(records.units(records.RESULTS))
    assert listed == units - current
    assert current <= units
    assert set(MANIFEST["superseded"]) <= units - current, (
        "the superseded map names a current record"
    )


def test_the_manifest_names_only_records_that_exist():
    paths = records.named_paths(MANIFEST)
    assert paths and len(paths) == len(set(paths))
    assert not [p for p in paths if not (records.RESULTS / p).exists()]
    for section in MANIFEST["sections"]:
        for entry in section["records"]:
            assert set(entry) <= {"record", "baselines", "note"}
            assert "\n" not in entry.get("note", ""), "a note is one line"


def test_the_generator_imports_no_torch():
    """Beyond the package it lives in, records.py needs the standard library, report's formatters
    and the floor model."""
    tree = ast.parse(records.__loader__.get_source(records.__name__))
    imported = {
        a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= {
        "argparse",
        "functools",
        "json",
        "re",
        "sys",
        "collections",
        "pathlib",
        "__future__",
        "report",
        "floor",
    }


def _row(rendered: str, start: str) -> list[str]:
    line = next(line for line in rendered.splitlines() if line.startswith(start))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_a_table_renders_the_json(tmp_path):
    results = tmp_path / "results"
    (results / "train-run").mkdir(parents=True)
    shape = {"B": 8, "I": 1152, "J": 10, "D": 16}
    caps = {"op": "dynamic_routing", "shape": shape, "shape_name": "mnist", "impl": "capsroute"}
    record = {
        "kind": "bench",
        "device": "cpu",
        "cpu": "Some CPU",
        "cpu_id": "family 6 model 1",
        "cpu_capability": "AVX2",
        "capsroute": {"cpu_arch": "x86-64-v3"},
        "torch": "2.14.1",
        "commit": "0123456789abcdef",
        "date": "2026-01-02",
        "iters": 3,
        "threads": 2,
        "loadavg_start": 0.5,
        "command": "capsroute bench --device cpu --op dynamic dense",
        "notes": [
            "WARNING dynamic_routing mnist B=8 compiled: differs from eager by 2.00e-02 (relative)"
        ],
        "results": [
            {
                **caps,
                "fwd_bwd_ms": 0.6463800018536858,
                "peak_mb": 6.0162353515625,
                "floor_x": 3.2483667931236435,
                "ratios": {
                    "eager_fwd_bwd": 14.2038,
                    "compiled_fwd_bwd": 3.2861,
                    "eager_peak_mb": 5.0324,
                },
            },
            {**caps, "impl": "eager", "fwd_bwd_ms": 9.18, "peak_mb": 30.3},
            {**caps, "impl": "compiled", "fwd_bwd_ms": 2.12, "max_rel_err": 0.02},
            # older records: no ratios, no floor; a ratio from the rows, a missing impl as "-"
            {
                "op": "dense_capsules",
                "shape": {**shape, "Din": 8},
                "impl": "capsroute",
                "layout": "einsum",
                "fwd_bwd_ms": 12.5,
                "peak_mb": 0.5,
            },
            {
                "op": "dense_capsules",
                "shape": {**shape, "Din": 8},
                "impl": "eager",
                "layout": "einsum",
                "fwd_bwd_ms": 25.0,
            },
        ],
    }
    (results / "cpu-new.json").write_text(json.dumps(record))
    (results / "cpu-old.json").write_text(
        json.dumps({**record, "commit": "abcdef0123", "loadavg_start": 741.2})
    )
    run = {
        "kind": "train",
        "model": "capsnet",
        "dataset": "mnist",
        "device": "cpu",
        "epochs": 3,
        "test_accuracy": 0.9919,
        "commit": "e6c460f0491f",
    }
    (results / "train-run" / "result.json").write_text(json.dumps(run))
    manifest = {
        "sections": [
            {
                "title": "Routing ops",
                "records": [{"record": "cpu-new.json", "note": "what it shows"}],
            },
            {"title": "Training runs", "records": [{"record": "train-run", "note": "a run"}]},
        ],
        "superseded": {"cpu-old.json": "under load"},
    }
    (results / records.MANIFEST).write_text(json.dumps(manifest))
    text = records.render(results)

    assert "\n### Some CPU (family 6 model 1, AVX2), capsroute built for x86-64-v3\n" in text
    assert "\n[cpu-new.json](results/cpu-new.json): what it shows\n" in text
    assert (
        "\nCommit `0123456`, 2026-01-02; `capsroute bench --device cpu --op dynamic dense`; 2 threads,"
        " load average 0.5 at the start, torch 2.14.1.\n" in text
    )
    header = _row(text, "| op |")
    assert header[3:8] == [
        "capsroute f+b ms",
        "x floor",
        "capsroute peak MiB",
        "eager / capsroute",
        "compiled / capsroute",
    ]
    assert _row(text, "| `dynamic_routing` |") == [
        "`dynamic_routing`", "mnist", "8", "0.646", "3.2", "6.0", "14.20x",
        "3.29x (differs from eager by 2.0e-02)", "5.03x", "-",
    ]  # fmt: skip
    assert _row(text, "| `dense_capsules` |") == [
        "`dense_capsules`", "1152,10,16,8 einsum", "8", "12.50", "-", "0.500", "2.00x", "-", "-", "-",
    ]  # fmt: skip
    assert _row(text, "| [train-run/]") == [
        "[train-run/](results/train-run/)", "a run", "capsnet", "mnist", "cpu", "3", "-", "99.19%",
        "-", "-", "`e6c460f`", "-",
    ]  # fmt: skip
    assert _row(text, "| [cpu-old.json]") == [
        "[cpu-old.json](results/cpu-old.json)",
        "Some CPU (family 6 model 1, AVX2), capsroute built for x86-64-v3, 2 threads",
        "2026-01-02", "`abcdef0`", "741.2", "under load",
    ]  # fmt: skip
    assert "cpu-new.json](" not in text.split("## Superseded records")[1]
    with pytest.raises(FileNotFoundError, match="gone.json"):
        records.render(
            results, {"sections": [{"title": "x", "records": [{"record": "gone.json"}]}]}
        )


def test_rows_floors_are_recomputed_by_todays_model():
    """Each committed row rebuilds into the case it was measured on (its forward bytes and flops
    as recorded), and its table floor counts the inputs' second read."""
    rows = 0
    for path in sorted(RESULTS.rglob("*.json")):
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            continue
        for row in record.get("results") or []:
            if row.get("floor_ms") is None or "shape_name" not in row:
                continue
            fm = floor.floor_model(
                floor.case_of_row(row), DTYPES[row["dtype"]].itemsize, row["iters"] or 1
            )
            assert (fm["bytes_fwd"], fm["flops_fwd"]) == (row["bytes_fwd"], row["flops_fwd"]), path
            recomputed = floor.row_floor_ms(row, record)
            assert recomputed >= row["floor_ms"] * (1 - 1e-9), path
            rows += 1
    assert rows > 100
