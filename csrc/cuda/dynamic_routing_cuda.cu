// dynamic_routing on CUDA: the shared routing kernels over votes read from memory.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/layout.h"
#include "host_checks.cuh"
#include "routing_launch.cuh"

namespace capsroute {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_routing_cuda(
    const at::Tensor& votes_in, const std::optional<at::Tensor>& bias_in, int64_t iters, bool leaky,
    bool /*detach: backward only*/, double eps) {
  check_dynamic_routing_inputs(votes_in, bias_in, iters, eps);
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);  // rows (MemoryVotes)
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const RoutingDims dims{votes.size(0), votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, votes.options());
  at::Tensor c = at::empty({dims.B, dims.I, dims.J}, votes.options());
  at::Tensor s_hist = at::empty({dims.B, iters, dims.J, dims.D},
                                votes.options().dtype(acc_dtype(votes.scalar_type())));
  if (dims.B == 0) return {v, c, s_hist};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "dynamic_routing_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                               capsule_strides(votes, 2)};
        record_kernel_path(
            "dynamic_routing", Direction::forward,
            launch_routing_forward(src, bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                                   dims, eps, s_hist, v, c));
      });
  return {v, c, s_hist};
}

std::tuple<at::Tensor, at::Tensor> dynamic_routing_backward_cuda(const at::Tensor& grad_v_in,
                                                                 const at::Tensor& votes_in,
                                                                 const at::Tensor& s_hist_in,
                                                                 bool leaky, bool detach,
                                                                 double eps) {
  check_dynamic_routing_backward_inputs(grad_v_in, votes_in, s_hist_in, eps);
  const int64_t B = votes_in.size(0);
  check_cuda(votes_in, "votes");
  check_same_device(grad_v_in, votes_in, "grad_v", "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const RoutingDims dims{
      B, votes_in.size(1), votes_in.size(2), votes_in.size(3), s_hist_in.size(1), leaky};
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  // The incoming gradient stays in the accumulation dtype (float32 for float16/bfloat16 storage).
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  at::Tensor grad_votes = empty_capsule_gradient(votes, 2);
  const CapsuleStrides grad_rows = capsule_strides(grad_votes, 2);
  // Per-item bias gradients, summed afterwards in a fixed order so results are deterministic.
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, votes.options().dtype(acc));

  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, votes.scalar_type(), "dynamic_routing_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                                 capsule_strides(votes, 2)};
          const BackwardBuffers<acc_t> buf = launch_routing_backward(
              src, grad_v.const_data_ptr<acc_t>(), s_hist, dims, detach, eps, grad_bias_items,
              grad_rows, grad_votes.mutable_data_ptr<scalar_t>());
          record_kernel_path("dynamic_routing", Direction::backward, buf.path);
          const StreamLaunch launch{c10::cuda::getCurrentCUDAStream()};
          if (!buf.vote_grad_written && grad_votes.numel() > 0)
            launch(write_vote_grad_rows_kernel<scalar_t, acc_t>, vote_grad_rows_blocks(B, dims.I),
                   buf.state, B, grad_rows, grad_votes.mutable_data_ptr<scalar_t>());
        });
  }
  return {grad_votes, grad_bias_items.sum(0).to(votes.scalar_type())};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("dynamic_routing", &cuda::dynamic_routing_cuda);
  m.impl("_dynamic_routing_backward", &cuda::dynamic_routing_backward_cuda);
}

}  // namespace capsroute
