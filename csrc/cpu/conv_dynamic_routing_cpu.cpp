// conv_dynamic_routing on the CPU: the chunked votes of csrc/common/conv_capsules.h, each chunk's
// output positions routed as elements by dynamic_routing's element code (agreement_batch.h).
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/conv_capsules.h"
#include "agreement_batch.h"

namespace capsroute {
namespace {

// votes (count, C_in, C_out, D), contiguous.
CapsuleStrides chunk_strides(const RoutingDims& dims) {
  return {dims.I * dims.jd(), dims.jd(), dims.D};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_cpu(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t iters, int64_t stride, int64_t padding, bool leaky, bool /*detach: backward only*/,
    double eps) {
  check_conv_dynamic_routing_inputs(u, weight, bias, iters, stride, padding, eps);
  return conv_dynamic_routing_forward(
      u, weight, bias, iters, stride, padding, leaky, "",
      [&](const at::Tensor& votes, const at::Tensor& bias_acc, const RoutingDims& dims,
          at::Tensor s_hist, at::Tensor v, at::Tensor c) {
        AT_DISPATCH_FLOATING_TYPES(votes.scalar_type(), "conv_dynamic_routing_cpu", [&] {
          cpu::route_elements(votes.const_data_ptr<scalar_t>(), chunk_strides(dims),
                              bias_acc.defined() ? bias_acc.const_data_ptr<scalar_t>() : nullptr,
                              RoutingRule<scalar_t>{}, dims, static_cast<scalar_t>(eps),
                              s_hist.mutable_data_ptr<scalar_t>(), v.mutable_data_ptr<scalar_t>(),
                              c.mutable_data_ptr<scalar_t>());
        });
        return std::string("cpu");
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_backward_cpu(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const at::Tensor& s_hist, int64_t stride, int64_t padding, bool leaky, bool detach,
    double eps) {
  check_conv_dynamic_routing_backward_inputs(grad_v, u, weight, s_hist, stride, padding, eps);
  return conv_dynamic_routing_backward(
      grad_v, u, weight, s_hist, stride, padding, leaky, "",
      [&](const at::Tensor& votes, const at::Tensor& g_v, const at::Tensor& s_hist_chunk,
          const RoutingDims& dims, at::Tensor grad_bias_items, at::Tensor grad_votes) {
        AT_DISPATCH_FLOATING_TYPES(votes.scalar_type(), "conv_dynamic_routing_backward_cpu", [&] {
          cpu::route_elements_backward(
              votes.const_data_ptr<scalar_t>(), chunk_strides(dims), g_v.const_data_ptr<scalar_t>(),
              s_hist_chunk.const_data_ptr<scalar_t>(), RoutingRule<scalar_t>{}, dims,
              static_cast<scalar_t>(eps), detach,
              cpu::ParameterGrads<scalar_t>{grad_bias_items.mutable_data_ptr<scalar_t>()},
              grad_votes.mutable_data_ptr<scalar_t>(), chunk_strides(dims));
        });
        return std::string("cpu");
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("conv_dynamic_routing", &conv_dynamic_routing_cpu);
  m.impl("_conv_dynamic_routing_backward", &conv_dynamic_routing_backward_cpu);
}

}  // namespace capsroute
