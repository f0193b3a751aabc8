"""Figures of a `capsroute bench` report, as PNG files next to its JSON (matplotlib, Agg).

One figure per op and shape: forward+backward time and peak memory vs batch size, one line per
implementation, log-log. For each op, shapes that differ only in I also get a figure vs I (one
line per implementation and batch size).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, NullLocator

from .._utils.runinfo import short_commit

COLORS = {"capsroute": "tab:blue", "eager": "tab:orange", "compiled": "tab:green"}
LINESTYLES = ["-", "--", ":", "-."]


class _PlainLogFormatter(LogFormatter):
    """Log-axis labels as plain numbers (0.03, 40), on the ticks LogFormatter chooses to label."""

    def _num_to_string(self, x, vmin, vmax):
        return f"{x:g}"


def _dims(shape: dict, *leave_out: str) -> str:
    return " ".join(f"{k}={v}" for k, v in shape.items() if k not in leave_out)


def _figure(path: Path, title: str, xlabel: str, lines: dict) -> Path:
    """lines: label -> (impl, linestyle, [(x, fwd_bwd_ms, peak_mb)]). Two log-log panels: time, memory."""
    fig = Figure(figsize=(11, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2)
    xs = sorted({x for _, _, points in lines.values() for x, _, _ in points})
    for label, (impl, style, points) in lines.items():
        x, ms, mb = zip(*sorted(points))
        axes[0].plot(x, ms, style, color=COLORS.get(impl), marker="o", label=label)
        axes[1].plot(x, mb, style, color=COLORS.get(impl), marker="o")
    for ax, ylabel in zip(
        axes, ("forward+backward ms (median)", "peak memory of forward+backward, MiB")
    ):
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(_PlainLogFormatter())
        ax.yaxis.set_minor_formatter(_PlainLogFormatter())
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return path


def plot_report(
    report: dict, json_path: str | Path, out_dir: str | Path | None = None
) -> list[Path]:
    """Draws the report's figures as <json stem>-<op>-<shape>.png in out_dir (default: the JSON's
    directory); returns their paths."""
    json_path = Path(json_path)
    out_dir = Path(out_dir) if out_dir is not None else json_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    about = (
        f"{report['device']}, {report['dtype']}, torch {report['torch']}, "
        f"commit {short_commit(report['commit'])}"
        + ("" if report.get("complete", True) else " (incomplete run)")
    )

    by_batch = defaultdict(lambda: defaultdict(list))  # (op, shape without B) -> impl -> points
    by_inputs = defaultdict(
        lambda: defaultdict(list)
    )  # (op, shape without B and I) -> (impl, B) -> points
    for r in report["results"]:
        if "skipped" in r:
            continue
        shape = r["shape"]
        point = (r["fwd_bwd_ms"], r["peak_mb"])
        by_batch[r["op"], _dims(shape, "B")][r["impl"], r.get("layout", "contiguous")].append(
            (shape["B"], *point)
        )
        # (model ops (capsnet, matrixcapsnet) have no I; the other layouts have figures by batch only)
        if "I" in shape and r.get("layout", "contiguous") == "contiguous":
            by_inputs[r["op"], _dims(shape, "B", "I")][r["impl"], shape["B"]].append(
                (shape["I"], *point)
            )

    paths = []
    for (op, dims), impls in by_batch.items():
        lines = {
            impl if layout == "contiguous" else f"{impl} ({layout})": (
                impl,
                "-" if layout == "contiguous" else "--",
                points,
            )
            for (impl, layout), points in impls.items()
        }
        name = f"{json_path.stem}-{op}-{dims.replace('=', '').replace(' ', '-')}.png"
        paths.append(_figure(out_dir / name, f"{op}, {dims}\n{about}", "batch size B", lines))
    for (op, dims), series in by_inputs.items():
        if len({x for points in series.values() for x, _, _ in points}) < 2:
            continue
        batches = sorted({b for _, b in series})
        lines = {
            f"{impl} B={b}": (impl, LINESTYLES[batches.index(b) % len(LINESTYLES)], points)
            for (impl, b), points in series.items()
        }
        name = f"{json_path.stem}-{op}-{dims.replace('=', '').replace(' ', '-')}-vs-I.png"
        paths.append(
            _figure(out_dir / name, f"{op}, {dims}, I varies\n{about}", "input capsules I", lines)
        )
    return paths
