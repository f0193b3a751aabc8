// self_attention_routing on the CPU: the agreement routing of agreement_routing.h under
// self_attention_rule (csrc/common/agreement_rules.h).
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "agreement_routing.h"

namespace capsroute {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> self_attention_routing_cpu(
    const at::Tensor& votes, const std::optional<at::Tensor>& coupling_bias,
    std::string_view squash, double eps, bool couplings) {
  check_self_attention_routing_inputs(votes, coupling_bias, squash, eps);
  record_kernel_path("self_attention_routing", Direction::forward, "cpu");
  return cpu::route_votes(
      votes, at::Tensor(),
      self_attention_rule_tensors(votes.size(2), votes.size(3), coupling_bias, squash),
      kSelfAttentionPasses, /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor> self_attention_routing_backward_cpu(
    const at::Tensor& grad_v, const at::Tensor& votes,
    const std::optional<at::Tensor>& coupling_bias, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_self_attention_routing_backward_inputs(grad_v, votes, coupling_bias, s_hist, squash, eps);
  record_kernel_path("self_attention_routing", Direction::backward, "cpu");
  const RoutingGrads grads = cpu::route_votes_backward(
      grad_v, votes, s_hist,
      self_attention_rule_tensors(votes.size(2), votes.size(3), coupling_bias, squash),
      /*leaky=*/false, /*detach=*/false, eps);
  return {grads.votes, grads.coupling_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("self_attention_routing", &self_attention_routing_cpu);
  m.impl("_self_attention_routing_backward", &self_attention_routing_backward_cpu);
}

}  // namespace capsroute
