// dynamic_routing on the CPU: the agreement routing of agreement_routing.h under the default rule
// (accumulated logits, squash).
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "agreement_routing.h"

namespace capsroute {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_routing_cpu(
    const at::Tensor& votes, const std::optional<at::Tensor>& bias, int64_t iters, bool leaky,
    bool /*detach: backward only*/, double eps, bool couplings) {
  check_dynamic_routing_inputs(votes, bias, iters, eps);
  record_kernel_path("dynamic_routing", Direction::forward, "cpu");
  return cpu::route_votes(votes, bias.value_or(at::Tensor()), RuleTensors{}, iters, leaky, eps,
                          couplings);
}

std::tuple<at::Tensor, at::Tensor> dynamic_routing_backward_cpu(const at::Tensor& grad_v,
                                                                const at::Tensor& votes,
                                                                const at::Tensor& s_hist,
                                                                bool leaky, bool detach,
                                                                double eps) {
  check_dynamic_routing_backward_inputs(grad_v, votes, s_hist, eps);
  record_kernel_path("dynamic_routing", Direction::backward, "cpu");
  const RoutingGrads grads =
      cpu::route_votes_backward(grad_v, votes, s_hist, RuleTensors{}, leaky, detach, eps);
  return {grads.votes, grads.bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dynamic_routing", &dynamic_routing_cpu);
  m.impl("_dynamic_routing_backward", &dynamic_routing_backward_cpu);
}

}  // namespace capsroute
