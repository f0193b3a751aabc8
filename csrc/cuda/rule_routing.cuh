// Host side of the routings that run dynamic routing's block kernels under a rule of their own
// (self_attention_routing_cuda.cu, inverted_attention_routing_cuda.cu; dense_routing.cuh takes
// the rules and the gradient items from here): votes read in place as
// dynamic_routing reads them, the rule's parameters in the accumulation dtype, the forward and
// the backward with the vote gradient, and the parameters' gradient items summed in a fixed order.
// The ops check their arguments (common/checks.h) before calling these.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <optional>
#include <tuple>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "../common/routing_rule.h"
#include "host_checks.cuh"
#include "routing_launch.cuh"

namespace capsroute {
namespace cuda {

// A rule parameter in the accumulation dtype, contiguous; undefined where absent.
inline at::Tensor acc_parameter(const std::optional<at::Tensor>& t, at::ScalarType acc) {
  return t.has_value() ? t->to(acc).contiguous() : at::Tensor();
}
template <typename acc_t>
const acc_t* parameter_data(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<acc_t>() : nullptr;
}

// The forward of op on votes (B, I, J, D) for `iters` passes under rule_of(acc_t()) (a
// RoutingRule<acc_t>): (v (B, J, D), c (B, I, J), s_hist (B, iters, J, D) in the accumulation
// dtype).
template <typename RuleOf>
std::tuple<at::Tensor, at::Tensor, at::Tensor> rule_routing_forward(const char* op,
                                                                    const at::Tensor& votes_in,
                                                                    int64_t iters, double eps,
                                                                    const RuleOf& rule_of) {
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);  // rows (MemoryVotes)
  const RoutingDims dims{votes.size(0), votes.size(1), votes.size(2), votes.size(3), iters, false};
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, votes.options());
  at::Tensor c = at::empty({dims.B, dims.I, dims.J}, votes.options());
  at::Tensor s_hist = at::empty({dims.B, iters, dims.J, dims.D},
                                votes.options().dtype(acc_dtype(votes.scalar_type())));
  if (dims.B == 0) return {v, c, s_hist};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "rule_routing_forward", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                               capsule_strides(votes, 2)};
        record_kernel_path(op, Direction::forward,
                           launch_routing_forward(src, static_cast<const scalar_t*>(nullptr), dims,
                                                  eps, s_hist, v, c, rule_of(acc_t())));
      });
  return {v, c, s_hist};
}

// The backward's results: the vote gradient (the dtype and layout of votes) and the gradients of
// the rule's parameters in the accumulation dtype, undefined where not asked for.
struct RuleRoutingGradients {
  at::Tensor votes, coupling_bias, norm_weight, norm_bias;
};

// Which parameter gradients the backward makes: coupling_bias (I, J), norm_weight and norm_bias
// (D,).
struct RuleParameterGrads {
  bool coupling_bias = false, norm_weight = false, norm_bias = false;
};

// The per-element items of the parameter gradients a backward makes (RuleGradItems), zeroed in
// the accumulation dtype, undefined where not wanted; summed over the batch (and the capsules) by
// at::sum, in a fixed order.
class RuleGradItemTensors {
 public:
  RuleGradItemTensors(RuleParameterGrads wanted, const RoutingDims& dims,
                      const at::TensorOptions& acc_options)
      : coupling_bias_(zeros_if(wanted.coupling_bias, {dims.B, dims.I, dims.J}, acc_options)),
        norm_weight_(zeros_if(wanted.norm_weight, {dims.B, dims.J, dims.D}, acc_options)),
        norm_bias_(zeros_if(wanted.norm_bias, {dims.B, dims.J, dims.D}, acc_options)) {}

  // The items from element b0 on.
  template <typename acc_t>
  RuleGradItems<acc_t> items(int64_t b0 = 0) {
    return {from<acc_t>(coupling_bias_, b0), from<acc_t>(norm_weight_, b0),
            from<acc_t>(norm_bias_, b0)};
  }
  // The sums into grads' parameter gradients, in the accumulation dtype.
  void sum_into(RuleRoutingGradients& grads) const {
    if (coupling_bias_.defined()) grads.coupling_bias = coupling_bias_.sum(0);
    if (norm_weight_.defined()) grads.norm_weight = norm_weight_.sum({0, 1});
    if (norm_bias_.defined()) grads.norm_bias = norm_bias_.sum({0, 1});
  }

 private:
  static at::Tensor zeros_if(bool wanted, at::IntArrayRef sizes, const at::TensorOptions& options) {
    return wanted ? at::zeros(sizes, options) : at::Tensor();
  }
  template <typename acc_t>
  static acc_t* from(at::Tensor& t, int64_t b0) {
    return t.defined() ? t.mutable_data_ptr<acc_t>() + b0 * t.stride(0) : nullptr;
  }

  at::Tensor coupling_bias_, norm_weight_, norm_bias_;
};

// The backward of op's forward under rule_of(acc_t()) (s_hist (B, iters, J, D) as it returned).
template <typename RuleOf>
RuleRoutingGradients rule_routing_backward(const char* op, const at::Tensor& grad_v_in,
                                           const at::Tensor& votes_in, const at::Tensor& s_hist_in,
                                           double eps, RuleParameterGrads wanted,
                                           const RuleOf& rule_of) {
  check_cuda(votes_in, "votes");
  check_same_device(grad_v_in, votes_in, "grad_v", "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);
  const int64_t B = votes.size(0), I = votes.size(1), J = votes.size(2), D = votes.size(3);
  const RoutingDims dims{B, I, J, D, s_hist_in.size(1), false};
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  // The incoming gradient stays in the accumulation dtype (float32 for float16/bfloat16 storage).
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  RuleRoutingGradients grads{empty_capsule_gradient(votes, 2)};
  const CapsuleStrides grad_rows = capsule_strides(grads.votes, 2);
  RuleGradItemTensors items(wanted, dims, votes.options().dtype(acc));
  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, votes.scalar_type(), "rule_routing_backward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                                 capsule_strides(votes, 2)};
          at::Tensor no_bias_items;  // dynamic routing's bias gradient: none here
          const BackwardBuffers<acc_t> buf = launch_routing_backward(
              src, grad_v.const_data_ptr<acc_t>(), s_hist, dims, /*detach=*/false, eps,
              no_bias_items, grad_rows, grads.votes.mutable_data_ptr<scalar_t>(), rule_of(acc_t()),
              items.items<acc_t>());
          record_kernel_path(op, Direction::backward, buf.path);
          if (grads.votes.numel() > 0)
            StreamLaunch{c10::cuda::getCurrentCUDAStream()}(
                write_vote_grad_rows_kernel<scalar_t, acc_t>, vote_grad_rows_blocks(B, I),
                buf.state, B, grad_rows, grads.votes.mutable_data_ptr<scalar_t>());
        });
  }
  items.sum_into(grads);
  return grads;
}

}  // namespace cuda
}  // namespace capsroute
