// conv_em_routing on the CPU (docs/ops.md, conv_em_routing): EM routing in a convolutional capsule
// layer whose E-step normalises each child's assignments over every parent of every window that
// contains it. The M-steps run a window at a time (em_element.h's, on the window's votes computed
// into a per-thread slab); the E-steps run a child at a time, gathering the child's log-posteriors
// from every window that contains it into its log-sum-exp Z. The assignments are never stored:
// R_ij = exp(L_ij - Z_i) is recomputed from the parents' statistics and Z wherever it is needed.
// Every sum has one writer, in a fixed order: deterministic for any number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/checks.h"
#include "../common/conv_em_math.h"
#include "../common/kernel_path.h"
#include "em_element.h"

namespace capsroute {
namespace {

using cpu::EmElement;
using cpu::Vec;

constexpr int64_t kWeightChunks = 16;  // fixed chunks of the weight gradient's sum

// Where things are: children (B, H, W, C_in), windows (B, Ho, Wo), and per window and iteration
// rows of C_out parents.
template <typename scalar_t, typename acc_t>
struct ConvEmLayout {
  ConvEmDims d;
  int64_t Ho, Wo;
  const scalar_t* pose;    // (B, H, W, C_in, 16)
  const scalar_t* weight;  // (K, K, C_in, C_out, 16)
  const scalar_t* a_in;    // (B, H, W, C_in)

  int64_t windows() const { return d.B * Ho * Wo; }
  int64_t child(int64_t b, int64_t iy, int64_t ix, int64_t c) const {
    return ((b * d.H + iy) * d.W + ix) * d.C_in + c;
  }
  int64_t children() const { return d.B * d.H * d.W * d.C_in; }
  // The offset of (window n, iteration t, parent o) in per-parent arrays of `row` values.
  int64_t parent(int64_t n, int64_t t, int64_t o, int64_t row) const {
    return ((n * d.iters + t) * d.C_out + o) * row;
  }
  // The prior row of (window n, E-step t, parent o) in priors (windows, iters - 1, C_out, 17).
  int64_t prior(int64_t n, int64_t t, int64_t o) const {
    return ((n * (d.iters - 1) + t) * d.C_out + o) * kPriorRow;
  }
  // The statistics of window n and iteration t are em_routing's: means (C_out, 16), variances
  // (C_out, 16), logits (C_out).
  const acc_t* mean(const acc_t* stats, int64_t n, int64_t t, int64_t o) const {
    return stats + parent(n, t, 0, kStatsRow) + o * kPoseSize;
  }
  const acc_t* variance(const acc_t* stats, int64_t n, int64_t t, int64_t o) const {
    return stats + parent(n, t, 0, kStatsRow) + (d.C_out + o) * kPoseSize;
  }
  acc_t logit(const acc_t* stats, int64_t n, int64_t t, int64_t o) const {
    return stats[parent(n, t, 0, kStatsRow) + 2 * d.C_out * kPoseSize + o];
  }
  int64_t covering(int64_t iy, int64_t ix) const {
    const int64_t rows = d.last_window(iy, Ho) - d.first_window(iy) + 1;
    const int64_t cols = d.last_window(ix, Wo) - d.first_window(ix) + 1;
    return std::max<int64_t>(rows, 0) * std::max<int64_t>(cols, 0);
  }
  const scalar_t* weight_at(int64_t ky, int64_t kx, int64_t c, int64_t o) const {
    return weight + (((ky * d.K + kx) * d.C_in + c) * d.C_out + o) * kPoseSize;
  }

  // Calls f(e, child index or -1 where the window lies on padding, iy, ix) for the window's
  // children e = (ky K + kx) C_in + c.
  template <typename F>
  void for_each_window_child(int64_t n, F&& f) const {
    const int64_t b = n / (Ho * Wo), y = n / Wo % Ho, x = n % Wo;
    for (int64_t ky = 0; ky < d.K; ++ky)
      for (int64_t kx = 0; kx < d.K; ++kx) {
        const int64_t iy = y * d.stride - d.padding + ky, ix = x * d.stride - d.padding + kx;
        const bool inside = iy >= 0 && iy < d.H && ix >= 0 && ix < d.W;
        for (int64_t c = 0; c < d.C_in; ++c)
          f((ky * d.K + kx) * d.C_in + c, inside ? child(b, iy, ix, c) : -1, iy, ix);
      }
  }

  // Calls f(window n, ky, kx) for every window that contains input position (b, iy, ix), in a
  // fixed order.
  template <typename F>
  void for_each_covering_window(int64_t b, int64_t iy, int64_t ix, F&& f) const {
    for (int64_t y = d.first_window(iy); y <= d.last_window(iy, Ho); ++y)
      for (int64_t x = d.first_window(ix); x <= d.last_window(ix, Wo); ++x)
        f((b * Ho + y) * Wo + x, iy + d.padding - y * d.stride, ix + d.padding - x * d.stride);
  }

  // Child i's votes (C_out, 16) from window offset (ky, kx); c is its type.
  void child_votes(int64_t i, int64_t ky, int64_t kx, int64_t c, acc_t* V) const {
    for (int64_t o = 0; o < d.C_out; ++o)
      pose_vote(pose + i * kPoseSize, weight_at(ky, kx, c, o), V + o * kPoseSize);
  }

  // The votes (window_children, C_out, 16) and activations of window n; zero where it lies on
  // padding.
  void window_votes(int64_t n, acc_t* votes, acc_t* a) const {
    for_each_window_child(n, [&](int64_t e, int64_t i, int64_t, int64_t) {
      acc_t* V = votes + e * d.C_out * kPoseSize;
      if (i < 0) {
        std::fill(V, V + d.C_out * kPoseSize, acc_t(0));
        a[e] = 0;
        return;
      }
      const int64_t ky = e / d.C_in / d.K, kx = e / d.C_in % d.K, c = e % d.C_in;
      child_votes(i, ky, kx, c, V);
      a[e] = static_cast<acc_t>(a_in[i]);
    });
  }
};

// x[k] = exp(x[k]) for k < n, a vector at a time.
template <typename acc_t>
inline void exp_in_place(acc_t* x, int64_t n) {
  constexpr int64_t W = Vec<acc_t>::size();
  for (int64_t k = 0; k < n; k += W) {
    const int64_t m = std::min(W, n - k);
    Vec<acc_t>::loadu(x + k, m).exp().store(x + k, m);
  }
}

// The assignments R^t of child i's votes V (C_out, 16) to the parents of window n, into R (C_out):
// 1 / (covering C_out) before the first E-step, then exp(L^{t-1} - Z^{t-1}_i).
template <typename scalar_t, typename acc_t>
inline void assignments(const ConvEmLayout<scalar_t, acc_t>& L, const acc_t* V, int64_t n,
                        int64_t t, int64_t i, acc_t initial, const acc_t* stats,
                        const acc_t* priors, const acc_t* log_norm, acc_t* R) {
  const int64_t J = L.d.C_out;
  if (t == 0) {
    std::fill(R, R + J, initial);
    return;
  }
  const acc_t z = log_norm[(t - 1) * L.children() + i];
  for (int64_t o = 0; o < J; ++o)
    R[o] = log_posterior(V + o * kPoseSize, L.mean(stats, n, t - 1, o),
                         priors + L.prior(n, t - 1, o)) -
           z;
  exp_in_place(R, J);
}

// The prior rows of iteration t of window n, from its statistics.
template <typename scalar_t, typename acc_t>
void window_priors(const ConvEmLayout<scalar_t, acc_t>& L, int64_t n, int64_t t, const acc_t* stats,
                   acc_t* priors) {
  for (int64_t o = 0; o < L.d.C_out; ++o) {
    const acc_t* var = L.variance(stats, n, t, o);
    acc_t* pr = priors + L.prior(n, t, o);
    pr[0] = em_log_prior(L.logit(stats, n, t, o), var, kPoseSize);
    for (int64_t h = 0; h < kPoseSize; ++h) pr[1 + h] = 1 / (2 * var[h]);
  }
}

// The E-step after iteration t: every child's log-sum-exp over its (window, parent) pairs into
// log_norm[t] (B, H, W, C_in). A row of children per task; scratch of K*K*C_out values.
template <typename scalar_t, typename acc_t>
void log_normalisers(const ConvEmLayout<scalar_t, acc_t>& L, int64_t t, const acc_t* stats,
                     const acc_t* priors, acc_t* log_norm) {
  const ConvEmDims& d = L.d;
  at::parallel_for(0, d.B * d.H, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> posts(d.K * d.K * d.C_out), V(d.C_out * kPoseSize);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / d.H, iy = row % d.H;
      for (int64_t ix = 0; ix < d.W; ++ix)
        for (int64_t c = 0; c < d.C_in; ++c) {
          const int64_t i = L.child(b, iy, ix, c);
          int64_t count = 0;
          acc_t top = -std::numeric_limits<acc_t>::infinity();
          L.for_each_covering_window(b, iy, ix, [&](int64_t n, int64_t ky, int64_t kx) {
            L.child_votes(i, ky, kx, c, V.data());
            for (int64_t o = 0; o < d.C_out; ++o) {
              const acc_t post = log_posterior(V.data() + o * kPoseSize, L.mean(stats, n, t, o),
                                               priors + L.prior(n, t, o));
              posts[count++] = post;
              top = std::max(top, post);
            }
          });
          for (int64_t k = 0; k < count; ++k) posts[k] -= top;
          exp_in_place(posts.data(), count);
          acc_t sum = 0;
          for (int64_t k = 0; k < count; ++k) sum += posts[k];
          log_norm[t * L.children() + i] = count > 0 ? top + std::log(sum) : acc_t(0);
        }
    }
  });
}

// The forward's routing: statistics of every window and iteration into stats (B, Ho, Wo, iters,
// C_out, 33); priors (windows, iters - 1, C_out, 17) and log_norm (iters - 1, B, H, W, C_in) are
// workspaces the backward fills again.
template <typename scalar_t, typename acc_t>
void route(const ConvEmLayout<scalar_t, acc_t>& L, const scalar_t* beta_u, const scalar_t* beta_a,
           double eps, acc_t* stats, acc_t* priors, acc_t* log_norm) {
  const ConvEmDims& d = L.d;
  const int64_t I = d.window_children();
  const EmDims window_dims{1, I, d.C_out, kPoseSize, d.iters, d.final_lambda};
  for (int64_t t = 0; t < d.iters; ++t) {
    at::parallel_for(0, L.windows(), 1, [&](int64_t begin, int64_t end) {
      EmElement<acc_t, acc_t, kPoseSize> em(window_dims, eps);
      std::vector<acc_t> votes(I * d.C_out * kPoseSize), a(I), R(I * d.C_out);
      for (int64_t n = begin; n < end; ++n) {
        L.window_votes(n, votes.data(), a.data());
        L.for_each_window_child(n, [&](int64_t e, int64_t i, int64_t iy, int64_t ix) {
          acc_t* R_e = R.data() + e * d.C_out;
          if (i < 0) {
            std::fill(R_e, R_e + d.C_out, acc_t(0));
            return;
          }
          const acc_t initial = acc_t(1) / static_cast<acc_t>(L.covering(iy, ix) * d.C_out);
          assignments(L, votes.data() + e * d.C_out * kPoseSize, n, t, i, initial, stats, priors,
                      log_norm, R_e);
        });
        em.set_assignments([&](int64_t e, int64_t o) { return R[e * d.C_out + o]; });
        em.m_step(cpu::VoteRows<acc_t>{votes.data(), d.C_out * kPoseSize, kPoseSize}, a.data(),
                  beta_u, beta_a, t, stats + L.parent(n, t, 0, kStatsRow));
        if (t < d.iters - 1) window_priors(L, n, t, stats, priors);
      }
    });
    if (t < d.iters - 1) log_normalisers(L, t, stats, priors, log_norm);
  }
}

template <typename scalar_t>
ConvEmLayout<scalar_t, at::opmath_type<scalar_t>> layout_of(const ConvEmDims& d,
                                                            const at::Tensor& pose,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& a_in) {
  return {d,
          d.Ho(),
          d.Wo(),
          pose.const_data_ptr<scalar_t>(),
          weight.const_data_ptr<scalar_t>(),
          a_in.const_data_ptr<scalar_t>()};
}

ConvEmDims conv_em_dims(const at::Tensor& pose, const at::Tensor& weight, int64_t iters,
                        int64_t stride, int64_t padding, double final_lambda) {
  return {pose.size(0),   pose.size(1), pose.size(2), pose.size(3), weight.size(3),
          weight.size(0), stride,       padding,      iters,        final_lambda};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_em_routing_cpu(
    const at::Tensor& pose_in, const at::Tensor& a_in_in, const at::Tensor& weight_in,
    const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, int64_t iters, int64_t stride,
    int64_t padding, double final_lambda, double eps) {
  check_conv_em_routing_inputs(pose_in, a_in_in, weight_in, beta_u_in, beta_a_in, iters, stride,
                               padding, final_lambda, eps);
  record_kernel_path("conv_em_routing", Direction::forward, "cpu");
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous(),
                   weight = weight_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const ConvEmDims d = conv_em_dims(pose, weight, iters, stride, padding, final_lambda);
  const int64_t Ho = d.Ho(), Wo = d.Wo();
  const at::TensorOptions acc = pose.options().dtype(acc_dtype(pose.scalar_type()));
  at::Tensor stats = at::empty({d.B, Ho, Wo, iters, d.C_out, kStatsRow}, acc);
  at::Tensor priors = at::empty({d.B * Ho * Wo, iters - 1, d.C_out, kPriorRow}, acc);
  at::Tensor log_norm = at::empty({iters - 1, d.B, d.H, d.W, d.C_in}, acc);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        route(layout_of<scalar_t>(d, pose, weight, a_in), beta_u.const_data_ptr<scalar_t>(),
              beta_a.const_data_ptr<scalar_t>(), eps, stats.mutable_data_ptr<acc_t>(),
              priors.mutable_data_ptr<acc_t>(), log_norm.mutable_data_ptr<acc_t>());
      });
  const at::Tensor last = stats.select(3, iters - 1).flatten(3);  // (B, Ho, Wo, C_out 33)
  const int64_t JH = d.C_out * kPoseSize;
  return {last.narrow(-1, 0, JH)
              .unflatten(-1, {d.C_out, kPoseSize})
              .to(pose.scalar_type())
              .contiguous(),
          last.narrow(-1, 2 * JH, d.C_out).sigmoid().to(pose.scalar_type()).contiguous(), stats};
}

// The backward's per-iteration state, indexed as ConvEmLayout says: coefficients (windows, iters,
// C_out, 33) of em_m_step_backward (g_mass, g_mu / M, g_var / M) and T^t_i = sum_j R^t_ij g_r^t_ij
// per child (iters, B, H, W, C_in), the a_in gradient of M-step t and the softmax's weighted sum.
template <typename scalar_t, typename acc_t>
struct ConvEmBackward {
  const ConvEmLayout<scalar_t, acc_t>& L;
  const scalar_t* beta_u;
  const acc_t* stats;
  const acc_t* priors;
  const acc_t* log_norm;
  acc_t* coeffs;
  acc_t* sums;  // T (child_grads writes T^0)
  acc_t eps;

  // g_r^t of child i's votes V (C_out, 16) to the parents of window n, into g_r (C_out).
  void assignment_grads(const acc_t* V, int64_t n, int64_t t, acc_t* g_r) const {
    for (int64_t o = 0; o < L.d.C_out; ++o)
      g_r[o] =
          assignment_grad(V + o * kPoseSize, L.mean(stats, n, t, o), L.variance(stats, n, t, o),
                          coeffs + L.parent(n, t, o, kStatsRow), eps);
  }

  // Window n at iteration t: the gradients of its parents' M-step t outputs (from the output
  // gradients at the last iteration, else from E-step t), then their M-step coefficients.
  // R, R_next, g_r: scratch of C_out values each.
  void window(int64_t n, int64_t t, const acc_t* g_pose, const acc_t* g_a_out, acc_t* g_beta,
              const acc_t* votes, const acc_t* a, acc_t* g_mu, acc_t* g_var, acc_t* g_logit,
              acc_t* mass, acc_t* R, acc_t* R_next, acc_t* g_r) const {
    const ConvEmDims& d = L.d;
    const int64_t J = d.C_out, JH = J * kPoseSize;
    if (t == d.iters - 1) {
      std::copy(g_pose + n * JH, g_pose + (n + 1) * JH, g_mu);
      std::fill(g_var, g_var + JH, acc_t(0));
      for (int64_t o = 0; o < J; ++o) {
        const acc_t s = em_sigmoid(L.logit(stats, n, t, o));
        g_logit[o] = g_a_out[n * J + o] * s * (1 - s);
      }
    } else {
      std::fill(g_mu, g_mu + JH, acc_t(0));
      std::fill(g_var, g_var + JH, acc_t(0));
      std::fill(g_logit, g_logit + J, acc_t(0));
    }
    std::fill(mass, mass + J, acc_t(0));
    L.for_each_window_child(n, [&](int64_t e, int64_t i, int64_t iy, int64_t ix) {
      if (i < 0) return;
      const acc_t initial = acc_t(1) / static_cast<acc_t>(L.covering(iy, ix) * J);
      const acc_t* V_e = votes + e * J * kPoseSize;
      assignments(L, V_e, n, t, i, initial, stats, priors, log_norm, R);
      for (int64_t o = 0; o < J; ++o) mass[o] += R[o] * a[e];
      if (t == d.iters - 1) return;
      // E-step t: g_L = R^{t+1} a (g_r^{t+1} - T^{t+1}); L = log prior - sum_h (V - mu)^2 / (2
      // var), q = (V - mu) / var.
      assignments(L, V_e, n, t + 1, i, initial, stats, priors, log_norm, R_next);
      assignment_grads(V_e, n, t + 1, g_r);
      const acc_t sum_next = sums[(t + 1) * L.children() + i];
      for (int64_t o = 0; o < J; ++o) {
        const acc_t* V = V_e + o * kPoseSize;
        const acc_t g_L = R_next[o] * a[e] * (g_r[o] - sum_next);
        const acc_t* mu = L.mean(stats, n, t, o);
        const acc_t* pr = priors + L.prior(n, t, o);
        g_logit[o] += g_L * (1 - em_sigmoid(L.logit(stats, n, t, o)));
        for (int64_t h = 0; h < kPoseSize; ++h) {
          const acc_t diff = V[h] - mu[h], inv_var = 2 * pr[1 + h];
          const acc_t q = diff * inv_var;
          g_mu[o * kPoseSize + h] += g_L * q;
          g_var[o * kPoseSize + h] += acc_t(0.5) * g_L * inv_var * (q * diff - 1);
        }
      }
    });
    const acc_t lam = em_lambda(d.final_lambda, t);
    for (int64_t o = 0; o < J; ++o) {
      acc_t* co = coeffs + L.parent(n, t, o, kStatsRow);
      co[0] = em_m_step_backward(kPoseSize, lam, eps, static_cast<acc_t>(beta_u[o]), mass[o],
                                 L.mean(stats, n, t, o), L.variance(stats, n, t, o), g_logit[o],
                                 g_mu + o * kPoseSize, g_var + o * kPoseSize, co + 1,
                                 co + 1 + kPoseSize, g_beta[o], g_beta[J + o]);
    }
  }

  // Calls f(window n, ky, kx, votes V (C_out, 16)) for every window that contains child
  // (b, iy, ix, c); V: scratch of C_out 16 values.
  template <typename F>
  void for_each_parent_window(int64_t b, int64_t iy, int64_t ix, int64_t c, acc_t* V, F&& f) const {
    const int64_t i = L.child(b, iy, ix, c);
    L.for_each_covering_window(b, iy, ix, [&](int64_t n, int64_t ky, int64_t kx) {
      L.child_votes(i, ky, kx, c, V);
      f(n, ky, kx, static_cast<const acc_t*>(V));
    });
  }

  // T^t of every child (t > 0).
  void child_sums(int64_t t) const {
    const ConvEmDims& d = L.d;
    at::parallel_for(0, d.B * d.H, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> V(d.C_out * kPoseSize), R(d.C_out), g_r(d.C_out);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / d.H, iy = row % d.H;
        for (int64_t ix = 0; ix < d.W; ++ix)
          for (int64_t c = 0; c < d.C_in; ++c) {
            const int64_t i = L.child(b, iy, ix, c);
            acc_t sum = 0;
            for_each_parent_window(
                b, iy, ix, c, V.data(), [&](int64_t n, int64_t, int64_t, const acc_t* V_n) {
                  assignments(L, V_n, n, t, i, acc_t(0), stats, priors, log_norm, R.data());
                  assignment_grads(V_n, n, t, g_r.data());
                  for (int64_t o = 0; o < d.C_out; ++o) sum += R[o] * g_r[o];
                });
            sums[t * L.children() + i] = sum;
          }
      }
    });
  }

  // Child (b, iy, ix, c)'s vote gradients, summed over the iterations, contracted into its pose
  // gradient (returned in g_P) and the weight gradient g_W (K, K, C_in, C_out, 16); T^0 (which no
  // E-step needs); returns its a_in gradient. Scratch: V of C_out 16 values, R and g_r of
  // iters C_out values each.
  acc_t child_grads(int64_t b, int64_t iy, int64_t ix, int64_t c, acc_t* g_P, acc_t* g_W, acc_t* V,
                    acc_t* R, acc_t* g_r) const {
    const ConvEmDims& d = L.d;
    const int64_t i = L.child(b, iy, ix, c), J = d.C_out;
    const acc_t a = static_cast<acc_t>(L.a_in[i]);
    const acc_t initial =
        acc_t(1) / static_cast<acc_t>(std::max<int64_t>(L.covering(iy, ix), 1) * J);
    acc_t P_acc[kPoseSize], g_P_acc[kPoseSize] = {};
    for (int64_t h = 0; h < kPoseSize; ++h)
      P_acc[h] = static_cast<acc_t>(L.pose[i * kPoseSize + h]);
    acc_t first_sum = 0;
    for_each_parent_window(
        b, iy, ix, c, V, [&](int64_t n, int64_t ky, int64_t kx, const acc_t* V_n) {
          for (int64_t t = 0; t < d.iters; ++t) {
            assignments(L, V_n, n, t, i, initial, stats, priors, log_norm, R + t * J);
            assignment_grads(V_n, n, t, g_r + t * J);
          }
          for (int64_t o = 0; o < J; ++o) first_sum += R[o] * g_r[o];
          for (int64_t o = 0; o < J; ++o) {
            const acc_t* V_o = V_n + o * kPoseSize;
            // M-step t: g_V += r (g_mu / M + 2 g_var / M (V - mu)); E-step t - 1: g_V -= g_L (V -
            // mu) / var.
            acc_t g_V[kPoseSize] = {};
            for (int64_t t = 0; t < d.iters; ++t) {
              const acc_t* mu = L.mean(stats, n, t, o);
              const acc_t* co = coeffs + L.parent(n, t, o, kStatsRow);
              const acc_t r = R[t * J + o] * a;
              for (int64_t h = 0; h < kPoseSize; ++h)
                g_V[h] += r * (co[1 + h] + 2 * co[1 + kPoseSize + h] * (V_o[h] - mu[h]));
              if (t == 0) continue;
              const acc_t g_L = r * (g_r[t * J + o] - sums[t * L.children() + i]);
              const acc_t* mu_prev = L.mean(stats, n, t - 1, o);
              const acc_t* pr = priors + L.prior(n, t - 1, o);
              for (int64_t h = 0; h < kPoseSize; ++h)
                g_V[h] -= g_L * (V_o[h] - mu_prev[h]) * 2 * pr[1 + h];
            }
            // V = P Wt: g_P += g_V Wt^T, g_Wt += P^T g_V (in local arrays: no aliasing in the
            // loops).
            const scalar_t* Wt = L.weight_at(ky, kx, c, o);
            acc_t W_acc[kPoseSize], g_Wt[kPoseSize] = {};
            for (int64_t h = 0; h < kPoseSize; ++h) W_acc[h] = static_cast<acc_t>(Wt[h]);
            for (int r = 0; r < 4; ++r)
              for (int k = 0; k < 4; ++k)
                for (int col = 0; col < 4; ++col) {
                  g_P_acc[r * 4 + k] += g_V[r * 4 + col] * W_acc[k * 4 + col];
                  g_Wt[k * 4 + col] += P_acc[r * 4 + k] * g_V[r * 4 + col];
                }
            acc_t* g_W_o = g_W + (((ky * d.K + kx) * d.C_in + c) * J + o) * kPoseSize;
            for (int64_t h = 0; h < kPoseSize; ++h) g_W_o[h] += g_Wt[h];
          }
        });
    std::copy(g_P_acc, g_P_acc + kPoseSize, g_P);
    sums[i] = first_sum;
    acc_t g_a = 0;
    for (int64_t t = 0; t < d.iters; ++t) g_a += sums[t * L.children() + i];
    return g_a;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_em_routing_backward_cpu(
    const at::Tensor& grad_pose_out_in, const at::Tensor& grad_a_out_in, const at::Tensor& pose_in,
    const at::Tensor& a_in_in, const at::Tensor& weight_in, const at::Tensor& beta_u_in,
    const at::Tensor& beta_a_in, const at::Tensor& stats_in, int64_t stride, int64_t padding,
    double final_lambda, double eps) {
  const int64_t iters = conv_em_stats_iters(stats_in);
  check_conv_em_routing_inputs(pose_in, a_in_in, weight_in, beta_u_in, beta_a_in, iters, stride,
                               padding, final_lambda, eps);
  const ConvEmDims d = conv_em_dims(pose_in, weight_in, iters, stride, padding, final_lambda);
  const int64_t Ho = d.Ho(), Wo = d.Wo(), J = d.C_out;
  check_conv_em_backward_inputs(grad_pose_out_in, grad_a_out_in, stats_in, d.B, Ho, Wo, J);
  record_kernel_path("conv_em_routing", Direction::backward, "cpu");
  const at::ScalarType acc = acc_dtype(pose_in.scalar_type());
  const at::TensorOptions acc_options = pose_in.options().dtype(acc);
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous(),
                   weight = weight_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous();
  const at::Tensor grad_pose_out = grad_pose_out_in.to(acc).contiguous(),
                   grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  const int64_t windows = d.B * Ho * Wo;
  at::Tensor priors = at::empty({windows, iters - 1, J, kPriorRow}, acc_options);
  at::Tensor log_norm = at::empty({iters - 1, d.B, d.H, d.W, d.C_in}, acc_options);
  at::Tensor coeffs = at::empty({windows, iters, J, kStatsRow}, acc_options);
  at::Tensor sums = at::empty({iters, d.B, d.H, d.W, d.C_in}, acc_options);
  at::Tensor grad_beta_items = at::zeros({windows, 2, J}, acc_options);
  const int64_t rows = d.B * d.H, chunks = std::max<int64_t>(1, std::min(rows, kWeightChunks));
  at::Tensor grad_weight_parts = at::zeros({chunks, weight.numel()}, acc_options);
  at::Tensor grad_pose = at::empty_like(pose), grad_a_in = at::empty_like(a_in);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const ConvEmLayout<scalar_t, acc_t> L = layout_of<scalar_t>(d, pose, weight, a_in);
        const acc_t* st = stats.const_data_ptr<acc_t>();
        acc_t* pr = priors.mutable_data_ptr<acc_t>();
        acc_t* z = log_norm.mutable_data_ptr<acc_t>();
        // The E-steps' priors and log-sum-exps, from the saved statistics.
        for (int64_t t = 0; t + 1 < iters; ++t) {
          at::parallel_for(0, windows, 1, [&](int64_t begin, int64_t end) {
            for (int64_t n = begin; n < end; ++n) window_priors(L, n, t, st, pr);
          });
          log_normalisers(L, t, st, pr, z);
        }
        const ConvEmBackward<scalar_t, acc_t> backward{L,
                                                       beta_u.const_data_ptr<scalar_t>(),
                                                       st,
                                                       pr,
                                                       z,
                                                       coeffs.mutable_data_ptr<acc_t>(),
                                                       sums.mutable_data_ptr<acc_t>(),
                                                       static_cast<acc_t>(eps)};
        const int64_t I = d.window_children();
        for (int64_t t = iters - 1; t >= 0; --t) {
          at::parallel_for(0, windows, 1, [&](int64_t begin, int64_t end) {
            std::vector<acc_t> votes(I * J * kPoseSize), a(I), g_mu(J * kPoseSize),
                g_var(J * kPoseSize), g_logit(J), mass(J), R(J), R_next(J), g_r(J);
            for (int64_t n = begin; n < end; ++n) {
              L.window_votes(n, votes.data(), a.data());
              backward.window(n, t, grad_pose_out.const_data_ptr<acc_t>(),
                              grad_a_out.const_data_ptr<acc_t>(),
                              grad_beta_items.mutable_data_ptr<acc_t>() + n * 2 * J, votes.data(),
                              a.data(), g_mu.data(), g_var.data(), g_logit.data(), mass.data(),
                              R.data(), R_next.data(), g_r.data());
            }
          });
          if (t > 0) backward.child_sums(t);  // T^0: in child_grads
        }
        at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
          std::vector<acc_t> V(J * kPoseSize), R(iters * J), g_r(iters * J);
          for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
            acc_t* g_W = grad_weight_parts.mutable_data_ptr<acc_t>() + chunk * weight.numel();
            for (int64_t row = chunk * rows / chunks; row < (chunk + 1) * rows / chunks; ++row) {
              const int64_t b = row / d.H, iy = row % d.H;
              for (int64_t ix = 0; ix < d.W; ++ix)
                for (int64_t c = 0; c < d.C_in; ++c) {
                  const int64_t i = L.child(b, iy, ix, c);
                  acc_t g_P[kPoseSize];
                  const acc_t g_a =
                      backward.child_grads(b, iy, ix, c, g_P, g_W, V.data(), R.data(), g_r.data());
                  grad_a_in.mutable_data_ptr<scalar_t>()[i] = static_cast<scalar_t>(g_a);
                  scalar_t* out = grad_pose.mutable_data_ptr<scalar_t>() + i * kPoseSize;
                  for (int64_t h = 0; h < kPoseSize; ++h) out[h] = static_cast<scalar_t>(g_P[h]);
                }
            }
          }
        });
      });
  // Two tensors of their own, not two rows of one: the schema's outputs must not alias (opcheck).
  const at::Tensor grad_betas = grad_beta_items.sum(0).to(pose.scalar_type());
  return {grad_pose, grad_a_in,
          grad_weight_parts.sum(0).view(weight.sizes()).to(pose.scalar_type()),
          grad_betas[0].clone(), grad_betas[1].clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("conv_em_routing", &conv_em_routing_cpu);
  m.impl("_conv_em_routing_backward", &conv_em_routing_backward_cpu);
}

}  // namespace capsroute
