// route_votes and route_votes_backward (agreement_routing.h): the element loops of
// agreement_batch.h on the CPU, in every storage dtype, compiled once for the three routings.
#include "agreement_routing.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include "../common/checks.h"
#include "../common/layout.h"
#include "agreement_batch.h"
#include "output_cache.h"

namespace capsroute {
namespace cpu {

at::Tensor empty_couplings(bool couplings, const RoutingDims& dims,
                           const at::TensorOptions& options) {
  return couplings ? empty_output({dims.B, dims.I, dims.J}, options) : at::empty({0}, options);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(const at::Tensor& votes_in,
                                                           const at::Tensor& bias_in,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps, bool couplings) {
  const at::Tensor votes = with_contiguous_capsules(votes_in);
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const int64_t B = votes.size(0);
  const RoutingDims dims{B, votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  const AccParameters params(rule, acc);
  at::Tensor v = empty_output({B, dims.J, dims.D}, votes.options());
  at::Tensor c = empty_couplings(couplings, dims, votes.options());
  at::Tensor s_hist = empty_output({B, iters, dims.J, dims.D}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "route_votes_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        route_elements(votes.const_data_ptr<scalar_t>(), strides,
                       bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                       params.rule<acc_t>(), dims, static_cast<acc_t>(eps),
                       s_hist.mutable_data_ptr<acc_t>(), v.mutable_data_ptr<scalar_t>(),
                       couplings ? c.mutable_data_ptr<scalar_t>() : nullptr);
      });
  return {v, c, s_hist};
}

RoutingGrads route_votes_backward(const at::Tensor& grad_v_in, const at::Tensor& votes_in,
                                  const at::Tensor& s_hist_in, const RuleTensors& rule, bool leaky,
                                  bool detach, double eps) {
  const int64_t B = votes_in.size(0);
  const RoutingDims dims{
      B, votes_in.size(1), votes_in.size(2), votes_in.size(3), s_hist_in.size(1), leaky};
  const at::Tensor votes = with_contiguous_capsules(votes_in);
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  // In the accumulation dtype: a float16 storage dtype would turn a gradient above 65504 into inf.
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  const AccParameters params(rule, acc);
  RoutingGrads grads{empty_capsule_gradient(votes, 1)};
  ParameterGradItems items(rule, dims, /*norm_rows=*/1, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "route_votes_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        route_elements_backward(votes.const_data_ptr<scalar_t>(), strides,
                                grad_v.const_data_ptr<acc_t>(), s_hist.const_data_ptr<acc_t>(),
                                params.rule<acc_t>(), dims, static_cast<acc_t>(eps), detach,
                                item_data<acc_t>(items), grads.votes.mutable_data_ptr<scalar_t>(),
                                capsule_strides(grads.votes, 3));
      });
  items.sum_into(rule, grads, votes.scalar_type());
  return grads;
}

}  // namespace cpu
}  // namespace capsroute
