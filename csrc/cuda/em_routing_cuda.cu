// em_routing on CUDA: the EM kernels of em_kernels.cuh over votes read from memory. Same
// results, saved statistics and checks as csrc/cpu/em_routing_cpu.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <tuple>

#include "../common/checks.h"
#include "../common/layout.h"
#include "em_kernels.cuh"
#include "em_launch.cuh"
#include "host_checks.cuh"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_cuda(
    const at::Tensor& votes_in, const at::Tensor& a_in_in, const at::Tensor& beta_u_in,
    const at::Tensor& beta_a_in, int64_t iters, double final_lambda, double eps) {
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);  // rows (MemoryVotes)
  const at::Tensor a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const EmDims dims{votes.size(0), votes.size(1), votes.size(2),
                    votes.size(3), iters,         final_lambda};
  at::Tensor pose, a_out, stats;  // (not structured bindings: the dispatch lambda captures them)
  std::tie(pose, a_out, stats) = em_forward_outputs(votes, dims);
  if (dims.B == 0) return {pose, a_out, stats};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                               capsule_strides(votes, 2)};
        record_kernel_path(
            "em_routing", Direction::forward,
            launch_em_forward(src, a_in.const_data_ptr<scalar_t>(),
                              beta_u.const_data_ptr<scalar_t>(), beta_a.const_data_ptr<scalar_t>(),
                              dims, eps, stats, pose, a_out));
      });
  return {pose, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> em_routing_backward_cuda(
    const at::Tensor& grad_pose_in, const at::Tensor& grad_a_out_in, const at::Tensor& votes_in,
    const at::Tensor& a_in_in, const at::Tensor& beta_u_in, const at::Tensor& beta_a_in,
    const at::Tensor& stats_in, double final_lambda, double eps) {
  check_em_routing_backward_inputs(grad_pose_in, grad_a_out_in, votes_in, a_in_in, beta_u_in,
                                   beta_a_in, stats_in, final_lambda, eps);
  const int64_t B = votes_in.size(0), iters = stats_in.size(1);
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const EmDims dims{B, votes_in.size(1), votes_in.size(2), votes_in.size(3), iters, final_lambda};
  const EmBackwardArgs args =
      prepare_em_backward(grad_pose_in, grad_a_out_in, stats_in, votes_in, "votes", B, dims.J);
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous();
  at::Tensor grad_votes = empty_capsule_gradient(votes, 2);
  at::Tensor grad_a_in = at::empty_like(a_in);

  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                                 capsule_strides(votes, 2)};
          // The kernel accumulates in the accumulation dtype (em_launch.cuh).
          at::Tensor g_V = acc_buffer_for(grad_votes), g_a = acc_buffer_for(grad_a_in);
          at::Tensor g_beta = args.grad_beta_items;
          record_kernel_path(
              "em_routing", Direction::backward,
              launch_em_backward(src, a_in.const_data_ptr<scalar_t>(),
                                 beta_u.const_data_ptr<scalar_t>(), args.stats, args.grad_pose,
                                 args.grad_a_out, dims, eps, g_V, g_a, g_beta));
          copy_from_acc_buffer(grad_votes, g_V);
          copy_from_acc_buffer(grad_a_in, g_a);
        });
  }
  const auto [grad_beta_u, grad_beta_a] = args.beta_grads(votes.scalar_type());
  return {grad_votes, grad_a_in, grad_beta_u, grad_beta_a};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("em_routing", &cuda::em_routing_cuda);
  m.impl("_em_routing_backward", &cuda::em_routing_backward_cuda);
}

}  // namespace capsroute
