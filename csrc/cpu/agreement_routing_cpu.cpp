// route_votes and route_votes_backward (agreement_routing.h): the element loops of
// route_elements.h on the CPU, in every storage dtype, compiled once for the three routings.
#include "agreement_routing.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include "../common/checks.h"
#include "../common/layout.h"
#include "route_elements.h"

namespace capsroute {
namespace cpu {
namespace {

// The rule's parameters in the accumulation dtype, contiguous, and the rule that reads them.
struct AccParameters {
  AccParameters(const RuleTensors& rule, at::ScalarType acc)
      : rule_(rule.rule),
        coupling_bias_(to_acc(rule.coupling_bias, acc)),
        norm_weight_(to_acc(rule.norm_weight, acc)),
        norm_bias_(to_acc(rule.norm_bias, acc)) {}

  template <typename acc_t>
  RoutingRule<acc_t> rule() const {
    RoutingRule<acc_t> rule;
    rule.logits = rule_.logits;
    rule.nonlinearity = rule_.nonlinearity;
    rule.logit_scale = static_cast<acc_t>(rule_.logit_scale);
    rule.coupling_bias = data_or_null<acc_t>(coupling_bias_);
    rule.norm_weight = data_or_null<acc_t>(norm_weight_);
    rule.norm_bias = data_or_null<acc_t>(norm_bias_);
    return rule;
  }

 private:
  static at::Tensor to_acc(const at::Tensor& t, at::ScalarType acc) {
    return t.defined() ? t.to(acc).contiguous() : t;
  }
  template <typename acc_t>
  static const acc_t* data_or_null(const at::Tensor& t) {
    return t.defined() ? t.const_data_ptr<acc_t>() : nullptr;
  }

  RoutingRule<double> rule_;
  at::Tensor coupling_bias_, norm_weight_, norm_bias_;
};

template <typename acc_t>
acc_t* mutable_data_or_null(at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<acc_t>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_votes(const at::Tensor& votes_in,
                                                           const at::Tensor& bias_in,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps) {
  const at::Tensor votes = with_contiguous_capsules(votes_in);
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const int64_t B = votes.size(0);
  const RoutingDims dims{B, votes.size(1), votes.size(2), votes.size(3), iters, leaky};
  const at::ScalarType acc = acc_dtype(votes.scalar_type());
  const AccParameters params(rule, acc);
  at::Tensor v = at::empty({B, dims.J, dims.D}, votes.options());
  at::Tensor c = at::empty({B, dims.I, dims.J}, votes.options());
  at::Tensor s_hist = at::empty({B, iters, dims.J, dims.D}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "route_votes_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        route_elements(votes.const_data_ptr<scalar_t>(), strides,
                       bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr,
                       params.rule<acc_t>(), dims, static_cast<acc_t>(eps),
                       s_hist.mutable_data_ptr<acc_t>(), v.mutable_data_ptr<scalar_t>(),
                       c.mutable_data_ptr<scalar_t>());
      });
  return {v, c, s_hist};
}

RoutingGrads route_votes_backward(const at::Tensor& grad_v_in, const at::Tensor& votes_in,
                                  const at::Tensor& s_hist_in, const RuleTensors& rule,
                                  bool with_bias, bool leaky, bool detach, double eps) {
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
  at::Tensor grad_votes = empty_capsule_gradient(votes, 1);
  // Per-element parameter gradients, summed afterwards in a fixed order so results are
  // deterministic; none for an absent parameter.
  const auto items = [&](bool wanted, at::IntArrayRef shape) {
    std::vector<int64_t> sizes{B};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    return wanted ? at::zeros(sizes, votes.options().dtype(acc)) : at::Tensor();
  };
  const std::vector<int64_t> jd{dims.J, dims.D}, ij{dims.I, dims.J}, d{dims.D};
  at::Tensor bias_items = items(with_bias, jd);
  at::Tensor coupling_bias_items = items(rule.coupling_bias.defined(), ij);
  at::Tensor norm_weight_items = items(rule.norm_weight.defined(), d);
  at::Tensor norm_bias_items = items(rule.norm_bias.defined(), d);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "route_votes_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const ParameterGrads<acc_t> grad_items{mutable_data_or_null<acc_t>(bias_items),
                                               mutable_data_or_null<acc_t>(coupling_bias_items),
                                               mutable_data_or_null<acc_t>(norm_weight_items),
                                               mutable_data_or_null<acc_t>(norm_bias_items)};
        route_elements_backward(votes.const_data_ptr<scalar_t>(), strides,
                                grad_v.const_data_ptr<acc_t>(), s_hist.const_data_ptr<acc_t>(),
                                params.rule<acc_t>(), dims, static_cast<acc_t>(eps), detach,
                                grad_items, grad_votes.mutable_data_ptr<scalar_t>(),
                                capsule_strides(grad_votes, 3));
      });
  const auto total = [&](const at::Tensor& items, at::IntArrayRef shape) {
    return items.defined() ? items.sum(0).to(votes.scalar_type())
                           : at::zeros(shape, votes.options());
  };
  return {grad_votes, total(bias_items, jd), total(coupling_bias_items, ij),
          total(norm_weight_items, d), total(norm_bias_items, d)};
}

}  // namespace cpu
}  // namespace capsroute
