// A routing's rule with its parameters as tensors, as an op hands it to either backend's agreement
// routing (csrc/cpu/agreement_routing.h, csrc/cuda/agreement_routing.cuh), the attention routings'
// rules made from their arguments, and the gradients of the parameters as both backends' backwards
// collect them. Host code only.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>

#include "agreement_rules.h"
#include "checks.h"
#include "dims.h"

namespace capsroute {

// The rule (its pointers unused) and its parameters in the votes' dtype (undefined: absent).
// RuleTensors{} is dynamic routing's rule.
struct RuleTensors {
  RoutingRule<double> rule;
  at::Tensor coupling_bias, norm_weight, norm_bias;

  // The parameters of the op that runs the rule, whose gradients its backward returns (zeros for
  // one the call did not give): dynamic routing's bias (J, D) added to every s, the self-attention
  // coupling bias and LayerNorm's affine pair.
  bool takes_bias() const { return rule.logits == LogitRule::accumulate; }
  bool takes_coupling_bias() const { return rule.logits == LogitRule::agree_with_mean; }
  bool takes_norm_parameters() const { return rule.nonlinearity == Nonlinearity::layer_norm; }
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

// The gradients of the votes and of the op's parameters (RuleTensors::takes_*) in the votes'
// dtype; undefined where the op has no such parameter, or the backward makes no vote gradient.
struct RoutingGrads {
  at::Tensor votes, bias, coupling_bias, norm_weight, norm_bias;
};

// Per-element items of the parameters' gradients, zeroed in the accumulation dtype, for the
// kernels to add into: the bias's (B, J, D) where the op takes one, coupling_bias's (B, I, J) and
// LayerNorm's (B, norm_rows, D) where the call gave them (an element's J outputs add into one row
// on the CPU, norm_rows = 1, and into a row each on CUDA, norm_rows = J). sum_into adds them over
// the batch and the rows in a fixed order, so results are deterministic.
class ParameterGradItems {
 public:
  ParameterGradItems(const RuleTensors& rule, const RoutingDims& dims, int64_t norm_rows,
                     const at::TensorOptions& acc_options)
      : bias(zeros_if(rule.takes_bias(), {dims.B, dims.J, dims.D}, acc_options)),
        coupling_bias(
            zeros_if(rule.coupling_bias.defined(), {dims.B, dims.I, dims.J}, acc_options)),
        norm_weight(zeros_if(rule.norm_weight.defined(), {dims.B, norm_rows, dims.D}, acc_options)),
        norm_bias(zeros_if(rule.norm_bias.defined(), {dims.B, norm_rows, dims.D}, acc_options)),
        dims_(dims),
        options_(acc_options) {}

  // The gradients of rule's op in dtype, into grads (all but its votes).
  void sum_into(const RuleTensors& rule, RoutingGrads& grads, at::ScalarType dtype) const {
    grads.bias = total(bias, 0, rule.takes_bias(), {dims_.J, dims_.D}, dtype);
    grads.coupling_bias =
        total(coupling_bias, 0, rule.takes_coupling_bias(), {dims_.I, dims_.J}, dtype);
    grads.norm_weight = total(norm_weight, {0, 1}, rule.takes_norm_parameters(), {dims_.D}, dtype);
    grads.norm_bias = total(norm_bias, {0, 1}, rule.takes_norm_parameters(), {dims_.D}, dtype);
  }

  // The data of items from element b0 on; null where absent.
  template <typename acc_t>
  static acc_t* data(at::Tensor& items, int64_t b0 = 0) {
    return items.defined() ? items.mutable_data_ptr<acc_t>() + b0 * items.stride(0) : nullptr;
  }

  at::Tensor bias, coupling_bias, norm_weight, norm_bias;

 private:
  static at::Tensor zeros_if(bool wanted, at::IntArrayRef sizes, const at::TensorOptions& options) {
    return wanted ? at::zeros(sizes, options) : at::Tensor();
  }
  at::Tensor total(const at::Tensor& items, at::IntArrayRef over, bool taken, at::IntArrayRef sizes,
                   at::ScalarType dtype) const {
    if (items.defined()) return items.sum(over).to(dtype);
    return taken ? at::zeros(sizes, options_.dtype(dtype)) : at::Tensor();
  }

  RoutingDims dims_;
  at::TensorOptions options_;
};

}  // namespace capsroute
