// Host side of the agreement routings on votes read from memory, dynamic routing and the routings
// under a rule of their own (dynamic_routing_cuda.cu, self_attention_routing_cuda.cu,
// inverted_attention_routing_cuda.cu), as csrc/cpu/agreement_routing.h is the CPU's: votes read in
// place, the rule's parameters in the accumulation dtype (AccParameters), the forward, and the
// backward with the vote gradient and the parameters' gradients (ParameterGradItems,
// common/rule_tensors.h). The ops check their arguments (common/checks.h) before calling these.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <tuple>

#include "../common/agreement_rules.h"
#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "../common/rule_tensors.h"
#include "agreement_launch.cuh"
#include "host_checks.cuh"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {

// votes (B, I, J, D) routed for `iters` passes under rule, bias (J, D) (undefined: none) added to
// every s; op names the kernel path record. Returns (v (B, J, D), final coupling c (B, I, J)
// (without `couplings`: empty, not computed), s_hist (B, iters, J, D) in the accumulation dtype).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(
    const char* op, const at::Tensor& votes_in, const at::Tensor& bias_in, const RuleTensors& rule,
    int64_t iters, bool leaky, double eps, bool couplings) {
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);  // rows (MemoryVotes)
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const RoutingDims dims{votes.size(0), votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, votes.options());
  at::Tensor c = couplings ? at::empty({dims.B, dims.I, dims.J}, votes.options())
                           : at::empty({0}, votes.options());
  at::Tensor s_hist = at::empty({dims.B, iters, dims.J, dims.D}, votes.options().dtype(acc));
  if (dims.B == 0) return {v, c, s_hist};
  const AccParameters params(rule, acc);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "route_votes_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                               capsule_strides(votes, 2)};
        record_kernel_path(
            op, Direction::forward,
            launch_routing_forward(src, bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                                   dims, eps, s_hist, v, couplings ? c : at::Tensor(),
                                   params.rule<acc_t>()));
      });
  return {v, c, s_hist};
}

// Where the kernels add the rule's items of a ParameterGradItems made with norm_rows = J, from
// element b0 on.
template <typename acc_t>
RuleGradItems<acc_t> rule_item_data(ParameterGradItems& items, int64_t b0 = 0) {
  return {ParameterGradItems::data<acc_t>(items.coupling_bias, b0),
          ParameterGradItems::data<acc_t>(items.norm_weight, b0),
          ParameterGradItems::data<acc_t>(items.norm_bias, b0)};
}

// The backward of route_votes at grad_v (B, J, D), from its s_hist.
inline RoutingGrads route_votes_backward(const char* op, const at::Tensor& grad_v_in,
                                         const at::Tensor& votes_in, const at::Tensor& s_hist_in,
                                         const RuleTensors& rule, bool leaky, bool detach,
                                         double eps) {
  check_cuda(votes_in, "votes");
  check_same_device(grad_v_in, votes_in, "grad_v", "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);
  const int64_t B = votes.size(0), I = votes.size(1), J = votes.size(2), D = votes.size(3);
  const RoutingDims dims{B, I, J, D, s_hist_in.size(1), leaky};
  const at::ScalarType dtype = votes.scalar_type(), acc = acc_dtype(dtype);
  // The incoming gradient stays in the accumulation dtype (float32 for float16/bfloat16 storage).
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  RoutingGrads grads{empty_capsule_gradient(votes, 2)};
  const CapsuleStrides grad_rows = capsule_strides(grads.votes, 2);
  ParameterGradItems items(rule, dims, /*norm_rows=*/J, votes.options().dtype(acc));
  if (B > 0) {
    const AccParameters params(rule, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "route_votes_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                                 capsule_strides(votes, 2)};
          const BackwardBuffers<acc_t> buf = launch_routing_backward(
              src, grad_v.const_data_ptr<acc_t>(), s_hist, dims, detach, eps, items.bias, grad_rows,
              grads.votes.mutable_data_ptr<scalar_t>(), params.rule<acc_t>(),
              rule_item_data<acc_t>(items));
          record_kernel_path(op, Direction::backward, buf.path);
          if (!buf.vote_grad_written && grads.votes.numel() > 0)
            StreamLaunch{c10::cuda::getCurrentCUDAStream()}(
                write_vote_grad_rows_kernel<scalar_t, acc_t>, vote_grad_rows_blocks(B, I),
                buf.state, B, grad_rows, grads.votes.mutable_data_ptr<scalar_t>());
        });
  }
  items.sum_into(rule, grads, dtype);
  return grads;
}

}  // namespace cuda
}  // namespace capsroute
