// inverted_attention_routing on CUDA: agreement_routing.cuh under the replace rule
// (agreement_rules.h): each pass's couplings from the softmax of the previous output's agreement
// alone, and a LayerNorm over D with its optional affine parameters.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "agreement_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "inverted_attention_routing";

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_cuda(
    const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, int64_t iters, double eps, bool couplings) {
  check_inverted_attention_routing_inputs(votes, norm_weight, norm_bias, iters, eps);
  return route_votes(kOp, votes, at::Tensor(),
                     inverted_attention_rule_tensors(votes.size(3), norm_weight, norm_bias), iters,
                     /*leaky=*/false, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverted_attention_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, const at::Tensor& s_hist, double eps) {
  check_inverted_attention_routing_backward_inputs(grad_v, votes, norm_weight, norm_bias, s_hist,
                                                   eps);
  const RoutingGrads grads =
      route_votes_backward(kOp, grad_v, votes, s_hist,
                           inverted_attention_rule_tensors(votes.size(3), norm_weight, norm_bias),
                           /*leaky=*/false, /*detach=*/false, eps);
  return {grads.votes, grads.norm_weight, grads.norm_bias};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("inverted_attention_routing", &cuda::inverted_attention_routing_cuda);
  m.impl("_inverted_attention_routing_backward", &cuda::inverted_attention_routing_backward_cuda);
}

}  // namespace capsroute
