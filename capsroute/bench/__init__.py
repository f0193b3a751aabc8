"""Microbenchmarks of capsroute's routing ops, and of training steps of the two capsule networks,
against plain PyTorch, eager and under torch.compile (method, fields and floor in bench/README.md).

`capsroute bench` is cli.add_arguments and cli.run. Library use: run_benchmarks(cases, ...) returns
the report (the JSON document); format_table(report) prints it. The modules, in the order a run
uses them:

  cases        the ops, shapes and cases; each case's random inputs and implementations
  timing       the steps, the timer, peak memory and the out-of-memory helpers
  floor        the floor model and the bandwidth / peak probes it divides by
  measure      what op and model benches share: each impl in turn, warm-up, checks against eager, ratios
  op_bench     the routing ops' cases (bench_case) and the conv ops' --max-batch (op_max_batch)
  model_bench  a whole training step of a model (bench_model_case) and its --max-batch (model_max_batch)
  runner       run_benchmarks: the run, its metadata and notes
  report       the table and the JSON's path
  plot         the figures (also `capsroute plot`)
  cli          the command line
"""

from .cases import (
    ALL_OPS,
    CONV_OPS,
    CONV_SHAPES,
    DTYPES,
    EM_OPS,
    IMPLS,
    MODEL_OPS,
    OPS,
    SHAPES,
    Case,
    ConvShape,
    capsroute_supports,
    get_impl,
    make_cases,
    make_inputs,
    op_name,
    parse_shape,
)
from .cli import add_arguments, run
from .floor import floor_model, floor_ms, measure_bandwidth, measure_peak_tflops
from .measure import find_max_batch
from .model_bench import (
    bench_model_case,
    compile_crash,
    make_model,
    model_max_batch,
    train_step,
)
from .op_bench import bench_case, cpu_max_batch, cpu_max_side, op_max_batch
from .report import default_out, format_table, report_path
from .runner import add_max_batches, run_benchmarks
from .timing import clear_grads, fwd_bwd_step, fwd_step, peak_memory_mb, synchronize, time_samples

__all__ = [
    "ALL_OPS",
    "CONV_OPS",
    "CONV_SHAPES",
    "DTYPES",
    "EM_OPS",
    "IMPLS",
    "MODEL_OPS",
    "OPS",
    "SHAPES",
    "Case",
    "ConvShape",
    "add_arguments",
    "add_max_batches",
    "bench_case",
    "bench_model_case",
    "capsroute_supports",
    "clear_grads",
    "compile_crash",
    "cpu_max_batch",
    "cpu_max_side",
    "default_out",
    "find_max_batch",
    "floor_model",
    "floor_ms",
    "format_table",
    "fwd_bwd_step",
    "fwd_step",
    "get_impl",
    "make_cases",
    "make_inputs",
    "make_model",
    "measure_bandwidth",
    "measure_peak_tflops",
    "model_max_batch",
    "op_max_batch",
    "op_name",
    "parse_shape",
    "peak_memory_mb",
    "report_path",
    "run",
    "run_benchmarks",
    "synchronize",
    "time_samples",
    "train_step",
]
