// self_attention_routing on CUDA: dynamic routing's block kernels under the agree_with_mean rule
// (routing_rule.h): a uniformly coupled pass taken as it is, then couplings from each vote's
// agreement with it, plus the coupling bias, and a squash.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string_view>

#include "../common/checks.h"
#include "rule_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "self_attention_routing";

template <typename acc_t>
RoutingRule<acc_t> rule_of(const at::Tensor& votes, Nonlinearity squash,
                           const at::Tensor& coupling_bias) {
  return self_attention_rule(votes.size(2), votes.size(3), squash,
                             parameter_data<acc_t>(coupling_bias));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> self_attention_routing_cuda(
    const at::Tensor& votes, const std::optional<at::Tensor>& coupling_bias_in,
    std::string_view squash, double eps) {
  check_self_attention_routing_inputs(votes, coupling_bias_in, squash, eps);
  const at::Tensor coupling_bias = acc_parameter(coupling_bias_in, acc_dtype(votes.scalar_type()));
  const Nonlinearity f = self_attention_squash(squash);
  return rule_routing_forward(kOp, votes, kSelfAttentionPasses, eps, [&](auto acc) {
    return rule_of<decltype(acc)>(votes, f, coupling_bias);
  });
}

std::tuple<at::Tensor, at::Tensor> self_attention_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& votes,
    const std::optional<at::Tensor>& coupling_bias_in, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_self_attention_routing_backward_inputs(grad_v, votes, coupling_bias_in, s_hist, squash,
                                               eps);
  const at::Tensor coupling_bias = acc_parameter(coupling_bias_in, acc_dtype(votes.scalar_type()));
  const Nonlinearity f = self_attention_squash(squash);
  RuleParameterGrads wanted;
  wanted.coupling_bias = coupling_bias.defined();
  const RuleRoutingGradients grads = rule_routing_backward(
      kOp, grad_v, votes, s_hist, eps, wanted,
      [&](auto acc) { return rule_of<decltype(acc)>(votes, f, coupling_bias); });
  // Zeros without a coupling bias (the Python layer drops them).
  return {grads.votes, wanted.coupling_bias
                           ? grads.coupling_bias.to(votes.scalar_type())
                           : at::zeros({votes.size(1), votes.size(2)}, votes.options())};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("self_attention_routing", &cuda::self_attention_routing_cuda);
  m.impl("_self_attention_routing_backward", &cuda::self_attention_routing_backward_cuda);
}

}  // namespace capsroute
