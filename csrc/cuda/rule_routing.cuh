// Host side of the agreement routings on votes read from memory, dynamic routing and the routings
// under a rule of their own (dynamic_routing_cuda.cu, self_attention_routing_cuda.cu,
// inverted_attention_routing_cuda.cu; dense_routing.cuh takes RoutingGrads and the gradient
// items from here), as
// csrc/cpu/agreement_routing.h is the CPU's: votes read in place, the rule's parameters in the
// accumulation dtype (AccParameters), the forward and the backward with the vote gradient, and the
// bias's and parameters' gradient items summed in a fixed order. The ops check their arguments
// (common/checks.h) before calling these.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <tuple>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "../common/routing_rule.h"
#include "../common/rule_tensors.h"
#include "host_checks.cuh"
#include "routing_launch.cuh"

namespace capsroute {
namespace cuda {

// votes (B, I, J, D) routed for `iters` passes under rule, bias (J, D) (undefined: none) added to
// every s; op names the kernel path record. Returns (v (B, J, D), final coupling c (B, I, J),
// s_hist (B, iters, J, D) in the accumulation dtype).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(
    const char* op, const at::Tensor& votes_in, const at::Tensor& bias_in, const RuleTensors& rule,
    int64_t iters, bool leaky, double eps) {
  check_cuda(votes_in, "votes");
  const c10::cuda::CUDAGuard guard(votes_in.device());
  const at::Tensor votes = with_contiguous_capsules(votes_in, 2);  // rows (MemoryVotes)
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const RoutingDims dims{votes.size(0), votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, votes.options());
  at::Tensor c = at::empty({dims.B, dims.I, dims.J}, votes.options());
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
                                   dims, eps, s_hist, v, c, params.rule<acc_t>()));
      });
  return {v, c, s_hist};
}

// The gradients of the votes (the dtype and layout of votes), of the bias (J, D) and of the rule's
// parameters, in the votes' dtype; undefined where the backward does not make them.
struct RoutingGrads {
  at::Tensor votes, bias, coupling_bias, norm_weight, norm_bias;
};

// The per-element items of the gradients of the rule's parameters present (RuleGradItems),
// zeroed in the accumulation dtype; summed over the batch (and the capsules) by at::sum, in a
// fixed order.
class RuleGradItemTensors {
 public:
  RuleGradItemTensors(const RuleTensors& rule, const RoutingDims& dims,
                      const at::TensorOptions& acc_options)
      : rule_(rule.rule),
        dims_(dims),
        options_(acc_options),
        coupling_bias_(zeros_if(rule.coupling_bias, {dims.B, dims.I, dims.J})),
        norm_weight_(zeros_if(rule.norm_weight, {dims.B, dims.J, dims.D})),
        norm_bias_(zeros_if(rule.norm_bias, {dims.B, dims.J, dims.D})) {}

  // The items from element b0 on.
  template <typename acc_t>
  RuleGradItems<acc_t> items(int64_t b0 = 0) {
    return {from<acc_t>(coupling_bias_, b0), from<acc_t>(norm_weight_, b0),
            from<acc_t>(norm_bias_, b0)};
  }
  // The sums in dtype into grads, and zeros for the parameters that the rule takes and the call
  // did not give (the ops return them; the Python layer drops them).
  void sum_into(RoutingGrads& grads, at::ScalarType dtype) const {
    const bool biased = rule_.logits == LogitRule::agree_with_mean;
    const bool normed = rule_.nonlinearity == Nonlinearity::layer_norm;
    grads.coupling_bias = total(coupling_bias_, 0, biased, {dims_.I, dims_.J}, dtype);
    grads.norm_weight = total(norm_weight_, {0, 1}, normed, {dims_.D}, dtype);
    grads.norm_bias = total(norm_bias_, {0, 1}, normed, {dims_.D}, dtype);
  }

 private:
  at::Tensor zeros_if(const at::Tensor& parameter, at::IntArrayRef sizes) const {
    return parameter.defined() ? at::zeros(sizes, options_) : at::Tensor();
  }
  template <typename acc_t>
  static acc_t* from(at::Tensor& t, int64_t b0) {
    return t.defined() ? t.mutable_data_ptr<acc_t>() + b0 * t.stride(0) : nullptr;
  }
  at::Tensor total(const at::Tensor& items, at::IntArrayRef over, bool taken, at::IntArrayRef sizes,
                   at::ScalarType dtype) const {
    if (items.defined()) return items.sum(over).to(dtype);
    return taken ? at::zeros(sizes, options_.dtype(dtype)) : at::Tensor();
  }

  RoutingRule<double> rule_;
  RoutingDims dims_;
  at::TensorOptions options_;
  at::Tensor coupling_bias_, norm_weight_, norm_bias_;
};

// The backward of route_votes at grad_v (B, J, D), from its s_hist; with_bias: whether the
// gradient of a bias is wanted (dynamic_routing's backward returns it, the attention routings
// have none).
inline RoutingGrads route_votes_backward(const char* op, const at::Tensor& grad_v_in,
                                         const at::Tensor& votes_in, const at::Tensor& s_hist_in,
                                         const RuleTensors& rule, bool with_bias, bool leaky,
                                         bool detach, double eps) {
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
  // Per-element bias gradients, summed afterwards in a fixed order so results are deterministic.
  at::Tensor bias_items =
      with_bias ? at::zeros({B, J, D}, votes.options().dtype(acc)) : at::Tensor();
  RuleGradItemTensors rule_items(rule, dims, votes.options().dtype(acc));
  if (B > 0) {
    const AccParameters params(rule, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, dtype, "route_votes_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const MemoryVotes<scalar_t, acc_t> src{votes.const_data_ptr<scalar_t>(),
                                                 capsule_strides(votes, 2)};
          const BackwardBuffers<acc_t> buf = launch_routing_backward(
              src, grad_v.const_data_ptr<acc_t>(), s_hist, dims, detach, eps, bias_items, grad_rows,
              grads.votes.mutable_data_ptr<scalar_t>(), params.rule<acc_t>(),
              rule_items.items<acc_t>());
          record_kernel_path(op, Direction::backward, buf.path);
          if (!buf.vote_grad_written && grads.votes.numel() > 0)
            StreamLaunch{c10::cuda::getCurrentCUDAStream()}(
                write_vote_grad_rows_kernel<scalar_t, acc_t>, vote_grad_rows_blocks(B, I),
                buf.state, B, grad_rows, grads.votes.mutable_data_ptr<scalar_t>());
        });
  }
  if (with_bias) grads.bias = bias_items.sum(0).to(dtype);
  rule_items.sum_into(grads, dtype);
  return grads;
}

}  // namespace cuda
}  // namespace capsroute
