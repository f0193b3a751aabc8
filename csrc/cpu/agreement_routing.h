// The CPU kernels of the agreement routings (docs/ops.md, "The agreement routings"):
// dynamic_routing, self_attention_routing and inverted_attention_routing on given votes, and
// dense_capsules and the dense attention routings on votes computed on the fly from u and a weight
// (dense_capsules_cpu.cpp). Each op checks its arguments, makes its rule and calls these.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

#include "../common/dims.h"
#include "../common/routing_rule.h"
#include "../common/rule_tensors.h"
#include "routing_element.h"

namespace capsroute {
namespace cpu {

// The gradients in the votes' dtype: of the votes (in their layout where it has contiguous
// capsules), of the bias (J, D) and of the rule's parameters (zeros where absent).
struct RoutingGrads {
  at::Tensor votes, bias, coupling_bias, norm_weight, norm_bias;
};

// Per-element gradients of the bias (if wanted) and of the rule's parameters present, (B, ...) in
// the accumulation dtype, zeroed; summed afterwards in a fixed order so results are deterministic.
class GradItems {
 public:
  GradItems(const RuleTensors& rule, bool with_bias, const RoutingDims& dims,
            const at::TensorOptions& acc_options);

  template <typename acc_t>
  ParameterGrads<acc_t> items() {
    return {data_or_null<acc_t>(bias_), data_or_null<acc_t>(coupling_bias_),
            data_or_null<acc_t>(norm_weight_), data_or_null<acc_t>(norm_bias_)};
  }
  // The summed gradients in dtype (zeros where absent) into grads, all but its votes.
  void sum_into(RoutingGrads& grads, at::ScalarType dtype) const;

 private:
  template <typename acc_t>
  static acc_t* data_or_null(at::Tensor& t) {
    return t.defined() ? t.mutable_data_ptr<acc_t>() : nullptr;
  }

  RoutingDims dims_;
  at::TensorOptions options_;
  at::Tensor bias_, coupling_bias_, norm_weight_, norm_bias_;
};

// votes (B, I, J, D) routed for `iters` passes, bias (J, D) (undefined: none) added to every s.
// Returns (v (B, J, D), final coupling c (B, I, J), s_hist (B, iters, J, D) in the accumulation
// dtype).
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(const at::Tensor& votes,
                                                           const at::Tensor& bias,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps);

// The backward of route_votes at grad_v (B, J, D), from its s_hist; with_bias: whether the
// gradient of a bias is wanted (dynamic_routing's backward returns it, the attention routings
// have none).
RoutingGrads route_votes_backward(const at::Tensor& grad_v, const at::Tensor& votes,
                                  const at::Tensor& s_hist, const RuleTensors& rule, bool with_bias,
                                  bool leaky, bool detach, double eps);

// The votes weight_ij @ u_i of u (B, I, Din) and weight (I, J, D, Din), routed as route_votes
// routes them, never stored whole (dense_capsules_cpu.cpp); op names the kernel path record.
std::tuple<at::Tensor, at::Tensor, at::Tensor> route_dense(const char* op, const at::Tensor& u,
                                                           const at::Tensor& weight,
                                                           const at::Tensor& bias,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps);

// The backward of route_dense: grad_u and grad_weight in u's dtype, and the parameters' gradients
// (the bias's always; its votes undefined).
struct DenseGrads {
  at::Tensor u, weight;
  RoutingGrads parameters;
};
DenseGrads route_dense_backward(const char* op, const at::Tensor& grad_v, const at::Tensor& u,
                                const at::Tensor& weight, const at::Tensor& s_hist,
                                const RuleTensors& rule, bool leaky, bool detach, double eps);

}  // namespace cpu
}  // namespace capsroute
