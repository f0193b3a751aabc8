#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "routing_element.h"

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
        const scalar_t* u = votes.const_data_ptr<scalar_t>();
        const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
        cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            cpu::ForwardScratch<acc_t> scratch(dims);
            std::vector<scalar_t> slab;
            for (int64_t n = begin; n < end; ++n) {
              cpu::route_forward<decltype(capsule_dim)::value>(
                  cpu::staged_element_votes(u, strides, n, dims.I, dims.J, dims.D, slab), b, dims,
                  static_cast<acc_t>(eps), scratch,
                  s_hist.mutable_data_ptr<acc_t>() + n * iters * dims.jd(),
                  v.mutable_data_ptr<scalar_t>() + n * dims.jd(),
                  c.mutable_data_ptr<scalar_t>() + n * dims.I * dims.J);
            }
          });
        });
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
  const CapsuleStrides grad_strides = capsule_strides(grad_votes, 3);
  // Per-item bias gradients, summed afterwards in a fixed order so results are deterministic.
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "dynamic_routing_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* u = votes.const_data_ptr<scalar_t>();
        const acc_t* g_v = grad_v.const_data_ptr<acc_t>();
        cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            cpu::RoutingBackward<decltype(capsule_dim)::value, acc_t> backward(
                dims, static_cast<acc_t>(eps), detach);
            std::vector<acc_t> state_storage(cpu::BackwardState<acc_t>::numel(dims)),
                g_u(dims.jd());
            const cpu::BackwardState<acc_t> state(state_storage.data(), dims);
            std::vector<scalar_t> slab;
            for (int64_t n = begin; n < end; ++n) {
              backward.run(cpu::staged_element_votes(u, strides, n, dims.I, dims.J, dims.D, slab),
                           g_v + n * dims.jd(),
                           s_hist.const_data_ptr<acc_t>() + n * dims.iters * dims.jd(),
                           grad_bias_items.mutable_data_ptr<acc_t>() + n * dims.jd(), state);
              for (int64_t i = 0; i < dims.I; ++i) {
                backward.vote_grad_row(state, i, g_u.data());
                store_capsule_row(g_u.data(), dims.J, dims.D, grad_strides, n, i,
                                  grad_votes.mutable_data_ptr<scalar_t>());
              }
            }
          });
        });
      });
  return {grad_votes, grad_bias_items.sum(0).to(votes.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dynamic_routing", &dynamic_routing_cpu);
  m.impl("_dynamic_routing_backward", &dynamic_routing_backward_cpu);
}

}  // namespace capsroute
