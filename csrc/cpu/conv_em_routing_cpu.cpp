// conv_em_routing on the CPU (docs/ops.md, conv_em_routing): EM routing in a convolutional capsule
// layer whose E-step normalises each child's assignments over every parent of every window that
// contains it. The assignments span windows, so they are never stored: each child's log-sum-exp
// Z per E-step and the parents' statistics give R_ij = exp(L_ij - Z_i) wherever it is needed.
// The work is per (child, window) pair and C_out parents wide: the weight is transposed once so
// that a child's 16 vote values are 16 vectors whose lanes are the parents, and the parents'
// statistics are read in the same lanes from tables (ConvEmLayout::e_table, m_table) built per
// window from stats and the backward's coefficients. Padded lanes (C_out to whole vectors) have
// zero weights and coefficients and a log prior of -inf (no assignment after an E-step): they add
// nothing to any sum over parents.
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
#include "../common/em_math.h"
#include "../common/kernel_path.h"
#include "output_cache.h"
#include "vec_math.h"

namespace capsroute {
namespace {

using cpu::Vec;

constexpr int64_t kWeightChunks = 16;  // fixed chunks of the weight gradient's sum

// Where things are: children (B, H, W, C_in), windows (B, Ho, Wo), per window and iteration rows
// of C_out parents, and the parent-lane tables of one window.
template <typename scalar_t, typename acc_t>
struct ConvEmLayout {
  ConvEmDims d;
  int64_t Ho, Wo;
  int64_t Jp;             // C_out padded to whole vectors: parent o is lane o of a row of Jp
  const scalar_t* pose;   // (B, H, W, C_in, 16)
  const scalar_t* a_in;   // (B, H, W, C_in)
  const acc_t* weight_t;  // (K, K, C_in, 16, Jp): weight[ky, kx, c, o, h] at h Jp + o
  acc_t* log_prior;       // (windows, iters - 1, C_out): em_log_prior of each E-step's parents

  int64_t windows() const { return d.B * Ho * Wo; }
  int64_t child(int64_t b, int64_t iy, int64_t ix, int64_t c) const {
    return ((b * d.H + iy) * d.W + ix) * d.C_in + c;
  }
  int64_t children() const { return d.B * d.H * d.W * d.C_in; }
  // The offset of (window n, iteration t, parent o) in per-parent arrays of `row` values.
  int64_t parent(int64_t n, int64_t t, int64_t o, int64_t row) const {
    return ((n * d.iters + t) * d.C_out + o) * row;
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
  // The most windows that contain one input position along an axis.
  int64_t max_cover() const { return std::min((d.K + d.stride - 1) / d.stride, std::max(Ho, Wo)); }
  const acc_t* weight_at(int64_t ky, int64_t kx, int64_t c) const {
    return weight_t + ((ky * d.K + kx) * d.C_in + c) * kPoseSize * Jp;
  }
  void load_pose(int64_t i, acc_t* P) const {
    for (int64_t h = 0; h < kPoseSize; ++h) P[h] = static_cast<acc_t>(pose[i * kPoseSize + h]);
  }
  acc_t activation(int64_t i) const { return static_cast<acc_t>(a_in[i]); }
  acc_t initial(int64_t iy, int64_t ix) const { return conv_em_initial<acc_t>(d, iy, ix); }

  // Calls f(e, child index or -1 where the window lies on padding, ky, kx, c, iy, ix) for window
  // n's children e = (ky K + kx) C_in + c.
  template <typename F>
  void for_each_window_child(int64_t n, F&& f) const {
    const int64_t b = n / (Ho * Wo), y = n / Wo % Ho, x = n % Wo;
    for (int64_t ky = 0; ky < d.K; ++ky)
      for (int64_t kx = 0; kx < d.K; ++kx) {
        const int64_t iy = y * d.stride - d.padding + ky, ix = x * d.stride - d.padding + kx;
        const bool inside = iy >= 0 && iy < d.H && ix >= 0 && ix < d.W;
        for (int64_t c = 0; c < d.C_in; ++c)
          f((ky * d.K + kx) * d.C_in + c, inside ? child(b, iy, ix, c) : -1, ky, kx, c, iy, ix);
      }
  }

  // Calls f(window n, ky, kx) for every window that contains input position (b, iy, ix), in a
  // fixed order.
  template <typename F>
  void for_each_covering_window(int64_t b, int64_t iy, int64_t ix, F&& f) const {
    conv_em_for_each_covering_window(d, Ho, Wo, b, iy, ix, f);
  }

  // One window's tables, each a row of Jp lanes per value: the E-step tables of iterations
  // t < iters - 1 (ln a_j + ln p_ij = lp - sum_h (V_h - mu_h)^2 iv_h: lp, mu (16), iv = 1 / (2 var)
  // (16)), then the M-step tables of every iteration (g_r = g0 + sum_h d_h (gm_h + gv_h d_h),
  // d = V - mu: g0, mu (16), gm = g_mu / M (16), gv = g_var / M (16)).
  static constexpr int64_t kETable = 1 + 2 * kPoseSize, kMTable = 1 + 3 * kPoseSize;
  int64_t table_size() const { return ((d.iters - 1) * kETable + d.iters * kMTable) * Jp; }
  int64_t e_table(int64_t t) const { return t * kETable * Jp; }
  int64_t m_table(int64_t t) const { return ((d.iters - 1) * kETable + t * kMTable) * Jp; }

  // The log priors of window n's parents after M-step t (once per window: 17 logs a parent).
  void set_log_priors(const acc_t* stats, int64_t n, int64_t t) const {
    for (int64_t o = 0; o < d.C_out; ++o)
      log_prior[(n * (d.iters - 1) + t) * d.C_out + o] =
          em_log_prior(logit(stats, n, t, o), variance(stats, n, t, o), kPoseSize);
  }

  void build_e_table(const acc_t* stats, int64_t n, int64_t t, acc_t* tables) const {
    acc_t* E = tables + e_table(t);
    std::fill(E, E + kETable * Jp, acc_t(0));
    std::fill(E + d.C_out, E + Jp, -std::numeric_limits<acc_t>::infinity());
    std::copy_n(log_prior + (n * (d.iters - 1) + t) * d.C_out, d.C_out, E);
    for (int64_t o = 0; o < d.C_out; ++o) {
      const acc_t *mu = mean(stats, n, t, o), *var = variance(stats, n, t, o);
      for (int64_t h = 0; h < kPoseSize; ++h) {
        E[(1 + h) * Jp + o] = mu[h];
        E[(1 + kPoseSize + h) * Jp + o] = 1 / (2 * var[h]);
      }
    }
  }

  // coeffs: em_m_step_backward's (g_mass, g_mu / M, g_var / M) per (window, iteration, parent).
  void build_m_table(const acc_t* stats, const acc_t* coeffs, acc_t eps, int64_t n, int64_t t,
                     acc_t* tables) const {
    acc_t* M = tables + m_table(t);
    std::fill(M, M + kMTable * Jp, acc_t(0));
    for (int64_t o = 0; o < d.C_out; ++o) {
      const acc_t *mu = mean(stats, n, t, o), *var = variance(stats, n, t, o);
      const acc_t* co = coeffs + parent(n, t, o, kStatsRow);
      M[o] = assignment_grad_constant(co, var, eps);
      for (int64_t h = 0; h < kPoseSize; ++h) {
        M[(1 + h) * Jp + o] = mu[h];
        M[(1 + kPoseSize + h) * Jp + o] = co[1 + h];
        M[(1 + 2 * kPoseSize + h) * Jp + o] = co[1 + kPoseSize + h];
      }
    }
  }
};

// The tables (ConvEmLayout::table_size values per window) of the window rows that contain one
// input row. Children are walked row by row, so a thread builds each window row about once.
template <typename acc_t>
class WindowTables {
 public:
  WindowTables(int64_t rows, int64_t Wo, int64_t size)
      : rows_(rows), Wo_(Wo), size_(size), tag_(rows, -1), data_(rows * Wo * size) {}

  // Window n's tables; build(window, tables) fills those of its row where it is not held.
  template <typename Build>
  const acc_t* window(int64_t n, Build&& build) {
    const int64_t row = n / Wo_, slot = row % rows_;
    acc_t* slot_data = data_.data() + slot * Wo_ * size_;
    if (tag_[slot] != row) {
      for (int64_t x = 0; x < Wo_; ++x) build(row * Wo_ + x, slot_data + x * size_);
      tag_[slot] = row;
    }
    return slot_data + n % Wo_ * size_;
  }

 private:
  int64_t rows_, Wo_, size_;
  std::vector<int64_t> tag_;
  std::vector<acc_t> data_;
};

// Lane math of one (child, window) pair, on the W parents of one vector; rows of Jp lanes.
template <typename acc_t>
struct Lanes {
  using V = Vec<acc_t>;
  int64_t Jp;

  V at(const acc_t* row, int64_t k) const { return V::loadu(row + k * Jp); }

  // The votes V_h = sum_k P[r 4 + k] Wt[k 4 + col], h = r 4 + col.
  C10_ALWAYS_INLINE void votes(const acc_t* P, const acc_t* Wt, V* out) const {
    V w[kPoseSize];
#pragma GCC unroll 16
    for (int h = 0; h < kPoseSize; ++h) w[h] = at(Wt, h);
#pragma GCC unroll 16
    for (int r = 0; r < 4; ++r) {
      const V p0(P[r * 4]), p1(P[r * 4 + 1]), p2(P[r * 4 + 2]), p3(P[r * 4 + 3]);
#pragma GCC unroll 16
      for (int col = 0; col < 4; ++col)
        out[r * 4 + col] = at::vec::fmadd(
            p3, w[12 + col],
            at::vec::fmadd(p2, w[8 + col], at::vec::fmadd(p1, w[4 + col], p0 * w[col])));
    }
  }

  // Four partial sums over h: four short dependency chains instead of one of 16.
  static C10_ALWAYS_INLINE V total(const V* s) { return (s[0] + s[1]) + (s[2] + s[3]); }

  // ln a_j + ln p_ij under E-step table E.
  C10_ALWAYS_INLINE V log_posterior(const V* votes, const acc_t* E) const {
    V s[4] = {V(acc_t(0)), V(acc_t(0)), V(acc_t(0)), V(acc_t(0))};
#pragma GCC unroll 16
    for (int h = 0; h < kPoseSize; ++h) {
      const V diff = votes[h] - at(E, 1 + h);
      s[h % 4] = at::vec::fmadd(diff * diff, at(E, 1 + kPoseSize + h), s[h % 4]);
    }
    return V::loadu(E) - total(s);
  }

  // R = exp(L - z) under E-step table E.
  C10_ALWAYS_INLINE V assignment(const V* votes, const acc_t* E, acc_t z) const {
    return (log_posterior(votes, E) - V(z)).exp();
  }

  // g_r under M-step table M.
  C10_ALWAYS_INLINE V assignment_grad(const V* votes, const acc_t* M) const {
    V s[4] = {V(acc_t(0)), V(acc_t(0)), V(acc_t(0)), V(acc_t(0))};
#pragma GCC unroll 16
    for (int h = 0; h < kPoseSize; ++h) {
      const V diff = votes[h] - at(M, 1 + h);
      s[h % 4] = at::vec::fmadd(
          diff, at::vec::fmadd(at(M, 1 + 2 * kPoseSize + h), diff, at(M, 1 + kPoseSize + h)),
          s[h % 4]);
    }
    return V::loadu(M) + total(s);
  }
};

// The E-step after iteration t: every child's log-sum-exp over its (window, parent) pairs into
// log_norm[t] (B, H, W, C_in). A row of children per task.
template <typename scalar_t, typename acc_t>
void log_normalisers(const ConvEmLayout<scalar_t, acc_t>& L, int64_t t, const acc_t* stats,
                     acc_t* log_norm) {
  const ConvEmDims& d = L.d;
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const Lanes<acc_t> lanes{L.Jp};
  at::parallel_for(0, d.B * d.H, 1, [&](int64_t begin, int64_t end) {
    WindowTables<acc_t> tables(L.max_cover(), L.Wo, L.table_size());
    const auto build = [&](int64_t n, acc_t* T) { L.build_e_table(stats, n, t, T); };
    std::vector<acc_t> posts(L.max_cover() * L.max_cover() * L.Jp);
    acc_t P[kPoseSize];
    V votes[kPoseSize];
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / d.H, iy = row % d.H;
      for (int64_t ix = 0; ix < d.W; ++ix)
        for (int64_t c = 0; c < d.C_in; ++c) {
          const int64_t i = L.child(b, iy, ix, c);
          L.load_pose(i, P);
          int64_t count = 0;
          V top(-std::numeric_limits<acc_t>::infinity());
          L.for_each_covering_window(b, iy, ix, [&](int64_t n, int64_t ky, int64_t kx) {
            const acc_t* E = tables.window(n, build) + L.e_table(t);
            const acc_t* Wt = L.weight_at(ky, kx, c);
            for (int64_t off = 0; off < L.Jp; off += W, count += W) {
              lanes.votes(P, Wt + off, votes);
              const V post = lanes.log_posterior(votes, E + off);
              post.store(posts.data() + count);
              top = at::vec::maximum(top, post);
            }
          });
          if (count == 0) {
            log_norm[t * L.children() + i] = 0;
            continue;
          }
          const acc_t m = at::vec::vec_reduce_all<acc_t>(
              [](const V& x, const V& y) { return at::vec::maximum(x, y); }, top);
          V sum(0);
          for (int64_t k = 0; k < count; k += W) sum += (V::loadu(posts.data() + k) - V(m)).exp();
          log_norm[t * L.children() + i] = m + std::log(cpu::reduce_sum(sum));
        }
    }
  });
}

// M-step t of window n (em_routing's, over the window's children) into stats. Scratch: votes
// (window_children, 16, Jp), r (window_children, Jp), tables of one window, sums (33 Jp).
template <typename scalar_t, typename acc_t>
void window_m_step(const ConvEmLayout<scalar_t, acc_t>& L, int64_t n, int64_t t,
                   const scalar_t* beta_u, const scalar_t* beta_a, acc_t eps, acc_t* stats,
                   const acc_t* log_norm, acc_t* votes, acc_t* r, acc_t* tables, acc_t* sums) {
  using V = Vec<acc_t>;
  constexpr int64_t W = V::size();
  const int64_t Jp = L.Jp, J = L.d.C_out, row = kPoseSize * Jp;
  const Lanes<acc_t> lanes{Jp};
  if (t > 0) L.build_e_table(stats, n, t - 1, tables);
  const acc_t* E = t > 0 ? tables + L.e_table(t - 1) : nullptr;
  acc_t* mass = sums;
  acc_t* mu = sums + Jp;         // (16, Jp)
  acc_t* var = sums + Jp + row;  // (16, Jp)
  acc_t P[kPoseSize];
  V vts[kPoseSize], acc[kPoseSize];  // the sums of a vector of parents, kept in registers
  for (int64_t off = 0; off < Jp; off += W) {
    // First pass: the votes, r = R a, the masses and sum r V.
    V m(acc_t(0));
    for (V& x : acc) x = V(acc_t(0));
    L.for_each_window_child(
        n, [&](int64_t e, int64_t i, int64_t ky, int64_t kx, int64_t c, int64_t iy, int64_t ix) {
          if (i < 0) return;
          L.load_pose(i, P);
          lanes.votes(P, L.weight_at(ky, kx, c) + off, vts);
          const acc_t a = L.activation(i);
          const V R = t == 0 ? V(L.initial(iy, ix))
                             : lanes.assignment(vts, E + off, log_norm[(t - 1) * L.children() + i]);
          const V re = R * V(a);
          re.store(r + e * Jp + off);
          m += re;
#pragma GCC unroll 16
          for (int h = 0; h < kPoseSize; ++h) {
            vts[h].store(votes + (e * kPoseSize + h) * Jp + off);
            acc[h] = at::vec::fmadd(re, vts[h], acc[h]);
          }
        });
    m.store(mass + off);
    const V inv = V(acc_t(1)) / (m + V(eps));
#pragma GCC unroll 16
    for (int h = 0; h < kPoseSize; ++h) vts[h] = acc[h] * inv;  // the means
    // Second pass for the variance: sum r (V - mu)^2 is exact where sum r V^2 - m mu^2 cancels.
    for (V& x : acc) x = V(acc_t(0));
    L.for_each_window_child(n,
                            [&](int64_t e, int64_t i, int64_t, int64_t, int64_t, int64_t, int64_t) {
                              if (i < 0) return;
                              const V re = V::loadu(r + e * Jp + off);
                              const acc_t* Ve = votes + e * row + off;
#pragma GCC unroll 16
                              for (int h = 0; h < kPoseSize; ++h) {
                                const V diff = lanes.at(Ve, h) - vts[h];
                                acc[h] = at::vec::fmadd(re * diff, diff, acc[h]);
                              }
                            });
#pragma GCC unroll 16
    for (int h = 0; h < kPoseSize; ++h) {
      vts[h].store(mu + h * Jp + off);
      acc[h].store(var + h * Jp + off);
    }
  }
  const acc_t lam = em_lambda(L.d.final_lambda, t);
  acc_t* st = stats + L.parent(n, t, 0, kStatsRow);
  for (int64_t o = 0; o < J; ++o) {
    acc_t* vr = st + (J + o) * kPoseSize;
    for (int64_t h = 0; h < kPoseSize; ++h) {
      st[o * kPoseSize + h] = mu[h * Jp + o];
      vr[h] = var[h * Jp + o] / (mass[o] + eps) + eps;
    }
    st[2 * J * kPoseSize + o] = em_activation_logit(
        lam, static_cast<acc_t>(beta_u[o]), static_cast<acc_t>(beta_a[o]), mass[o], vr, kPoseSize);
  }
  if (t < L.d.iters - 1) L.set_log_priors(stats, n, t);
}

// The forward's routing: statistics of every window and iteration into stats (B, Ho, Wo, iters,
// C_out, 33); log_norm (iters - 1, B, H, W, C_in) is a workspace the backward fills again.
template <typename scalar_t, typename acc_t>
void route(const ConvEmLayout<scalar_t, acc_t>& L, const scalar_t* beta_u, const scalar_t* beta_a,
           double eps, acc_t* stats, acc_t* log_norm) {
  const ConvEmDims& d = L.d;
  const int64_t I = d.window_children();
  for (int64_t t = 0; t < d.iters; ++t) {
    at::parallel_for(0, L.windows(), 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> votes(I * kPoseSize * L.Jp), r(I * L.Jp), tables(L.table_size()),
          sums((1 + 2 * kPoseSize) * L.Jp);
      for (int64_t n = begin; n < end; ++n)
        window_m_step(L, n, t, beta_u, beta_a, static_cast<acc_t>(eps), stats, log_norm,
                      votes.data(), r.data(), tables.data(), sums.data());
    });
    if (t < d.iters - 1) log_normalisers(L, t, stats, log_norm);
  }
}

// The weight in parent lanes (ConvEmLayout::weight_t), in the accumulation dtype.
at::Tensor lane_weight(const at::Tensor& weight, const ConvEmDims& d, int64_t lanes) {
  const int64_t Jp = (d.C_out + lanes - 1) / lanes * lanes;
  return at::constant_pad_nd(weight.flatten(4).transpose(3, 4).to(acc_dtype(weight.scalar_type())),
                             {0, Jp - d.C_out})
      .contiguous();
}

template <typename scalar_t>
ConvEmLayout<scalar_t, at::opmath_type<scalar_t>> layout_of(const ConvEmDims& d,
                                                            const at::Tensor& pose,
                                                            const at::Tensor& weight_t,
                                                            const at::Tensor& a_in,
                                                            at::Tensor& log_prior) {
  using acc_t = at::opmath_type<scalar_t>;
  return {d,
          d.Ho(),
          d.Wo(),
          weight_t.size(-1),
          pose.const_data_ptr<scalar_t>(),
          a_in.const_data_ptr<scalar_t>(),
          weight_t.const_data_ptr<acc_t>(),
          log_prior.mutable_data_ptr<acc_t>()};
}

int64_t vector_lanes(at::ScalarType t) {
  return t == at::kDouble ? Vec<double>::size() : Vec<float>::size();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_em_routing_cpu(
    const at::Tensor& pose_in, const at::Tensor& a_in_in, const at::Tensor& weight_in,
    const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, int64_t iters, int64_t stride,
    int64_t padding, double final_lambda, double eps) {
  check_conv_em_routing_inputs(pose_in, a_in_in, weight_in, beta_u_in, beta_a_in, iters, stride,
                               padding, final_lambda, eps);
  record_kernel_path("conv_em_routing", Direction::forward, "cpu");
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const ConvEmDims d = conv_em_dims(pose, weight_in, iters, stride, padding, final_lambda);
  const at::Tensor weight_t = lane_weight(weight_in, d, vector_lanes(pose.scalar_type()));
  const int64_t Ho = d.Ho(), Wo = d.Wo();
  const at::TensorOptions acc = pose.options().dtype(acc_dtype(pose.scalar_type()));
  at::Tensor stats = cpu::empty_output({d.B, Ho, Wo, iters, d.C_out, kStatsRow}, acc);
  at::Tensor log_norm = cpu::empty_output({iters - 1, d.B, d.H, d.W, d.C_in}, acc);
  at::Tensor log_prior = cpu::empty_output({d.B * Ho * Wo, iters - 1, d.C_out}, acc);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        route(layout_of<scalar_t>(d, pose, weight_t, a_in, log_prior),
              beta_u.const_data_ptr<scalar_t>(), beta_a.const_data_ptr<scalar_t>(), eps,
              stats.mutable_data_ptr<acc_t>(), log_norm.mutable_data_ptr<acc_t>());
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
  using V = Vec<acc_t>;
  static constexpr int64_t W = V::size();
  const ConvEmLayout<scalar_t, acc_t>& L;
  const scalar_t* beta_u;
  const acc_t* stats;
  const acc_t* log_norm;
  acc_t* coeffs;
  acc_t* sums;  // T (child_grads writes T^0)
  acc_t eps;

  acc_t z(int64_t t, int64_t i) const { return log_norm[t * L.children() + i]; }
  acc_t weighted_sum(int64_t t, int64_t i) const { return sums[t * L.children() + i]; }
  Lanes<acc_t> lanes() const { return {L.Jp}; }

  // Window n at iteration t: the gradients of its parents' M-step t outputs (from the output
  // gradients at the last iteration, else from E-step t), then their M-step coefficients.
  // Scratch: tables of one window, acc of (2 16 + 3) Jp values.
  void window(int64_t n, int64_t t, const acc_t* g_pose, const acc_t* g_a_out, acc_t* g_beta,
              acc_t* tables, acc_t* acc) const {
    const ConvEmDims& d = L.d;
    const int64_t J = d.C_out, Jp = L.Jp, row = kPoseSize * Jp;
    const bool last = t == d.iters - 1;
    const Lanes<acc_t> ln = lanes();
    acc_t* g_mu = acc;         // (16, Jp)
    acc_t* g_var = acc + row;  // (16, Jp)
    acc_t* g_logit = acc + 2 * row;
    acc_t* mass = g_logit + Jp;
    acc_t* one_minus_sigmoid = mass + Jp;
    std::fill(acc, acc + 2 * row + 3 * Jp, acc_t(0));
    if (t > 0) L.build_e_table(stats, n, t - 1, tables);
    if (!last) {
      L.build_e_table(stats, n, t, tables);
      L.build_m_table(stats, coeffs, eps, n, t + 1, tables);
    }
    for (int64_t o = 0; o < J; ++o) {
      const acc_t s = em_sigmoid(L.logit(stats, n, t, o));
      if (!last) {
        one_minus_sigmoid[o] = 1 - s;
        continue;
      }
      for (int64_t h = 0; h < kPoseSize; ++h)
        g_mu[h * Jp + o] = g_pose[(n * J + o) * kPoseSize + h];
      g_logit[o] = g_a_out[n * J + o] * s * (1 - s);
    }
    const acc_t* E_prev = t > 0 ? tables + L.e_table(t - 1) : nullptr;
    const acc_t* E = last ? nullptr : tables + L.e_table(t);
    const acc_t* M = last ? nullptr : tables + L.m_table(t + 1);
    acc_t P[kPoseSize];
    V vts[kPoseSize], sum_mu[kPoseSize], sum_var[kPoseSize];  // a vector of parents', in registers
    for (int64_t off = 0; off < Jp; off += W) {
      V sum_mass(acc_t(0)), sum_logit = V::loadu(g_logit + off);
#pragma GCC unroll 16
      for (int h = 0; h < kPoseSize; ++h) {
        sum_mu[h] = ln.at(g_mu + off, h);
        sum_var[h] = ln.at(g_var + off, h);
      }
      const V one_minus_s = V::loadu(one_minus_sigmoid + off);
      L.for_each_window_child(n, [&](int64_t, int64_t i, int64_t ky, int64_t kx, int64_t c,
                                     int64_t iy, int64_t ix) {
        if (i < 0) return;
        L.load_pose(i, P);
        ln.votes(P, L.weight_at(ky, kx, c) + off, vts);
        const V a(L.activation(i));
        const V R = t == 0 ? V(L.initial(iy, ix)) : ln.assignment(vts, E_prev + off, z(t - 1, i));
        sum_mass = at::vec::fmadd(R, a, sum_mass);
        if (last) return;
        // E-step t: g_L = R^{t+1} a (g_r^{t+1} - T^{t+1}); L = log prior - sum_h (V - mu)^2 /
        // (2 var), q = (V - mu) / var.
        const V g_L = ln.assignment(vts, E + off, z(t, i)) * a *
                      (ln.assignment_grad(vts, M + off) - V(weighted_sum(t + 1, i)));
        sum_logit = at::vec::fmadd(g_L, one_minus_s, sum_logit);
        const V half_g_L = V(acc_t(0.5)) * g_L;
#pragma GCC unroll 16
        for (int h = 0; h < kPoseSize; ++h) {
          const V diff = vts[h] - ln.at(E + off, 1 + h);
          const V inv_var = V(acc_t(2)) * ln.at(E + off, 1 + kPoseSize + h);
          const V q = diff * inv_var;
          sum_mu[h] = at::vec::fmadd(g_L, q, sum_mu[h]);
          sum_var[h] = at::vec::fmadd(half_g_L * inv_var, q * diff - V(acc_t(1)), sum_var[h]);
        }
      });
      sum_mass.store(mass + off);
      sum_logit.store(g_logit + off);
#pragma GCC unroll 16
      for (int h = 0; h < kPoseSize; ++h) {
        sum_mu[h].store(g_mu + h * Jp + off);
        sum_var[h].store(g_var + h * Jp + off);
      }
    }
    const acc_t lam = em_lambda(d.final_lambda, t);
    acc_t g_mu_o[kPoseSize], g_var_o[kPoseSize];
    for (int64_t o = 0; o < J; ++o) {
      for (int64_t h = 0; h < kPoseSize; ++h) {
        g_mu_o[h] = g_mu[h * Jp + o];
        g_var_o[h] = g_var[h * Jp + o];
      }
      acc_t* co = coeffs + L.parent(n, t, o, kStatsRow);
      co[0] =
          em_m_step_backward(kPoseSize, lam, eps, static_cast<acc_t>(beta_u[o]), mass[o],
                             L.mean(stats, n, t, o), L.variance(stats, n, t, o), g_logit[o], g_mu_o,
                             g_var_o, co + 1, co + 1 + kPoseSize, g_beta[o], g_beta[J + o]);
    }
  }

  // T^t of every child (t > 0).
  void child_sums(int64_t t) const {
    const ConvEmDims& d = L.d;
    const int64_t Jp = L.Jp;
    const Lanes<acc_t> ln = lanes();
    at::parallel_for(0, d.B * d.H, 1, [&](int64_t begin, int64_t end) {
      WindowTables<acc_t> tables(L.max_cover(), L.Wo, L.table_size());
      const auto build = [&](int64_t n, acc_t* T) {
        L.build_e_table(stats, n, t - 1, T);
        L.build_m_table(stats, coeffs, eps, n, t, T);
      };
      acc_t P[kPoseSize];
      V vts[kPoseSize];
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / d.H, iy = row % d.H;
        for (int64_t ix = 0; ix < d.W; ++ix)
          for (int64_t c = 0; c < d.C_in; ++c) {
            const int64_t i = L.child(b, iy, ix, c);
            const acc_t z_prev = z(t - 1, i);
            L.load_pose(i, P);
            V sum(0);
            L.for_each_covering_window(b, iy, ix, [&](int64_t n, int64_t ky, int64_t kx) {
              const acc_t* T = tables.window(n, build);
              const acc_t* Wt = L.weight_at(ky, kx, c);
              for (int64_t off = 0; off < Jp; off += W) {
                ln.votes(P, Wt + off, vts);
                sum = at::vec::fmadd(ln.assignment(vts, T + L.e_table(t - 1) + off, z_prev),
                                     ln.assignment_grad(vts, T + L.m_table(t) + off), sum);
              }
            });
            sums[t * L.children() + i] = cpu::reduce_sum(sum);
          }
      }
    });
  }

  // Every table of window n (child_grads').
  void build_tables(int64_t n, acc_t* T) const {
    for (int64_t t = 0; t + 1 < L.d.iters; ++t) L.build_e_table(stats, n, t, T);
    for (int64_t t = 0; t < L.d.iters; ++t) L.build_m_table(stats, coeffs, eps, n, t, T);
  }

  // Child (b, iy, ix, c)'s vote gradients, summed over the iterations, contracted into its pose
  // gradient (returned in g_P) and the weight gradient g_W (K, K, C_in, 16, Jp); T^0 (which no
  // E-step needs); returns its a_in gradient.
  acc_t child_grads(int64_t b, int64_t iy, int64_t ix, int64_t c, acc_t* g_P, acc_t* g_W,
                    WindowTables<acc_t>& tables) const {
    const ConvEmDims& d = L.d;
    const int64_t i = L.child(b, iy, ix, c), Jp = L.Jp;
    const Lanes<acc_t> ln = lanes();
    const V a(L.activation(i));
    const acc_t initial = L.initial(iy, ix);
    acc_t P[kPoseSize];
    L.load_pose(i, P);
    V g_P_lanes[kPoseSize];
    for (V& x : g_P_lanes) x = V(acc_t(0));
    V first_sum(0);
    V vts[kPoseSize], g_V[kPoseSize];
    L.for_each_covering_window(b, iy, ix, [&](int64_t n, int64_t ky, int64_t kx) {
      const acc_t* T = tables.window(n, [&](int64_t m, acc_t* dst) { build_tables(m, dst); });
      const acc_t* Wt = L.weight_at(ky, kx, c);
      acc_t* g_Wt = g_W + (Wt - L.weight_t);
      for (int64_t off = 0; off < Jp; off += W) {
        ln.votes(P, Wt + off, vts);
        for (V& x : g_V) x = V(acc_t(0));
        for (int64_t t = 0; t < d.iters; ++t) {
          const acc_t* E = t > 0 ? T + L.e_table(t - 1) + off : nullptr;
          const acc_t* M = T + L.m_table(t) + off;
          const V R = t == 0 ? V(initial) : ln.assignment(vts, E, z(t - 1, i));
          const V r = R * a;
          const V g_r = ln.assignment_grad(vts, M);
// M-step t: g_V += r (g_mu / M + 2 g_var / M (V - mu)).
#pragma GCC unroll 16
          for (int h = 0; h < kPoseSize; ++h) {
            const V diff = vts[h] - ln.at(M, 1 + h);
            const V coef = at::vec::fmadd(V(acc_t(2)) * ln.at(M, 1 + 2 * kPoseSize + h), diff,
                                          ln.at(M, 1 + kPoseSize + h));
            g_V[h] = at::vec::fmadd(r, coef, g_V[h]);
          }
          if (t == 0) {
            first_sum = at::vec::fmadd(R, g_r, first_sum);
            continue;
          }
          // E-step t - 1: g_V -= g_L (V - mu) / var.
          const V g_L = r * (g_r - V(weighted_sum(t, i)));
#pragma GCC unroll 16
          for (int h = 0; h < kPoseSize; ++h) {
            const V diff = vts[h] - ln.at(E, 1 + h);
            g_V[h] = g_V[h] - g_L * V(acc_t(2)) * ln.at(E, 1 + kPoseSize + h) * diff;
          }
        }
// V = P Wt: g_P += g_V Wt^T (per lane, summed over the lanes at the end), g_Wt += P^T g_V.
#pragma GCC unroll 16
        for (int r = 0; r < 4; ++r)
#pragma GCC unroll 16
          for (int k = 0; k < 4; ++k) {
            V sum = g_P_lanes[r * 4 + k];
#pragma GCC unroll 16
            for (int col = 0; col < 4; ++col)
              sum = at::vec::fmadd(g_V[r * 4 + col], ln.at(Wt + off, k * 4 + col), sum);
            g_P_lanes[r * 4 + k] = sum;
          }
#pragma GCC unroll 16
        for (int k = 0; k < 4; ++k)
#pragma GCC unroll 16
          for (int col = 0; col < 4; ++col) {
            V sum = ln.at(g_Wt + off, k * 4 + col);
#pragma GCC unroll 16
            for (int r = 0; r < 4; ++r)
              sum = at::vec::fmadd(V(P[r * 4 + k]), g_V[r * 4 + col], sum);
            sum.store(g_Wt + (k * 4 + col) * Jp + off);
          }
      }
    });
    for (int64_t h = 0; h < kPoseSize; ++h) g_P[h] = cpu::reduce_sum(g_P_lanes[h]);
    sums[i] = cpu::reduce_sum(first_sum);
    acc_t g_a = 0;
    for (int64_t t = 0; t < d.iters; ++t) g_a += weighted_sum(t, i);
    return g_a;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_em_routing_backward_cpu(
    const at::Tensor& grad_pose_out_in, const at::Tensor& grad_a_out_in, const at::Tensor& pose_in,
    const at::Tensor& a_in_in, const at::Tensor& weight_in, const at::Tensor& beta_u_in,
    const at::Tensor& beta_a_in, const at::Tensor& stats_in, int64_t stride, int64_t padding,
    double final_lambda, double eps) {
  check_conv_em_routing_backward_inputs(grad_pose_out_in, grad_a_out_in, pose_in, a_in_in,
                                        weight_in, beta_u_in, beta_a_in, stats_in, stride, padding,
                                        final_lambda, eps);
  const int64_t iters = stats_in.size(3);
  const ConvEmDims d = conv_em_dims(pose_in, weight_in, iters, stride, padding, final_lambda);
  const int64_t Ho = d.Ho(), Wo = d.Wo(), J = d.C_out;
  record_kernel_path("conv_em_routing", Direction::backward, "cpu");
  const at::ScalarType acc = acc_dtype(pose_in.scalar_type());
  const at::TensorOptions acc_options = pose_in.options().dtype(acc);
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor weight_t = lane_weight(weight_in, d, vector_lanes(pose.scalar_type()));
  const int64_t Jp = weight_t.size(-1);
  const at::Tensor beta_u = beta_u_in.contiguous();
  const at::Tensor grad_pose_out = grad_pose_out_in.to(acc).contiguous(),
                   grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  const int64_t windows = d.B * Ho * Wo;
  at::Tensor log_norm = cpu::empty_output({iters - 1, d.B, d.H, d.W, d.C_in}, acc_options);
  at::Tensor log_prior = cpu::empty_output({windows, iters - 1, J}, acc_options);
  at::Tensor coeffs = cpu::empty_output({windows, iters, J, kStatsRow}, acc_options);
  at::Tensor sums = cpu::empty_output({iters, d.B, d.H, d.W, d.C_in}, acc_options);
  at::Tensor grad_beta_items = at::zeros({windows, 2, J}, acc_options);
  const int64_t rows = d.B * d.H, chunks = std::max<int64_t>(1, std::min(rows, kWeightChunks));
  at::Tensor grad_weight_parts = at::zeros({chunks, weight_t.numel()}, acc_options);
  at::Tensor grad_pose = cpu::empty_output_like(pose), grad_a_in = cpu::empty_output_like(a_in);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const ConvEmLayout<scalar_t, acc_t> L =
            layout_of<scalar_t>(d, pose, weight_t, a_in, log_prior);
        const acc_t* st = stats.const_data_ptr<acc_t>();
        acc_t* z = log_norm.mutable_data_ptr<acc_t>();
        // The E-steps' log priors and log-sum-exps, from the saved statistics.
        at::parallel_for(0, windows, 1, [&](int64_t begin, int64_t end) {
          for (int64_t n = begin; n < end; ++n)
            for (int64_t t = 0; t + 1 < iters; ++t) L.set_log_priors(st, n, t);
        });
        for (int64_t t = 0; t + 1 < iters; ++t) log_normalisers(L, t, st, z);
        const ConvEmBackward<scalar_t, acc_t> backward{L,
                                                       beta_u.const_data_ptr<scalar_t>(),
                                                       st,
                                                       z,
                                                       coeffs.mutable_data_ptr<acc_t>(),
                                                       sums.mutable_data_ptr<acc_t>(),
                                                       static_cast<acc_t>(eps)};
        for (int64_t t = iters - 1; t >= 0; --t) {
          at::parallel_for(0, windows, 1, [&](int64_t begin, int64_t end) {
            std::vector<acc_t> tables(L.table_size()), acc_scratch((2 * kPoseSize + 3) * Jp);
            for (int64_t n = begin; n < end; ++n)
              backward.window(n, t, grad_pose_out.const_data_ptr<acc_t>(),
                              grad_a_out.const_data_ptr<acc_t>(),
                              grad_beta_items.mutable_data_ptr<acc_t>() + n * 2 * J, tables.data(),
                              acc_scratch.data());
          });
          if (t > 0) backward.child_sums(t);  // T^0: in child_grads
        }
        at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
          WindowTables<acc_t> tables(L.max_cover(), Wo, L.table_size());
          for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
            acc_t* g_W = grad_weight_parts.mutable_data_ptr<acc_t>() + chunk * weight_t.numel();
            for (int64_t row = chunk * rows / chunks; row < (chunk + 1) * rows / chunks; ++row) {
              const int64_t b = row / d.H, iy = row % d.H;
              for (int64_t ix = 0; ix < d.W; ++ix)
                for (int64_t c = 0; c < d.C_in; ++c) {
                  const int64_t i = L.child(b, iy, ix, c);
                  acc_t g_P[kPoseSize];
                  const acc_t g_a = backward.child_grads(b, iy, ix, c, g_P, g_W, tables);
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
  const at::Tensor grad_weight = grad_weight_parts.sum(0)
                                     .view(weight_t.sizes())
                                     .narrow(-1, 0, J)
                                     .transpose(3, 4)
                                     .unflatten(-1, {4, 4})
                                     .to(pose.scalar_type())
                                     .contiguous();
  return {grad_pose, grad_a_in, grad_weight, grad_betas[0].clone(), grad_betas[1].clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("conv_em_routing", &conv_em_routing_cpu);
  m.impl("_conv_em_routing_backward", &conv_em_routing_backward_cpu);
}

}  // namespace capsroute
