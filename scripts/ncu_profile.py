"""Hardware counters of capsroute's CUDA kernels: a workload for Nsight Compute, and its summary.

  ncu --clock-control none --profile-from-start off --set full --export REPORT \
      python scripts/ncu_profile.py run [CASE ...]
  ncu --import REPORT.ncu-rep --page raw --csv > RAW.csv
  python scripts/ncu_profile.py summary RAW.csv [--cases LOG]

`run` makes each case's inputs as the benchmark does, warms it with two forward+backward steps,
then profiles one more between cudaProfilerStart and Stop, a spin kernel first: the spin kernels
divide ncu's list of kernels into the cases, in the order given. A case is `op|shape|B`, or
`op|shape|B|NAME=VALUE,...` to run it under kernel switches (for example CAPSROUTE_EM_LANES=capsule).
`summary` prints a markdown table per case (the case names from `run`'s output, --cases) of each
capsroute kernel and cuBLAS GEMM: time, DRAM bytes, throughputs, occupancy, warp instructions,
sectors per global request and the largest stall reasons per issued instruction."""

import argparse
import csv
import os
import sys

# The kernels the GPU records name (docs/kernels.md, "CUDA, measured"), the ones docs/kernels.md
# has no counters for first (a time limit cuts the end of the list): the cluster kernels on 4 KB
# elements (conv, I = 8), the block kernels under the attention rules, EM on capsule lanes.
CASES = [
    "conv_dynamic_routing|32x32:8,8,16,16,5,1,2|1",
    "self_attention_routing|mnist|512",
    "dense_inverted_attention_routing|mnist|512",
    "em_routing|em-conv|2304|CAPSROUTE_EM_LANES=capsule",
    "em_routing|em-class|256",
    "dynamic_routing|mnist|32",
    "dynamic_routing|mnist|512",
    "em_routing|em-conv|2304",
    "dense_capsules|mnist|512",
]
CASE_PREFIX = "ncu case: "
SPIN_KERNEL = "spin_kernel"
BYTES = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
COLUMNS = (  # (heading, metric)
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warps %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
)
STALL, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def parse_case(spec: str):
    op, shape, batch, *switches = spec.split("|")
    env = [kv.split("=", 1) for kv in switches[0].split(",")] if switches else []
    return op, shape, int(batch), env


def run(cases) -> int:
    import torch

    import capsroute
    from capsroute.bench.cases import get_impl, make_cases, make_inputs, parse_shape
    from capsroute.bench.timing import clear_grads, fwd_bwd_step

    if not torch.cuda.is_available():
        sys.exit("ncu_profile: no GPU visible to torch")
    device = torch.device("cuda")
    for spec in cases:
        op, shape, batch, env = parse_case(spec)
        saved = {name: os.environ.get(name) for name, _ in env}
        os.environ.update(dict(env))
        (case,) = make_cases([op], [parse_shape(shape)], [batch], "cuda")
        inputs, grad = make_inputs(op, case, torch.float32, device)
        step = fwd_bwd_step(get_impl(case, "capsroute"), inputs, grad, 3)
        for _ in range(2):
            step()
            clear_grads(inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda._sleep(1000)
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        paths = " / ".join(capsroute.last_kernel_path(op, d) for d in ("forward", "backward"))
        print(f"{CASE_PREFIX}{spec} ({paths})", flush=True)
        for name, value in saved.items():  # the caller's own settings back
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
        del inputs, grad, step
        torch.cuda.empty_cache()
    return 0


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


TABLE_HEAD = (
    "| kernel | grid | us | DRAM MB read / written | "
    + " | ".join(heading for heading, _ in COLUMNS)
    + " | M warp inst | sectors a load / store request | stalls per issued instruction |\n"
    + "|---|---:|---:|---:|"
    + "---:|" * len(COLUMNS)
    + "---:|---:|---|"
)


class RawPage:
    """ncu's raw CSV page: a header row, a row of units, then a row per kernel."""

    def __init__(self, path):
        rows = list(csv.reader(open(path)))
        header, self.units, self.kernels = rows[0], rows[1], rows[2:]
        self.column = {name: i for i, name in enumerate(header)}
        self.stalls = [h for h in header if h.startswith(STALL) and h.endswith(STALL_SUFFIX)]

    def get(self, row, metric: str) -> float:
        return _number(row[self.column[metric]])

    def unit(self, metric: str) -> str:
        return self.units[self.column[metric]]

    def table_row(self, row) -> str:
        name = row[self.column["Kernel Name"]]
        short = name.replace("void ", "").split("<")[0].split("(")[0].split("::")[-1]
        time = "gpu__time_duration.sum"
        us = self.get(row, time) * (1000.0 if self.unit(time) == "ms" else 1.0)
        read, written = (
            self.get(row, m) * BYTES[self.unit(m)]
            for m in ("dram__bytes_read.sum", "dram__bytes_write.sum")
        )
        sectors = [
            self.get(row, f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum")
            / max(1.0, self.get(row, f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum"))
            for op in ("ld", "st")
        ]
        stalls = sorted(
            ((self.get(row, h), h[len(STALL) : -len(STALL_SUFFIX)]) for h in self.stalls),
            reverse=True,
        )
        cells = [
            short,
            row[self.column["launch__grid_size"]],
            f"{us:.1f}",
            f"{read:.0f} / {written:.0f}",
            *(f"{self.get(row, m):.0f}" for _, m in COLUMNS),
            f"{self.get(row, 'smsp__inst_executed.sum') / 1e6:.1f}",
            f"{sectors[0]:.1f} / {sectors[1]:.1f}",
            ", ".join(f"{name} {value:.1f}" for value, name in stalls[:4]),
        ]
        return "| " + " | ".join(cells) + " |"


def summary(raw_csv, cases_log) -> int:
    page = RawPage(raw_csv)
    names = []
    if cases_log:
        names = [
            line.split(CASE_PREFIX, 1)[1].strip() for line in open(cases_log) if CASE_PREFIX in line
        ]
    case = 0
    for row in page.kernels:
        kernel = row[page.column["Kernel Name"]]
        if SPIN_KERNEL in kernel:
            title = names[case] if case < len(names) else f"case {case + 1}"
            print(f"\n### {title}\n\n{TABLE_HEAD}")
            case += 1
        elif "capsroute" in kernel or "gemm" in kernel:
            print(page.table_row(row))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the workload, under ncu")
    r.add_argument(
        "cases", nargs="*", default=CASES, metavar="CASE", help="op|shape|B[|NAME=VALUE,...]"
    )
    s = sub.add_parser("summary", help="markdown tables from ncu's raw CSV page")
    s.add_argument("raw_csv")
    s.add_argument("--cases", metavar="LOG", help="run's output, for the case names")
    args = p.parse_args(argv)
    return run(args.cases) if args.command == "run" else summary(args.raw_csv, args.cases)


if __name__ == "__main__":
    sys.exit(main())
