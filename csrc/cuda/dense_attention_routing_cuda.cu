// dense_self_attention_routing and dense_inverted_attention_routing on CUDA: dense_routing.cuh (the
// votes weight_ij @ u_i by GEMM a chunk of the batch at a time, as dense_capsules computes them)
// under the attention routings' rules (routing_rule.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string_view>

#include "../common/checks.h"
#include "dense_routing.cuh"

namespace capsroute {
namespace cuda {
namespace {

// weight (I, J, D, Din); the rules' parameters in the accumulation dtype (acc_parameter).
template <typename acc_t>
RoutingRule<acc_t> self_attention_rule_of(const at::Tensor& weight, Nonlinearity squash,
                                          const at::Tensor& coupling_bias) {
  return self_attention_rule(weight.size(1), weight.size(2), squash,
                             parameter_data<acc_t>(coupling_bias));
}

template <typename acc_t>
RoutingRule<acc_t> inverted_attention_rule_of(const at::Tensor& weight,
                                              const at::Tensor& norm_weight,
                                              const at::Tensor& norm_bias) {
  return inverted_attention_rule(weight.size(2), parameter_data<acc_t>(norm_weight),
                                 parameter_data<acc_t>(norm_bias));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_self_attention_routing_cuda(
    const at::Tensor& u, const at::Tensor& weight,
    const std::optional<at::Tensor>& coupling_bias_in, std::string_view squash, double eps) {
  check_dense_self_attention_routing_inputs(u, weight, coupling_bias_in, squash, eps);
  const at::Tensor coupling_bias = acc_parameter(coupling_bias_in, acc_dtype(u.scalar_type()));
  const Nonlinearity f = self_attention_squash(squash);
  return dense_routing_forward(
      "dense_self_attention_routing", u, weight, at::Tensor(), kSelfAttentionPasses,
      /*leaky=*/false, eps,
      [&](auto acc) { return self_attention_rule_of<decltype(acc)>(weight, f, coupling_bias); });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_self_attention_routing_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const std::optional<at::Tensor>& coupling_bias_in, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_dense_self_attention_routing_backward_inputs(grad_v, u, weight, coupling_bias_in, s_hist,
                                                     squash, eps);
  const at::Tensor coupling_bias = acc_parameter(coupling_bias_in, acc_dtype(u.scalar_type()));
  const Nonlinearity f = self_attention_squash(squash);
  RuleParameterGrads wanted;
  wanted.coupling_bias = coupling_bias.defined();
  const DenseRoutingGradients grads = dense_routing_backward(
      "dense_self_attention_routing", grad_v, u, weight, s_hist, /*leaky=*/false,
      /*detach=*/false, eps, wanted,
      [&](auto acc) { return self_attention_rule_of<decltype(acc)>(weight, f, coupling_bias); });
  // Zeros without a coupling bias (the Python layer drops them).
  return {grads.u, grads.weight,
          wanted.coupling_bias ? grads.rule.coupling_bias.to(u.scalar_type())
                               : at::zeros({weight.size(0), weight.size(1)}, u.options())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_inverted_attention_routing_cuda(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& norm_weight_in,
    const std::optional<at::Tensor>& norm_bias_in, int64_t iters, double eps) {
  check_dense_inverted_attention_routing_inputs(u, weight, norm_weight_in, norm_bias_in, iters,
                                                eps);
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  const at::Tensor norm_weight = acc_parameter(norm_weight_in, acc),
                   norm_bias = acc_parameter(norm_bias_in, acc);
  return dense_routing_forward("dense_inverted_attention_routing", u, weight, at::Tensor(), iters,
                               /*leaky=*/false, eps, [&](auto acc_value) {
                                 return inverted_attention_rule_of<decltype(acc_value)>(
                                     weight, norm_weight, norm_bias);
                               });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
dense_inverted_attention_routing_backward_cuda(const at::Tensor& grad_v, const at::Tensor& u,
                                               const at::Tensor& weight,
                                               const std::optional<at::Tensor>& norm_weight_in,
                                               const std::optional<at::Tensor>& norm_bias_in,
                                               const at::Tensor& s_hist, double eps) {
  check_dense_inverted_attention_routing_backward_inputs(grad_v, u, weight, norm_weight_in,
                                                         norm_bias_in, s_hist, eps);
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  const at::Tensor norm_weight = acc_parameter(norm_weight_in, acc),
                   norm_bias = acc_parameter(norm_bias_in, acc);
  RuleParameterGrads wanted;
  wanted.norm_weight = norm_weight.defined();
  wanted.norm_bias = norm_bias.defined();
  const DenseRoutingGradients grads = dense_routing_backward(
      "dense_inverted_attention_routing", grad_v, u, weight, s_hist, /*leaky=*/false,
      /*detach=*/false, eps, wanted, [&](auto acc_value) {
        return inverted_attention_rule_of<decltype(acc_value)>(weight, norm_weight, norm_bias);
      });
  // Zeros where a parameter is absent (the Python layer drops them).
  const auto parameter_grad = [&](const at::Tensor& g) {
    return g.defined() ? g.to(u.scalar_type()) : at::zeros({weight.size(2)}, u.options());
  };
  return {grads.u, grads.weight, parameter_grad(grads.rule.norm_weight),
          parameter_grad(grads.rule.norm_bias)};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("dense_self_attention_routing", &cuda::dense_self_attention_routing_cuda);
  m.impl("_dense_self_attention_routing_backward",
         &cuda::dense_self_attention_routing_backward_cuda);
  m.impl("dense_inverted_attention_routing", &cuda::dense_inverted_attention_routing_cuda);
  m.impl("_dense_inverted_attention_routing_backward",
         &cuda::dense_inverted_attention_routing_backward_cuda);
}

}  // namespace capsroute
