// conv_dynamic_routing on CUDA: the chunked votes of csrc/common/conv_capsules.h (cuBLAS batched
// GEMMs into a workspace sized for L2), each chunk's output positions routed as elements by
// dynamic_routing's kernels over the stored votes, as dense_capsules does.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/conv_capsules.h"
#include "agreement_launch.cuh"
#include "host_checks.cuh"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_cuda(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t iters, int64_t stride, int64_t padding, bool leaky, bool /*detach: backward only*/,
    double eps) {
  check_conv_dynamic_routing_inputs(u, weight, bias, iters, stride, padding, eps);
  check_cuda(u, "u");
  const c10::cuda::CUDAGuard guard(u.device());
  return conv_dynamic_routing_forward(
      u, weight, bias, iters, stride, padding, leaky, "conv-gemm+",
      [&](const at::Tensor& votes, const at::Tensor& bias_acc, const RoutingDims& dims,
          at::Tensor s_hist, at::Tensor v, at::Tensor c) {
        std::string path;
        AT_DISPATCH_FLOATING_TYPES(votes.scalar_type(), "conv_dynamic_routing_cuda", [&] {
          const MemoryVotes<scalar_t, scalar_t> src{votes.const_data_ptr<scalar_t>(),
                                                    packed_rows(dims.I, dims.jd())};
          path = launch_routing_forward(
              src, bias_acc.defined() ? bias_acc.const_data_ptr<scalar_t>() : nullptr, dims, eps,
              s_hist, v, c);
        });
        return path;
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const at::Tensor& s_hist, int64_t stride, int64_t padding, bool leaky, bool detach,
    double eps) {
  check_conv_dynamic_routing_backward_inputs(grad_v, u, weight, s_hist, stride, padding, eps);
  check_cuda(u, "u");
  const c10::cuda::CUDAGuard guard(u.device());
  return conv_dynamic_routing_backward(
      grad_v, u, weight, s_hist, stride, padding, leaky, "conv-gemm+",
      [&](const at::Tensor& votes, const at::Tensor& g_v, const at::Tensor& s_hist_chunk,
          const RoutingDims& dims, at::Tensor grad_bias_items, at::Tensor grad_votes) {
        std::string path;
        AT_DISPATCH_FLOATING_TYPES(votes.scalar_type(), "conv_dynamic_routing_backward_cuda", [&] {
          // (The cluster backward writes the gradient over the votes itself: each block reads its
          // rows' votes into shared memory before it writes their gradient.)
          const CapsuleStrides rows = packed_rows(dims.I, dims.jd());
          const BackwardBuffers<scalar_t> buf = launch_routing_backward(
              MemoryVotes<scalar_t, scalar_t>{votes.const_data_ptr<scalar_t>(), rows},
              g_v.const_data_ptr<scalar_t>(), s_hist_chunk, dims, detach, eps, grad_bias_items,
              rows, grad_votes.mutable_data_ptr<scalar_t>());
          if (!buf.vote_grad_written)
            StreamLaunch{c10::cuda::getCurrentCUDAStream()}(
                write_vote_grad_rows_kernel<scalar_t, scalar_t>,
                vote_grad_rows_blocks(dims.B, dims.I), buf.state, dims.B, rows,
                grad_votes.mutable_data_ptr<scalar_t>());
          path = buf.path;
        });
        return path;
      });
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("conv_dynamic_routing", &cuda::conv_dynamic_routing_cuda);
  m.impl("_conv_dynamic_routing_backward", &cuda::conv_dynamic_routing_backward_cuda);
}

}  // namespace capsroute
