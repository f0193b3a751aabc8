"""A run's report as people read it: the table printed at the end, and where its JSON goes."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from .._utils.runinfo import git_toplevel, short_commit
from .cases import MODEL_OPS


def default_out() -> Path:
    """bench/results/ of the capsroute checkout the current directory is in, else ./bench-results."""
    top = git_toplevel()
    if top is not None and (top / "capsroute" / "bench" / "__init__.py").is_file():
        return top / "bench" / "results"
    return Path("bench-results")


def _fmt(x, spec=".2f", none="-"):
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _fmt_ms(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _fmt_max_batch(r: dict) -> str:
    if "max_batch" not in r:
        return "-"
    if r["max_batch"] is None:
        return "none"
    return f"{r['max_batch']}" + ("+" if r.get("max_batch_capped") else "")


def _fmt_max_side(r: dict) -> str:
    if "max_side" not in r:
        return "-"
    return "none" if r["max_side"] is None else str(r["max_side"])


def format_table(report: dict) -> str:
    """One row per op / shape / B / impl. 'vs caps' columns: this impl's time or memory / capsroute's.
    Runs with model ops add an img/s column (images per second of a training step), runs with
    --max-batch a max B column ('+': every batch up to the cap fitted) and, for conv ops, a max side
    column (the largest square input side at B = 1), CUDA runs a host ms column (the forward+backward
    time the GPU was not busy). Where a CUDA kernel path ran, a line per
    capsroute row says which (forward / backward), after the table."""
    results = report["results"]
    models = any(r["op"] in MODEL_OPS for r in results)
    max_batch = any("max_batch" in r for r in results)
    max_side = any("max_side" in r for r in results)
    host = any("host_overhead_ms" in r for r in results)
    head = [
        "op",
        "shape",
        "B",
        "impl",
        "fwd ms",
        "f+b ms",
        "peak MiB",
        "floor ms",
        "x floor",
        "fwd vs caps",
        "f+b vs caps",
        "mem vs caps",
        "compile s",
        "rel err",
    ]
    head += (
        ["img/s"] * models + ["max B"] * max_batch + ["max side"] * max_side + ["host ms"] * host
    )
    rows = []
    for r in report["results"]:
        s = r["shape"]
        shape = (r.get("shape_name") or f"{s['I']},{s['J']},{s['D']}") + (
            f" {r['layout']}" if r.get("layout", "contiguous") != "contiguous" else ""
        )
        row = [r["op"], shape, str(s["B"]), r["impl"]]
        if "skipped" in r:
            rows.append(row + [f"skipped: {r['skipped']}"])
            continue
        vs = r.get("vs_capsroute", {})
        peak = r["peak_mb"]
        row += [
            _fmt_ms(r["fwd_ms"]),
            _fmt_ms(r["fwd_bwd_ms"]),
            _fmt(peak, ".3f" if peak is not None and peak < 1 else ".1f"),
            _fmt_ms(r["floor_ms"]),
            _fmt(r.get("floor_x"), ".1f"),
            *(
                _fmt(vs.get(k), ".2f") + ("x" if vs.get(k) is not None else "")
                for k in ("fwd", "fwd_bwd", "peak_mb")
            ),
            _fmt(r.get("compile_s"), ".1f"),
            _fmt(r.get("max_rel_err"), ".0e"),
        ]
        if models:
            ips = r.get("images_per_s")
            row.append(_fmt(ips, ".1f" if ips is not None and ips < 100 else ".0f"))
        if max_batch:
            row.append(_fmt_max_batch(r))
        if max_side:
            row.append(_fmt_max_side(r))
        if host:
            row.append(_fmt_ms(r.get("host_overhead_ms")))
        rows.append(row)
    # skipped rows (4 cells + the reason) size only the first 4 columns
    widths = [
        max([len(head[k])] + [len(row[k]) for row in rows if k < 4 or len(row) == len(head)])
        for k in range(len(head))
    ]
    right = set(range(2, len(head)))

    def line(cells):
        out = []
        for k, c in enumerate(cells):
            if len(cells) != len(head) and k == len(cells) - 1 and k >= 4:
                out.append(c)
            else:
                out.append(c.rjust(widths[k]) if k in right else c.ljust(widths[k]))
        return "  ".join(out).rstrip()

    title = (
        f"device {report['device']}  torch {report['torch']}  commit {report['commit'][:12]}  "
        f"dtype {report['dtype']}  iters {report['iters']}  threads {report['threads']}"
        + (
            f"  load {report['loadavg_start']:.1f}"
            if report.get("loadavg_start") is not None
            else ""
        )
    )
    if report.get("bandwidth_gbs") is not None:
        title += (
            f"\nfloor: copy bandwidth {report['bandwidth_gbs']:.1f} GB/s, matmul peak "
            f"{report['peak_tflops']:.2f} TFLOP/s; floor ms and x floor are for forward+backward"
        )
    if models:
        title += (
            f"\nmodel ops ({', '.join(MODEL_OPS)}): f+b ms is a whole training step (forward, loss, backward, "
            "Adam step), img/s = B / f+b; no floor; rel err compares losses and gradients with eager"
        )
    sep = "  ".join("-" * w for w in widths)
    return "\n".join(
        [title, line(head), sep] + [line(r) for r in rows] + kernel_path_lines(results)
    )


def kernel_path_lines(results: list[dict]) -> list[str]:
    """'kernel paths of <row>: <op> <forward> / <backward>' for every row whose capsroute ops ran
    a path other than the CPU's (the record's kernel_paths)."""
    lines = []
    for r in results:
        paths = r.get("kernel_paths", {})
        if all(p == "cpu" for ran in paths.values() for p in ran.values()):
            continue
        ran = ", ".join(
            f"{op} {p['forward'] or '-'} / {p['backward'] or '-'}" for op, p in paths.items()
        )
        row = f"{r['op']} {r.get('shape_name', '')} B={r['shape']['B']} {r['impl']}"
        lines.append(f"kernel paths of {row}: {ran}")
    return lines


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def report_path(report: dict, out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.suffix == ".json":
        return out
    return out / f"{slug(report['device'])}-{report['date']}-{short_commit(report['commit'])}.json"


def unique_path(path: Path) -> Path:
    if not path.exists():
        return path
    for k in range(1, 1000):
        p = path.with_name(f"{path.stem}-{k}{path.suffix}")
        if not p.exists():
            return p
    return path
