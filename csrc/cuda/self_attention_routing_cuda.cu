// self_attention_routing on CUDA: agreement_routing.cuh under the agree_with_mean rule
// (agreement_rules.h): a uniformly coupled pass taken as it is, then couplings from each vote's
// agreement with it, plus the coupling bias, and a squash.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string_view>

#include "../common/checks.h"
#include "agreement_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "self_attention_routing";

std::tuple<at::Tensor, at::Tensor, at::Tensor> self_attention_routing_cuda(
    const at::Tensor& votes, const std::optional<at::Tensor>& coupling_bias,
    std::string_view squash, double eps, bool couplings) {
  check_self_attention_routing_inputs(votes, coupling_bias, squash, eps);
  return route_votes(
      kOp, votes, at::Tensor(),
      self_attention_rule_tensors(votes.size(2), votes.size(3), coupling_bias, squash),
      kSelfAttentionPasses, /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor> self_attention_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& votes,
    const std::optional<at::Tensor>& coupling_bias, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_self_attention_routing_backward_inputs(grad_v, votes, coupling_bias, s_hist, squash, eps);
  const RoutingGrads grads = route_votes_backward(
      kOp, grad_v, votes, s_hist,
      self_attention_rule_tensors(votes.size(2), votes.size(3), coupling_bias, squash),
      /*leaky=*/false, /*detach=*/false, eps);
  return {grads.votes, grads.coupling_bias};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("self_attention_routing", &cuda::self_attention_routing_cuda);
  m.impl("_self_attention_routing_backward", &cuda::self_attention_routing_backward_cuda);
}

}  // namespace capsroute
