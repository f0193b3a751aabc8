// dense_capsules on the CPU: each thread computes one element's votes weight_ij @ u_i into a
// slab of its own (I*J*D, cache-sized for typical shapes) and routes on it; the backward
// recomputes the slab instead of keeping votes from the forward, then contracts the vote
// gradients per input capsule. The votes are computed from the weight laid out as
// (I, Din, J*D), so that their loops run over contiguous J*D rows.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "routing_element.h"

namespace capsroute {
namespace {

// weight (I, J, D, Din) -> (I, Din, J, D)
at::Tensor weight_by_input_dim(const at::Tensor& weight) { return weight.permute({0, 3, 1, 2}).contiguous(); }

// votes (I, J*D) of one element from u (I, Din) and weight_t (I, Din, J*D).
template <typename scalar_t, typename acc_t>
void compute_votes(const scalar_t* u, const scalar_t* weight_t, const cpu::RoutingDims& d, int64_t Din, acc_t* votes) {
  const int64_t JD = d.jd();
  for (int64_t i = 0; i < d.I; ++i) {
    acc_t* vi = votes + i * JD;
    std::fill(vi, vi + JD, acc_t(0));
    for (int64_t k = 0; k < Din; ++k) {
      const acc_t x = static_cast<acc_t>(u[i * Din + k]);
      const scalar_t* w = weight_t + (i * Din + k) * JD;
#pragma omp simd
      for (int64_t jd = 0; jd < JD; ++jd) vi[jd] += x * static_cast<acc_t>(w[jd]);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_cpu(const at::Tensor& u_in, const at::Tensor& weight_in,
                                                                  const c10::optional<at::Tensor>& bias_in, int64_t iters,
                                                                  bool leaky, bool /*detach: backward only*/, double eps) {
  check_dense_capsules_inputs(u_in, weight_in, bias_in, iters, eps);
  const at::Tensor u = u_in.contiguous();
  const at::Tensor weight_t = weight_by_input_dim(weight_in);
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t B = u.size(0), Din = u.size(2);
  const cpu::RoutingDims dims{weight_in.size(0), weight_in.size(1), weight_in.size(2), iters, leaky};
  at::Tensor v = at::empty({B, dims.J, dims.D}, u.options());
  at::Tensor c = at::empty({B, dims.I, dims.J}, u.options());
  at::Tensor s_hist = at::empty({B, iters, dims.J, dims.D}, u.options().dtype(acc_dtype(u.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "dense_capsules_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* x = u.const_data_ptr<scalar_t>();
    const scalar_t* w = weight_t.const_data_ptr<scalar_t>();
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        cpu::ForwardScratch<acc_t> scratch(dims);
        std::vector<acc_t> votes(dims.I * dims.jd());
        for (int64_t n = begin; n < end; ++n) {
          compute_votes(x + n * dims.I * Din, w, dims, Din, votes.data());
          cpu::route_forward<decltype(capsule_dim)::value>(
              votes.data(), b, dims, static_cast<acc_t>(eps), scratch, s_hist.data_ptr<acc_t>() + n * iters * dims.jd(),
              v.data_ptr<scalar_t>() + n * dims.jd(), c.data_ptr<scalar_t>() + n * dims.I * dims.J);
        }
      });
    });
  });
  return {v, c, s_hist};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_backward_cpu(const at::Tensor& grad_v_in, const at::Tensor& u_in,
                                                                           const at::Tensor& weight_in, const at::Tensor& s_hist_in,
                                                                           bool leaky, bool detach, double eps) {
  check_dense_capsules_backward_inputs(grad_v_in, u_in, weight_in, s_hist_in, eps);
  const int64_t B = u_in.size(0), Din = u_in.size(2);
  const cpu::RoutingDims dims{weight_in.size(0), weight_in.size(1), weight_in.size(2), s_hist_in.size(1), leaky};
  const at::Tensor u = u_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor weight_t = weight_by_input_dim(weight);
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  const at::Tensor grad_v = grad_v_in.to(u.scalar_type()).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  const int64_t JD = dims.jd();
  at::Tensor grad_u = at::empty_like(u);
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, u.options().dtype(acc));
  at::Tensor grad_weight = at::zeros(weight.sizes(), u.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "dense_capsules_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using State = cpu::BackwardState<acc_t>;
    const scalar_t* x = u.const_data_ptr<scalar_t>();
    const scalar_t* w = weight.const_data_ptr<scalar_t>();
    const scalar_t* w_t = weight_t.const_data_ptr<scalar_t>();
    const scalar_t* g_v = grad_v.const_data_ptr<scalar_t>();
    // The backward state of every element (about a third of the votes' size at iters = 3).
    at::Tensor states = at::empty({B, State::numel(dims)}, u.options().dtype(acc));
    acc_t* states_p = states.data_ptr<acc_t>();
    cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
      using Backward = cpu::RoutingBackward<decltype(capsule_dim)::value, acc_t>;
      // 1. Routing backward per element, on votes recomputed into a per-thread slab.
      at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
        Backward backward(dims, static_cast<acc_t>(eps), detach);
        std::vector<acc_t> votes(dims.I * JD);
        for (int64_t n = begin; n < end; ++n) {
          compute_votes(x + n * dims.I * Din, w_t, dims, Din, votes.data());
          backward.run(votes.data(), g_v + n * JD, s_hist.const_data_ptr<acc_t>() + n * dims.iters * JD,
                       grad_bias_items.data_ptr<acc_t>() + n * JD, State(states_p + n * State::numel(dims), dims));
        }
      });
      // 2. Contract the vote gradients per input capsule: grad_u[n, i] = weight_i^T g_u[n, i] and
      //    grad_weight[i] = sum_n g_u[n, i] u[n, i]^T, the batch summed in order (deterministic).
      at::parallel_for(0, dims.I, 1, [&](int64_t begin, int64_t end) {
        const Backward backward(dims, static_cast<acc_t>(eps), detach);
        std::vector<acc_t> g_vote(JD), g_x(Din);
        for (int64_t i = begin; i < end; ++i) {
          const scalar_t* w_i = w + i * JD * Din;
          acc_t* g_w_i = grad_weight.data_ptr<acc_t>() + i * JD * Din;
          for (int64_t n = 0; n < B; ++n) {
            backward.vote_grad_row(State(states_p + n * State::numel(dims), dims), i, g_vote.data());
            const scalar_t* x_ni = x + (n * dims.I + i) * Din;
            std::fill(g_x.begin(), g_x.end(), acc_t(0));
            for (int64_t jd = 0; jd < JD; ++jd) {
              const acc_t g = g_vote[jd];
              const scalar_t* w_row = w_i + jd * Din;
              acc_t* g_w_row = g_w_i + jd * Din;
              _Pragma("omp simd")  // (inside a macro argument: no #pragma)
              for (int64_t k = 0; k < Din; ++k) {
                g_x[k] += static_cast<acc_t>(w_row[k]) * g;
                g_w_row[k] += g * static_cast<acc_t>(x_ni[k]);
              }
            }
            scalar_t* g_u_ni = grad_u.data_ptr<scalar_t>() + (n * dims.I + i) * Din;
            for (int64_t k = 0; k < Din; ++k) g_u_ni[k] = static_cast<scalar_t>(g_x[k]);
          }
        }
      });
    });
  });
  return {grad_u, grad_weight.to(u.scalar_type()), grad_bias_items.sum(0).to(u.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dense_capsules", &dense_capsules_cpu);
  m.impl("_dense_capsules_backward", &dense_capsules_backward_cpu);
}

}  // namespace capsroute
