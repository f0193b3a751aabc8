// The CPU kernels of the agreement routings on given votes (docs/ops.md, "The agreement
// routings"): dynamic_routing, self_attention_routing and inverted_attention_routing each check
// their arguments, make their rule and call these.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../common/routing_rule.h"

namespace capsroute {
namespace cpu {

// A routing's rule with its parameters as tensors in the votes' dtype (undefined: absent); the
// pointers of `rule` are unused.
struct RuleTensors {
  RoutingRule<double> rule;
  at::Tensor coupling_bias, norm_weight, norm_bias;
};

// votes (B, I, J, D) routed for `iters` passes, bias (J, D) (undefined: none) added to every s.
// Returns (v (B, J, D), final coupling c (B, I, J), s_hist (B, iters, J, D) in the accumulation
// dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(const at::Tensor& votes,
                                                           const at::Tensor& bias,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps);

// The gradients in the votes' dtype: of the votes (in their layout where it has contiguous
// capsules), of the bias (J, D) and of the rule's parameters (zeros where absent).
struct RoutingGrads {
  at::Tensor votes, bias, coupling_bias, norm_weight, norm_bias;
};

// The backward of route_votes at grad_v (B, J, D), from its s_hist; with_bias: whether the
// gradient of a bias is wanted (dynamic_routing's backward returns it, the attention routings
// have none).
RoutingGrads route_votes_backward(const at::Tensor& grad_v, const at::Tensor& votes,
                                  const at::Tensor& s_hist, const RuleTensors& rule, bool with_bias,
                                  bool leaky, bool detach, double eps);

}  // namespace cpu
}  // namespace capsroute
