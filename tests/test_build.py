import torch

import capsroute
from capsroute.ops import SCHEMA_OPS


def test_build_info():
    info = capsroute.build_info()
    assert info["version"] == capsroute.__version__
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_archs"]


def test_the_op_list_names_every_registered_op():
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("capsroute::")}
    assert registered == {f"capsroute::{op}" for op in SCHEMA_OPS}


def test_every_op_has_cpu_kernels_and_cuda_kernels_when_built_with_cuda():
    for op in SCHEMA_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CPU"), op
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CUDA")
        assert has_cuda == capsroute.build_info()["cuda"], op
