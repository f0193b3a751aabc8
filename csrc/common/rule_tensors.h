// A routing's rule with its parameters as tensors, as an op hands it to either backend's agreement
// routing (csrc/cpu/agreement_routing.h, csrc/cuda/rule_routing.cuh), and the attention routings'
// rules made from their arguments. Host code only.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "checks.h"
#include "routing_rule.h"

namespace capsroute {

// The rule (its pointers unused) and its parameters in the votes' dtype (undefined: absent).
// RuleTensors{} is dynamic routing's rule.
struct RuleTensors {
  RoutingRule<double> rule;
  at::Tensor coupling_bias, norm_weight, norm_bias;
};

// self_attention_routing's rule over J outputs of D dims: coupling_bias (I, J) or none, squash
// "efficient" or "sabour".
inline RuleTensors self_attention_rule_tensors(int64_t J, int64_t D,
                                               const std::optional<at::Tensor>& coupling_bias,
                                               std::string_view squash) {
  return {self_attention_rule<double>(J, D, self_attention_squash(squash), nullptr),
          coupling_bias.value_or(at::Tensor())};
}

// inverted_attention_routing's rule over D dims: LayerNorm's affine weight and bias (D,) or none.
inline RuleTensors inverted_attention_rule_tensors(int64_t D,
                                                   const std::optional<at::Tensor>& norm_weight,
                                                   const std::optional<at::Tensor>& norm_bias) {
  return {inverted_attention_rule<double>(D, nullptr, nullptr), at::Tensor(),
          norm_weight.value_or(at::Tensor()), norm_bias.value_or(at::Tensor())};
}

// The rule's parameters in the accumulation dtype, contiguous on their device, and the rule that
// reads them.
class AccParameters {
 public:
  AccParameters(const RuleTensors& rule, at::ScalarType acc)
      : rule_(rule.rule),
        coupling_bias_(to_acc(rule.coupling_bias, acc)),
        norm_weight_(to_acc(rule.norm_weight, acc)),
        norm_bias_(to_acc(rule.norm_bias, acc)) {}

  template <typename acc_t>
  RoutingRule<acc_t> rule() const {
    RoutingRule<acc_t> rule;
    rule.logits = rule_.logits;
    rule.nonlinearity = rule_.nonlinearity;
    rule.logit_scale = static_cast<acc_t>(rule_.logit_scale);
    rule.coupling_bias = data_or_null<acc_t>(coupling_bias_);
    rule.norm_weight = data_or_null<acc_t>(norm_weight_);
    rule.norm_bias = data_or_null<acc_t>(norm_bias_);
    return rule;
  }

 private:
  static at::Tensor to_acc(const at::Tensor& t, at::ScalarType acc) {
    return t.defined() ? t.to(acc).contiguous() : t;
  }
  template <typename acc_t>
  static const acc_t* data_or_null(const at::Tensor& t) {
    return t.defined() ? t.const_data_ptr<acc_t>() : nullptr;
  }

  RoutingRule<double> rule_;
  at::Tensor coupling_bias_, norm_weight_, norm_bias_;
};

}  // namespace capsroute
