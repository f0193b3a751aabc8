// inverted_attention_routing on the CPU: the agreement routing of agreement_routing.h under
// inverted_attention_rule (csrc/common/agreement_rules.h).
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "agreement_routing.h"

namespace capsroute {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_cpu(
    const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, int64_t iters, double eps, bool couplings) {
  check_inverted_attention_routing_inputs(votes, norm_weight, norm_bias, iters, eps);
  record_kernel_path("inverted_attention_routing", Direction::forward, "cpu");
  return cpu::route_votes(votes, at::Tensor(),
                          inverted_attention_rule_tensors(votes.size(3), norm_weight, norm_bias),
                          iters,
                          /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_backward_cpu(
    const at::Tensor& grad_v, const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, const at::Tensor& s_hist, double eps) {
  check_inverted_attention_routing_backward_inputs(grad_v, votes, norm_weight, norm_bias, s_hist,
                                                   eps);
  record_kernel_path("inverted_attention_routing", Direction::backward, "cpu");
  const RoutingGrads grads = cpu::route_votes_backward(
      grad_v, votes, s_hist, inverted_attention_rule_tensors(votes.size(3), norm_weight, norm_bias),
      /*leaky=*/false, /*detach=*/false, eps);
  return {grads.votes, grads.norm_weight, grads.norm_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("inverted_attention_routing", &inverted_attention_routing_cpu);
  m.impl("_inverted_attention_routing_backward", &inverted_attention_routing_backward_cpu);
}

}  // namespace capsroute
