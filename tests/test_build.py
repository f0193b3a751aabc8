import torch

import capsroute

OPS = ["squash", "_squash_backward", "dynamic_routing", "_dynamic_routing_backward", "dense_capsules",
       "_dense_capsules_backward", "em_routing", "_em_routing_backward", "em_routing_pose", "_em_routing_pose_backward"]


def test_build_info():
    info = capsroute.build_info()
    assert info["version"] == capsroute.__version__
    assert info["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert isinstance(info["cuda"], bool)
    if info["cuda"]:
        assert info["cuda_archs"]


def test_every_op_has_cpu_kernels_and_cuda_kernels_when_built_with_cuda():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CPU"), op
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"capsroute::{op}", "CUDA")
        assert has_cuda == capsroute.build_info()["cuda"], op
