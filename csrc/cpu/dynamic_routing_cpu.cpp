#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "route_elements.h"

namespace capsroute {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dynamic_routing_cpu(
    const at::Tensor& votes_in, const std::optional<at::Tensor>& bias_in, int64_t iters, bool leaky,
    bool /*detach: backward only*/, double eps) {
  check_dynamic_routing_inputs(votes_in, bias_in, iters, eps);
  record_kernel_path("dynamic_routing", Direction::forward, "cpu");
  const at::Tensor votes = with_contiguous_capsules(votes_in);
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t B = votes.size(0);
  const RoutingDims dims{B, votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  at::Tensor v = at::empty({B, dims.J, dims.D}, votes.options());
  at::Tensor c = at::empty({B, dims.I, dims.J}, votes.options());
  at::Tensor s_hist =
      at::empty({B, iters, dims.J, dims.D}, votes.options().dtype(acc_dtype(votes.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "dynamic_routing_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        cpu::route_elements(votes.const_data_ptr<scalar_t>(), strides,
                            bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr, dims,
                            static_cast<acc_t>(eps), s_hist.mutable_data_ptr<acc_t>(),
                            v.mutable_data_ptr<scalar_t>(), c.mutable_data_ptr<scalar_t>());
      });
  return {v, c, s_hist};
}

std::tuple<at::Tensor, at::Tensor> dynamic_routing_backward_cpu(const at::Tensor& grad_v_in,
                                                                const at::Tensor& votes_in,
                                                                const at::Tensor& s_hist_in,
                                                                bool leaky, bool detach,
                                                                double eps) {
  check_dynamic_routing_backward_inputs(grad_v_in, votes_in, s_hist_in, eps);
  record_kernel_path("dynamic_routing", Direction::backward, "cpu");
  const int64_t B = votes_in.size(0);
  const RoutingDims dims{
      B, votes_in.size(1), votes_in.size(2), votes_in.size(3), s_hist_in.size(1), leaky};
  const at::Tensor votes = with_contiguous_capsules(votes_in);
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  // In the accumulation dtype: a float16 storage dtype would turn a gradient above 65504 into inf.
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  at::Tensor grad_votes = empty_capsule_gradient(votes, 1);
  // Per-item bias gradients, summed afterwards in a fixed order so results are deterministic.
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "dynamic_routing_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        cpu::route_elements_backward(
            votes.const_data_ptr<scalar_t>(), strides, grad_v.const_data_ptr<acc_t>(),
            s_hist.const_data_ptr<acc_t>(), dims, static_cast<acc_t>(eps), detach,
            grad_bias_items.mutable_data_ptr<acc_t>(), grad_votes.mutable_data_ptr<scalar_t>(),
            capsule_strides(grad_votes, 3));
      });
  return {grad_votes, grad_bias_items.sum(0).to(votes.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dynamic_routing", &dynamic_routing_cpu);
  m.impl("_dynamic_routing_backward", &dynamic_routing_backward_cpu);
}

}  // namespace capsroute
