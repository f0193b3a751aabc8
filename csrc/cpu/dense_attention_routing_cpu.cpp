// dense_self_attention_routing and dense_inverted_attention_routing on the CPU: route_dense
// (dense_capsules_cpu.cpp), the votes weight_ij @ u_i computed a group of elements at a time as
// dense_capsules computes them, under the attention routings' rules
// (csrc/common/agreement_rules.h).
#include <torch/library.h>

#include "../common/checks.h"
#include "agreement_routing.h"

namespace capsroute {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_self_attention_routing_cpu(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& coupling_bias,
    std::string_view squash, double eps, bool couplings) {
  check_dense_self_attention_routing_inputs(u, weight, coupling_bias, squash, eps);
  return route_dense(
      "dense_self_attention_routing", u, weight, at::Tensor(),
      self_attention_rule_tensors(weight.size(1), weight.size(2), coupling_bias, squash),
      kSelfAttentionPasses,
      /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_self_attention_routing_backward_cpu(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const std::optional<at::Tensor>& coupling_bias, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_dense_self_attention_routing_backward_inputs(grad_v, u, weight, coupling_bias, s_hist,
                                                     squash, eps);
  const DenseGrads grads = route_dense_backward(
      "dense_self_attention_routing", grad_v, u, weight, s_hist,
      self_attention_rule_tensors(weight.size(1), weight.size(2), coupling_bias, squash),
      /*leaky=*/false,
      /*detach=*/false, eps);
  return {grads.u, grads.weight, grads.parameters.coupling_bias};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_inverted_attention_routing_cpu(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, int64_t iters, double eps, bool couplings) {
  check_dense_inverted_attention_routing_inputs(u, weight, norm_weight, norm_bias, iters, eps);
  return route_dense("dense_inverted_attention_routing", u, weight, at::Tensor(),
                     inverted_attention_rule_tensors(weight.size(2), norm_weight, norm_bias), iters,
                     /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
dense_inverted_attention_routing_backward_cpu(const at::Tensor& grad_v, const at::Tensor& u,
                                              const at::Tensor& weight,
                                              const std::optional<at::Tensor>& norm_weight,
                                              const std::optional<at::Tensor>& norm_bias,
                                              const at::Tensor& s_hist, double eps) {
  check_dense_inverted_attention_routing_backward_inputs(grad_v, u, weight, norm_weight, norm_bias,
                                                         s_hist, eps);
  const DenseGrads grads = route_dense_backward(
      "dense_inverted_attention_routing", grad_v, u, weight, s_hist,
      inverted_attention_rule_tensors(weight.size(2), norm_weight, norm_bias), /*leaky=*/false,
      /*detach=*/false, eps);
  return {grads.u, grads.weight, grads.parameters.norm_weight, grads.parameters.norm_bias};
}

}  // namespace
}  // namespace cpu

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dense_self_attention_routing", &cpu::dense_self_attention_routing_cpu);
  m.impl("_dense_self_attention_routing_backward", &cpu::dense_self_attention_routing_backward_cpu);
  m.impl("dense_inverted_attention_routing", &cpu::dense_inverted_attention_routing_cpu);
  m.impl("_dense_inverted_attention_routing_backward",
         &cpu::dense_inverted_attention_routing_backward_cpu);
}

}  // namespace capsroute
