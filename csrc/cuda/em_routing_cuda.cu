// em_routing on CUDA: the EM kernels of em_kernels.cuh over votes read from memory. Same
// results, saved statistics and checks as csrc/cpu/em_routing_cpu.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <type_traits>

#include "../common/checks.h"
#include "em_kernels.cuh"
#include "routing_kernels.cuh"  // MemoryVotes
#include "utils.cuh"

namespace capsroute {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_cuda(const at::Tensor& votes_in, const at::Tensor& a_in_in,
                                                               const at::Tensor& beta_u_in,
                                                               const at::Tensor& beta_a_in, int64_t iters,
                                                               double final_lambda, double eps) {
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = votes_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const EmKernelDims dims{votes.size(0), votes.size(1), votes.size(2), votes.size(3), iters, final_lambda};
  at::Tensor pose = at::empty({dims.B, dims.J, dims.H}, votes.options());
  at::Tensor a_out = at::empty({dims.B, dims.J}, votes.options());
  at::Tensor stats =
      at::empty({dims.B, iters, dims.J, 2 * dims.H + 1}, votes.options().dtype(acc_dtype(votes.scalar_type())));
  if (dims.B == 0) return {pose, a_out, stats};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(), dims.I, dims.J * dims.H};
    launch_em_forward(src, a_in.const_data_ptr<scalar_t>(), beta_u.const_data_ptr<scalar_t>(),
                      beta_a.const_data_ptr<scalar_t>(), dims, eps, stats, pose, a_out);
  });
  return {pose, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> em_routing_backward_cuda(
    const at::Tensor& grad_pose_in, const at::Tensor& grad_a_out_in, const at::Tensor& votes_in,
    const at::Tensor& a_in_in, const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, const at::Tensor& stats_in,
    double final_lambda, double eps) {
  const int64_t iters = stats_in.dim() == 4 ? stats_in.size(1) : 0;
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  const int64_t B = votes_in.size(0);
  check_em_backward_inputs(grad_pose_in, grad_a_out_in, stats_in, B, votes_in.size(2), votes_in.size(3));
  check_cuda(votes_in, "votes");
  check_same_device(grad_pose_in, votes_in, "grad_pose", "votes");
  check_same_device(grad_a_out_in, votes_in, "grad_a_out", "votes");
  check_same_device(stats_in, votes_in, "stats", "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const EmKernelDims dims{B, votes_in.size(1), votes_in.size(2), votes_in.size(3), iters, final_lambda};
  const at::ScalarType acc = acc_dtype(votes_in.scalar_type());
  const at::Tensor votes = votes_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous();
  const at::Tensor grad_pose = grad_pose_in.to(acc).contiguous(), grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  at::Tensor grad_votes = at::empty_like(votes);
  at::Tensor grad_a_in = at::empty_like(a_in);
  // Per-item beta gradients [beta_u | beta_a], summed afterwards in a fixed order (deterministic).
  at::Tensor grad_beta_items = at::empty({B, 2, dims.J}, votes.options().dtype(acc));

  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(), dims.I, dims.J * dims.H};
      // The kernel accumulates in the accumulation dtype: straight into the outputs when they
      // have it, else into workspaces converted afterwards.
      constexpr bool direct = std::is_same_v<scalar_t, acc_t>;
      at::Tensor g_V = grad_votes, g_a = grad_a_in;
      if constexpr (!direct) {
        g_V = at::empty(votes.sizes(), votes.options().dtype(acc));
        g_a = at::empty(a_in.sizes(), a_in.options().dtype(acc));
      }
      launch_em_backward(src, a_in.const_data_ptr<scalar_t>(), beta_u.const_data_ptr<scalar_t>(), stats, grad_pose,
                         grad_a_out, dims, eps, g_V, g_a, grad_beta_items);
      if constexpr (!direct) {
        grad_votes.copy_(g_V);
        grad_a_in.copy_(g_a);
      }
    });
  }
  const at::Tensor grad_betas = grad_beta_items.sum(0).to(votes.scalar_type());
  return {grad_votes, grad_a_in, grad_betas[0], grad_betas[1]};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("em_routing", &cuda::em_routing_cuda);
  m.impl("_em_routing_backward", &cuda::em_routing_backward_cuda);
}

}  // namespace capsroute
