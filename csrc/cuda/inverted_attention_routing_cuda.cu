// inverted_attention_routing on CUDA: dynamic routing's block kernels under the replace rule
// (routing_rule.h): each pass's couplings from the softmax of the previous output's agreement
// alone, and a LayerNorm over D with its optional affine parameters.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "rule_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "inverted_attention_routing";

template <typename acc_t>
RoutingRule<acc_t> rule_of(const at::Tensor& votes, const at::Tensor& norm_weight,
                           const at::Tensor& norm_bias) {
  return inverted_attention_rule(votes.size(3), parameter_data<acc_t>(norm_weight),
                                 parameter_data<acc_t>(norm_bias));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_cuda(
    const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight_in,
    const std::optional<at::Tensor>& norm_bias_in, int64_t iters, double eps) {
  check_inverted_attention_routing_inputs(votes, norm_weight_in, norm_bias_in, iters, eps);
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  const at::Tensor norm_weight = acc_parameter(norm_weight_in, acc),
                   norm_bias = acc_parameter(norm_bias_in, acc);
  return rule_routing_forward(kOp, votes, iters, eps, [&](auto acc_value) {
    return rule_of<decltype(acc_value)>(votes, norm_weight, norm_bias);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& votes,
    const std::optional<at::Tensor>& norm_weight_in, const std::optional<at::Tensor>& norm_bias_in,
    const at::Tensor& s_hist, double eps) {
  check_inverted_attention_routing_backward_inputs(grad_v, votes, norm_weight_in, norm_bias_in,
                                                   s_hist, eps);
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  const at::Tensor norm_weight = acc_parameter(norm_weight_in, acc),
                   norm_bias = acc_parameter(norm_bias_in, acc);
  RuleParameterGrads wanted;
  wanted.norm_weight = norm_weight.defined();
  wanted.norm_bias = norm_bias.defined();
  const RuleRoutingGradients grads = rule_routing_backward(
      kOp, grad_v, votes, s_hist, eps, wanted,
      [&](auto acc_value) { return rule_of<decltype(acc_value)>(votes, norm_weight, norm_bias); });
  // Zeros where a parameter is absent (the Python layer drops them).
  const auto parameter_grad = [&](const at::Tensor& g) {
    return g.defined() ? g.to(votes.scalar_type()) : at::zeros({votes.size(3)}, votes.options());
  };
  return {grads.votes, parameter_grad(grads.norm_weight), parameter_grad(grads.norm_bias)};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("inverted_attention_routing", &cuda::inverted_attention_routing_cuda);
  m.impl("_inverted_attention_routing_backward", &cuda::inverted_attention_routing_backward_cuda);
}

}  // namespace capsroute
