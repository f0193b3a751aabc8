// dynamic_routing on CUDA: agreement_routing.cuh under dynamic routing's rule (RuleTensors{}),
// votes read in place.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "agreement_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "dynamic_routing";

std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_routing_cuda(
    const at::Tensor& votes, const std::optional<at::Tensor>& bias, int64_t iters, bool leaky,
    bool /*detach: backward only*/, double eps, bool couplings) {
  check_dynamic_routing_inputs(votes, bias, iters, eps);
  return route_votes(kOp, votes, bias.value_or(at::Tensor()), RuleTensors{}, iters, leaky, eps,
                     couplings);
}

std::tuple<at::Tensor, at::Tensor> dynamic_routing_backward_cuda(const at::Tensor& grad_v,
                                                                 const at::Tensor& votes,
                                                                 const at::Tensor& s_hist,
                                                                 bool leaky, bool detach,
                                                                 double eps) {
  check_dynamic_routing_backward_inputs(grad_v, votes, s_hist, eps);
  const RoutingGrads grads =
      route_votes_backward(kOp, grad_v, votes, s_hist, RuleTensors{}, leaky, detach, eps);
  return {grads.votes, grads.bias};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("dynamic_routing", &cuda::dynamic_routing_cuda);
  m.impl("_dynamic_routing_backward", &cuda::dynamic_routing_backward_cuda);
}

}  // namespace capsroute
