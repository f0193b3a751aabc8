// The CPU kernels of the agreement routings (docs/ops.md, "The agreement routings"):
// dynamic_routing, self_attention_routing and inverted_attention_routing on given votes, and
// dense_capsules and the dense attention routings on votes computed on the fly from u and a weight
// (dense_capsules_cpu.cpp). Each op checks its arguments, makes its rule and calls these.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../common/agreement_rules.h"
#include "../common/dims.h"
#include "../common/rule_tensors.h"
#include "agreement_element.h"

namespace capsroute {
namespace cpu {

// Where the kernels add the items of a ParameterGradItems made with norm_rows = 1.
template <typename acc_t>
ParameterGrads<acc_t> item_data(ParameterGradItems& items) {
  return {ParameterGradItems::data<acc_t>(items.bias),
          ParameterGradItems::data<acc_t>(items.coupling_bias),
          ParameterGradItems::data<acc_t>(items.norm_weight),
          ParameterGradItems::data<acc_t>(items.norm_bias)};
}

// The coupling output c (B, I, J) of the routings; without `couplings`, empty: (0,).
at::Tensor empty_couplings(bool couplings, const RoutingDims& dims,
                           const at::TensorOptions& options);

// votes (B, I, J, D) routed for `iters` passes, bias (J, D) (undefined: none) added to every s.
// Returns (v (B, J, D), final coupling c (B, I, J) (without `couplings`: empty, not computed),
// s_hist (B, iters, J, D) in the accumulation dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(const at::Tensor& votes,
                                                           const at::Tensor& bias,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps, bool couplings);

// The backward of route_votes at grad_v (B, J, D), from its s_hist.
RoutingGrads route_votes_backward(const at::Tensor& grad_v, const at::Tensor& votes,
                                  const at::Tensor& s_hist, const RuleTensors& rule, bool leaky,
                                  bool detach, double eps);

// The votes weight_ij @ u_i of u (B, I, Din) and weight (I, J, D, Din), routed as route_votes
// routes them, never stored whole (dense_capsules_cpu.cpp); op names the kernel path record.
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_dense(const char* op, const at::Tensor& u,
                                                           const at::Tensor& weight,
                                                           const at::Tensor& bias,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps, bool couplings);

// The backward of route_dense: grad_u and grad_weight in u's dtype, and the parameters' gradients
// (its votes undefined).
struct DenseGrads {
  at::Tensor u, weight;
  RoutingGrads parameters;
};
DenseGrads route_dense_backward(const char* op, const at::Tensor& grad_v, const at::Tensor& u,
                                const at::Tensor& weight, const at::Tensor& s_hist,
                                const RuleTensors& rule, bool leaky, bool detach, double eps);

}  // namespace cpu
}  // namespace capsroute
