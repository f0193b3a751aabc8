// conv_em_routing kernels (docs/ops.md, conv_em_routing): the forward and the exact backward of
// csrc/cpu/conv_em_routing_cpu.cpp, step by step, with the same saved statistics. Device code
// only: conv_em_sequence.cuh launches them (conv_em_routing_cuda.cu on the CUDA stream,
// tests/emulator on the host).
//
// As on the CPU, assignments are never stored: each child's log-sum-exp Z per E-step and its
// parents' rows give R_ij = exp(L_ij - Z_i) wherever it is needed, and the votes V_ij =
// pose_i @ weight[ky, kx, c, o] are recomputed from the pose and the weight. Two kinds of kernels,
// a thread per item, grid-stride, no shared memory and no barriers:
//   * parent kernels, a thread per (window n, parent o): sums over the window's K*K*C_in children
//     in the CPU's order (ky, kx, c): the M-step and the backward of M-step and E-step;
//   * child kernels, a thread per child i: sums over the (window, parent) pairs of every window
//     that contains it (windows in the CPU's order, then parents): the log-normalisers Z, the
//     backward's T^t_i = sum_j R^t_ij g_r^t_ij, and the pose and a_in gradients;
// and the weight gradient, a thread per (chunk of windows, weight matrix), its chunks summed in
// chunk order by a last kernel. Every sum has one writer and a fixed order (no atomics): the
// results are deterministic, for a given chunk count (conv_em_weight_chunks) in the weight's.
//
// Per-parent rows (kStatsRow = 33 values each, accumulation dtype; n the window, t the iteration):
//   stats  (windows, iters, [mu (C_out, 16) | var (C_out, 16) | logit (C_out)]): the CPU's layout
//   e_rows (windows, iters - 1, C_out, 33): conv_em_e_row of E-step t (lp | mu | 1 / (2 var))
//   m_rows (windows, iters, C_out, 33): M-step t's backward coefficients (assignment_grad_constant
//          | g_mu / M | g_var / M of em_m_step_backward)
// and per child (B, H, W, C_in): log_norm (iters - 1) Z^t, child_sums (iters - 1) T^t for t >= 1.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/conv_em_math.h"
#include "../common/dims.h"
#include "../common/em_math.h"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Up to 128 registers a thread (2 blocks of 256 an SM): a thread holds a few 16-value poses,
// votes and sums. float64 takes twice the registers: 1 block (up to 255; float64 is for checking).
// The kernels that hold four such arrays at once (a vote, its gradient, the gradients of a
// parent's mean and variance or of a pose) spilled at 128: 1 block for them (`wide`).
template <typename acc_t, bool wide = false>
constexpr int conv_em_min_blocks() {
  return sizeof(acc_t) == 8 || wide ? 1 : 2;
}

// The op's inputs, contiguous: pose (B, H, W, C_in, 16), a_in (B, H, W, C_in), weight
// (K, K, C_in, C_out, 16), beta_u and beta_a (C_out).
template <typename scalar_t, typename acc_t>
struct ConvEmInputs {
  ConvEmDims d;
  const scalar_t* pose;
  const scalar_t* a_in;
  const scalar_t* weight;
  const scalar_t* beta_u;
  const scalar_t* beta_a;
  acc_t eps;

  __host__ __device__ int64_t windows() const { return d.B * d.Ho() * d.Wo(); }
  __host__ __device__ int64_t parents() const { return windows() * d.C_out; }
  __host__ __device__ int64_t children() const { return d.B * d.H * d.W * d.C_in; }
  __host__ __device__ int64_t weight_matrices() const { return d.K * d.K * d.C_in * d.C_out; }
};

// The forward's workspaces (the backward fills them again from stats).
template <typename acc_t>
struct ConvEmWorkspace {
  acc_t* e_rows;    // (windows, iters - 1, C_out, 33)
  acc_t* log_norm;  // (iters - 1, children)
};

// The backward's own: m_rows (windows, iters, C_out, 33), child_sums (iters - 1, children),
// g_beta (windows, 2, C_out) per window, g_weight_parts (chunks, K, K, C_in, C_out, 16).
template <typename acc_t>
struct ConvEmBackwardWorkspace {
  acc_t* m_rows;
  acc_t* child_sums;
  acc_t* g_beta;
  acc_t* g_weight_parts;
};

// ---- device helpers ----

// Calls f(k) for k = this thread's items of n, grid-stride.
template <typename F>
__device__ __forceinline__ void for_each_item(int64_t n, F&& f) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    f(k);
}

// The 16 values of a pose, in the accumulation type.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_pose(const scalar_t* src, acc_t* P) {
#pragma unroll
  for (int h = 0; h < kPoseSize; ++h) P[h] = static_cast<acc_t>(src[h]);
}

// V = P @ Wm (4x4), k in order (the CPU's vote order).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void conv_em_vote(const acc_t* P, const scalar_t* Wm, acc_t* V) {
#pragma unroll
  for (int r = 0; r < 4; ++r)
#pragma unroll
    for (int col = 0; col < 4; ++col) {
      acc_t sum = P[r * 4] * static_cast<acc_t>(Wm[col]);
#pragma unroll
      for (int k = 1; k < 4; ++k) sum += P[r * 4 + k] * static_cast<acc_t>(Wm[k * 4 + col]);
      V[r * 4 + col] = sum;
    }
}

// Where things are, from the dims.
struct ConvEmIndex {
  ConvEmDims d;
  int64_t Ho, Wo;
  __host__ __device__ explicit ConvEmIndex(const ConvEmDims& dims)
      : d(dims), Ho(dims.Ho()), Wo(dims.Wo()) {}

  __device__ int64_t child(int64_t b, int64_t iy, int64_t ix, int64_t c) const {
    return ((b * d.H + iy) * d.W + ix) * d.C_in + c;
  }
  __device__ int64_t children() const { return d.B * d.H * d.W * d.C_in; }
  // Window n's statistics block of iteration t; its parent o's mean, variance and logit.
  __device__ int64_t stats_block(int64_t n, int64_t t) const {
    return (n * d.iters + t) * d.C_out * kStatsRow;
  }
  __device__ int64_t mean(int64_t n, int64_t t, int64_t o) const {
    return stats_block(n, t) + o * kPoseSize;
  }
  __device__ int64_t variance(int64_t n, int64_t t, int64_t o) const {
    return stats_block(n, t) + (d.C_out + o) * kPoseSize;
  }
  __device__ int64_t logit(int64_t n, int64_t t, int64_t o) const {
    return stats_block(n, t) + 2 * d.C_out * kPoseSize + o;
  }
  // The row of parent o of window n in e_rows (E-step t) and m_rows (M-step t).
  __device__ int64_t e_row(int64_t n, int64_t t, int64_t o) const {
    return ((n * (d.iters - 1) + t) * d.C_out + o) * kStatsRow;
  }
  __device__ int64_t m_row(int64_t n, int64_t t, int64_t o) const {
    return ((n * d.iters + t) * d.C_out + o) * kStatsRow;
  }
  // weight[ky, kx, c, o]
  __device__ int64_t weight_matrix(int64_t ky, int64_t kx, int64_t c, int64_t o) const {
    return (((ky * d.K + kx) * d.C_in + c) * d.C_out + o) * kPoseSize;
  }

  // Calls f(child i, ky, kx, c, iy, ix) for window n's children inside the input, in the CPU's
  // order.
  template <typename F>
  __device__ __forceinline__ void for_each_window_child(int64_t n, F&& f) const {
    const int64_t b = n / (Ho * Wo), y = n / Wo % Ho, x = n % Wo;
    for (int64_t ky = 0; ky < d.K; ++ky) {
      const int64_t iy = y * d.stride - d.padding + ky;
      if (iy < 0 || iy >= d.H) continue;
      for (int64_t kx = 0; kx < d.K; ++kx) {
        const int64_t ix = x * d.stride - d.padding + kx;
        if (ix < 0 || ix >= d.W) continue;
        for (int64_t c = 0; c < d.C_in; ++c) f(child(b, iy, ix, c), ky, kx, c, iy, ix);
      }
    }
  }

  // Calls f(window n, ky, kx) for the windows that contain child i's position, in the CPU's
  // order; sets its position and type.
  template <typename F>
  __device__ __forceinline__ void for_each_covering_window(int64_t i, int64_t& iy, int64_t& ix,
                                                           int64_t& c, F&& f) const {
    c = i % d.C_in;
    const int64_t pos = i / d.C_in;
    ix = pos % d.W;
    iy = pos / d.W % d.H;
    conv_em_for_each_covering_window(d, Ho, Wo, pos / (d.W * d.H), iy, ix, f);
  }
};

// A log-sum-exp in one pass: the running maximum and the sum of exp(x - maximum).
template <typename acc_t>
struct OnlineLogSumExp {
  acc_t top, sum;
  __device__ explicit OnlineLogSumExp(acc_t neg_inf) : top(neg_inf), sum(0) {}
  __device__ void add(acc_t x) {
    if (x > top) {
      sum = sum * acc_exp(top - x) + 1;
      top = x;
    } else {
      sum += acc_exp(x - top);
    }
  }
  __device__ acc_t value() const { return top + acc_log(sum); }
};

// R^t_ij of child i (activation-free) for vote V of parent o of window n.
template <typename acc_t>
__device__ __forceinline__ acc_t conv_em_assignment(const ConvEmIndex& at, const acc_t* V,
                                                    int64_t t, int64_t n, int64_t o, int64_t i,
                                                    acc_t initial, const acc_t* e_rows,
                                                    const acc_t* log_norm) {
  if (t == 0) return initial;
  return acc_exp(conv_em_log_posterior(V, e_rows + at.e_row(n, t - 1, o)) -
                 log_norm[(t - 1) * at.children() + i]);
}

// ---- forward ----

// M-step t of every parent (em_routing's over the window's children, r_ij = R^t_ij a_i): its
// statistics into stats, its E-step row into e_rows (t < iters - 1), and after the last iteration
// the outputs pose_out (windows, C_out, 16) and a_out (windows, C_out). Two passes over the
// children, the votes and assignments recomputed: the variance as sum r (V - mu)^2, exact where
// sum r V^2 - m mu^2 cancels.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t>())
    conv_em_m_step_kernel(const ConvEmInputs<scalar_t, acc_t> in, int64_t t,
                          const ConvEmWorkspace<acc_t> ws, acc_t* stats, scalar_t* pose_out,
                          scalar_t* a_out) {
  const ConvEmIndex at(in.d);
  const int64_t J = in.d.C_out, iters = in.d.iters;
  for_each_item(in.parents(), [&](int64_t item) {
    const int64_t n = item / J, o = item - n * J;
    // r_ij and V_ij of child i (offset ky, kx, type c) for this parent.
    const auto vote = [&](int64_t i, int64_t ky, int64_t kx, int64_t c, int64_t iy, int64_t ix,
                          acc_t* V) {
      acc_t P[kPoseSize];
      load_pose(in.pose + i * kPoseSize, P);
      conv_em_vote(P, in.weight + at.weight_matrix(ky, kx, c, o), V);
      return conv_em_assignment(at, V, t, n, o, i, conv_em_initial<acc_t>(in.d, iy, ix), ws.e_rows,
                                ws.log_norm) *
             static_cast<acc_t>(in.a_in[i]);
    };
    acc_t mass = 0, acc[kPoseSize], mu[kPoseSize], V[kPoseSize];
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) acc[h] = 0;
    at.for_each_window_child(
        n, [&](int64_t i, int64_t ky, int64_t kx, int64_t c, int64_t iy, int64_t ix) {
          const acc_t r = vote(i, ky, kx, c, iy, ix, V);
          mass += r;
#pragma unroll
          for (int h = 0; h < kPoseSize; ++h) acc[h] += r * V[h];
        });
    const acc_t inv = acc_t(1) / (mass + in.eps);
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) {
      mu[h] = acc[h] * inv;
      acc[h] = 0;
    }
    at.for_each_window_child(
        n, [&](int64_t i, int64_t ky, int64_t kx, int64_t c, int64_t iy, int64_t ix) {
          const acc_t r = vote(i, ky, kx, c, iy, ix, V);
#pragma unroll
          for (int h = 0; h < kPoseSize; ++h) {
            const acc_t diff = V[h] - mu[h];
            acc[h] += r * diff * diff;
          }
        });
    acc_t* st_mu = stats + at.mean(n, t, o);
    acc_t* st_var = stats + at.variance(n, t, o);
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) {
      st_mu[h] = mu[h];
      st_var[h] = acc[h] / (mass + in.eps) + in.eps;
    }
    const acc_t logit = em_activation_logit(
        static_cast<acc_t>(em_lambda(in.d.final_lambda, t)), static_cast<acc_t>(in.beta_u[o]),
        static_cast<acc_t>(in.beta_a[o]), mass, static_cast<const acc_t*>(st_var), kPoseSize);
    stats[at.logit(n, t, o)] = logit;
    if (t < iters - 1) {
      conv_em_e_row(logit, mu, static_cast<const acc_t*>(st_var), ws.e_rows + at.e_row(n, t, o));
    } else {
#pragma unroll
      for (int h = 0; h < kPoseSize; ++h)
        pose_out[item * kPoseSize + h] = static_cast<scalar_t>(mu[h]);
      a_out[item] = static_cast<scalar_t>(em_sigmoid(logit));
    }
  });
}

// E-step t: every child's log-sum-exp Z^t_i of ln a_j + ln p_ij over the parents of the windows
// that contain it, into log_norm (0 where no window contains it).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t>())
    conv_em_log_norm_kernel(const ConvEmInputs<scalar_t, acc_t> in, int64_t t,
                            const ConvEmWorkspace<acc_t> ws) {
  const ConvEmIndex at(in.d);
  for_each_item(in.children(), [&](int64_t i) {
    acc_t P[kPoseSize], V[kPoseSize];
    load_pose(in.pose + i * kPoseSize, P);
    OnlineLogSumExp<acc_t> lse(neg_infinity(acc_t(0)));
    bool covered = false;
    int64_t iy, ix, c;
    at.for_each_covering_window(i, iy, ix, c, [&](int64_t n, int64_t ky, int64_t kx) {
      covered = true;
      for (int64_t o = 0; o < in.d.C_out; ++o) {
        conv_em_vote(P, in.weight + at.weight_matrix(ky, kx, c, o), V);
        lse.add(conv_em_log_posterior(V, static_cast<const acc_t*>(ws.e_rows) + at.e_row(n, t, o)));
      }
    });
    ws.log_norm[t * at.children() + i] = covered ? lse.value() : acc_t(0);
  });
}

// ---- backward ----
//
// As ConvEmBackward of the CPU: the E-steps' rows and log-normalisers again from stats
// (conv_em_e_rows_kernel, conv_em_log_norm_kernel), then for t = iters - 1 .. 0 the parents'
// M-step t gradients (conv_em_backward_window_kernel: from the output gradients at the last
// iteration, else from E-step t) and, for t > 0, T^t of every child (conv_em_child_sums_kernel);
// then every pair's vote gradient summed over the iterations (conv_em_vote_grad), contracted into
// the pose and a_in gradients (conv_em_grad_pose_kernel) and the weight's (conv_em_grad_weight
// and conv_em_sum_weight_parts kernels).

// The E-step rows of every parent and iteration t < iters - 1, from stats.
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    conv_em_e_rows_kernel(const ConvEmDims d, const acc_t* stats, acc_t* e_rows) {
  const ConvEmIndex at(d);
  const int64_t J = d.C_out, steps = d.iters - 1;
  for_each_item(d.B * at.Ho * at.Wo * steps * J, [&](int64_t item) {
    const int64_t o = item % J, t = item / J % steps, n = item / (J * steps);
    conv_em_e_row(stats[at.logit(n, t, o)], stats + at.mean(n, t, o), stats + at.variance(n, t, o),
                  e_rows + at.e_row(n, t, o));
  });
}

// The backward inputs besides the op's: stats and the output gradients (accumulation dtype).
template <typename acc_t>
struct ConvEmSaved {
  const acc_t* stats;
  const acc_t* grad_pose;   // (windows, C_out, 16)
  const acc_t* grad_a_out;  // (windows, C_out)
};

// Parent (n, o) at iteration t: the gradients of its M-step t outputs (mean, variance, logit),
// then em_m_step_backward: its M-step row into m_rows and its beta gradients into g_beta.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t, true>())
    conv_em_backward_window_kernel(const ConvEmInputs<scalar_t, acc_t> in, int64_t t,
                                   const ConvEmSaved<acc_t> saved, const ConvEmWorkspace<acc_t> ws,
                                   const ConvEmBackwardWorkspace<acc_t> bws) {
  const ConvEmIndex at(in.d);
  const int64_t J = in.d.C_out, children = at.children();
  const bool last = t == in.d.iters - 1;
  const acc_t* stats = saved.stats;
  for_each_item(in.parents(), [&](int64_t item) {
    const int64_t n = item / J, o = item - n * J;
    const acc_t s = em_sigmoid(stats[at.logit(n, t, o)]);
    acc_t g_mu[kPoseSize], g_var[kPoseSize], g_logit, V[kPoseSize], mass = 0;
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) {
      g_mu[h] = last ? saved.grad_pose[item * kPoseSize + h] : acc_t(0);
      g_var[h] = 0;
    }
    g_logit = last ? saved.grad_a_out[item] * s * (1 - s) : acc_t(0);
    // E-step t's row and the next M-step's (t < iters - 1).
    const acc_t* E = last ? nullptr : ws.e_rows + at.e_row(n, t, o);
    const acc_t* M = last ? nullptr : bws.m_rows + at.m_row(n, t + 1, o);
    const acc_t* mu_next = last ? nullptr : stats + at.mean(n, t + 1, o);
    at.for_each_window_child(n, [&](int64_t i, int64_t ky, int64_t kx, int64_t c, int64_t iy,
                                    int64_t ix) {
      acc_t P[kPoseSize];
      load_pose(in.pose + i * kPoseSize, P);
      conv_em_vote(P, in.weight + at.weight_matrix(ky, kx, c, o), V);
      const acc_t a = static_cast<acc_t>(in.a_in[i]);
      mass += conv_em_assignment(at, V, t, n, o, i, conv_em_initial<acc_t>(in.d, iy, ix), ws.e_rows,
                                 ws.log_norm) *
              a;
      if (last) return;
      // E-step t: g_L = R^{t+1} a (g_r^{t+1} - T^{t+1}); L = lp - sum_h (V - mu)^2 / (2 var).
      const acc_t g_L = acc_exp(conv_em_log_posterior(V, E) - ws.log_norm[t * children + i]) * a *
                        (conv_em_assignment_grad(V, mu_next, M) - bws.child_sums[t * children + i]);
      g_logit += g_L * (1 - s);
#pragma unroll
      for (int h = 0; h < kPoseSize; ++h) {
        const acc_t diff = V[h] - E[1 + h], inv_var = 2 * E[1 + kPoseSize + h];
        const acc_t q = diff * inv_var;
        g_mu[h] += g_L * q;
        g_var[h] += acc_t(0.5) * g_L * inv_var * (q * diff - 1);
      }
    });
    acc_t* g_beta = bws.g_beta + n * 2 * J;
    acc_t g_beta_u = last ? acc_t(0) : g_beta[o], g_beta_a = last ? acc_t(0) : g_beta[J + o];
    acc_t* row = bws.m_rows + at.m_row(n, t, o);
    const acc_t* var = stats + at.variance(n, t, o);
    row[0] =
        em_m_step_backward(kPoseSize, static_cast<acc_t>(em_lambda(in.d.final_lambda, t)), in.eps,
                           static_cast<acc_t>(in.beta_u[o]), mass, stats + at.mean(n, t, o), var,
                           g_logit, g_mu, g_var, row + 1, row + 1 + kPoseSize, g_beta_u, g_beta_a);
    row[0] = assignment_grad_constant(static_cast<const acc_t*>(row), var, in.eps);
    g_beta[o] = g_beta_u;
    g_beta[J + o] = g_beta_a;
  });
}

// T^t_i = sum_j R^t_ij g_r^t_ij of every child (t >= 1) into child_sums.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t>())
    conv_em_child_sums_kernel(const ConvEmInputs<scalar_t, acc_t> in, int64_t t, const acc_t* stats,
                              const ConvEmWorkspace<acc_t> ws,
                              const ConvEmBackwardWorkspace<acc_t> bws) {
  const ConvEmIndex at(in.d);
  for_each_item(in.children(), [&](int64_t i) {
    acc_t P[kPoseSize], V[kPoseSize], sum = 0;
    load_pose(in.pose + i * kPoseSize, P);
    int64_t iy, ix, c;
    at.for_each_covering_window(i, iy, ix, c, [&](int64_t n, int64_t ky, int64_t kx) {
      for (int64_t o = 0; o < in.d.C_out; ++o) {
        conv_em_vote(P, in.weight + at.weight_matrix(ky, kx, c, o), V);
        sum += conv_em_assignment(at, V, t, n, o, i, acc_t(0), ws.e_rows, ws.log_norm) *
               conv_em_assignment_grad(V, stats + at.mean(n, t, o),
                                       static_cast<const acc_t*>(bws.m_rows) + at.m_row(n, t, o));
      }
    });
    bws.child_sums[(t - 1) * at.children() + i] = sum;
  });
}

// The gradient g_V of pair (child i of activation a and initial assignment `initial`, parent o of
// window n) summed over the iterations, for its vote V: M-step t adds r (g_mu / M + 2 g_var / M
// (V - mu)), E-step t - 1 subtracts g_L (V - mu) / var. Returns R^0 g_r^0 (T^0's term).
template <typename acc_t>
__device__ __forceinline__ acc_t conv_em_vote_grad(const ConvEmIndex& at, const acc_t* stats,
                                                   const ConvEmWorkspace<acc_t>& ws,
                                                   const ConvEmBackwardWorkspace<acc_t>& bws,
                                                   int64_t i, int64_t n, int64_t o, acc_t a,
                                                   acc_t initial, const acc_t* V, acc_t* g_V) {
  const int64_t children = at.children();
  acc_t first = 0;
#pragma unroll
  for (int h = 0; h < kPoseSize; ++h) g_V[h] = 0;
  for (int64_t t = 0; t < at.d.iters; ++t) {
    const acc_t R = conv_em_assignment(at, V, t, n, o, i, initial, ws.e_rows, ws.log_norm);
    const acc_t r = R * a;
    const acc_t* mu = stats + at.mean(n, t, o);
    const acc_t* M = bws.m_rows + at.m_row(n, t, o);
    const acc_t g_r = conv_em_assignment_grad(V, mu, M);
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h)
      g_V[h] += r * (M[1 + h] + 2 * M[1 + kPoseSize + h] * (V[h] - mu[h]));
    if (t == 0) {
      first = R * g_r;
      continue;
    }
    const acc_t g_L = r * (g_r - bws.child_sums[(t - 1) * children + i]);
    const acc_t* E = ws.e_rows + at.e_row(n, t - 1, o);
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h)
      g_V[h] -= g_L * 2 * E[1 + kPoseSize + h] * (V[h] - E[1 + h]);
  }
  return first;
}

// Every child's pose gradient g_P = sum_j g_V_ij W_ij^T (storage dtype) and a_in gradient
// sum_t T^t_i (T^0 summed here).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t, true>())
    conv_em_grad_pose_kernel(const ConvEmInputs<scalar_t, acc_t> in, const acc_t* stats,
                             const ConvEmWorkspace<acc_t> ws,
                             const ConvEmBackwardWorkspace<acc_t> bws, scalar_t* grad_pose,
                             scalar_t* grad_a_in) {
  const ConvEmIndex at(in.d);
  const int64_t children = at.children();
  for_each_item(children, [&](int64_t i) {
    acc_t P[kPoseSize], V[kPoseSize], g_V[kPoseSize], g_P[kPoseSize], first = 0;
    load_pose(in.pose + i * kPoseSize, P);
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) g_P[h] = 0;
    const acc_t a = static_cast<acc_t>(in.a_in[i]);
    int64_t iy, ix, c;
    at.for_each_covering_window(i, iy, ix, c, [&](int64_t n, int64_t ky, int64_t kx) {
      const acc_t initial = conv_em_initial<acc_t>(in.d, iy, ix);
      for (int64_t o = 0; o < in.d.C_out; ++o) {
        const scalar_t* Wm = in.weight + at.weight_matrix(ky, kx, c, o);
        conv_em_vote(P, Wm, V);
        first += conv_em_vote_grad(at, stats, ws, bws, i, n, o, a, initial, V, g_V);
        // V = P Wm: g_P[r, k] += sum_col g_V[r, col] Wm[k, col].
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            acc_t sum = g_P[r * 4 + k];
#pragma unroll
            for (int col = 0; col < 4; ++col)
              sum += g_V[r * 4 + col] * static_cast<acc_t>(Wm[k * 4 + col]);
            g_P[r * 4 + k] = sum;
          }
      }
    });
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h)
      grad_pose[i * kPoseSize + h] = static_cast<scalar_t>(g_P[h]);
    acc_t g_a = first;
    for (int64_t t = 1; t < in.d.iters; ++t) g_a += bws.child_sums[(t - 1) * children + i];
    grad_a_in[i] = static_cast<scalar_t>(g_a);
  });
}

// The windows of chunk k of `chunks` (contiguous ranges, in order).
__host__ __device__ __forceinline__ RowRange conv_em_chunk(int64_t windows, int64_t chunks,
                                                           int64_t k) {
  return {k * windows / chunks, (k + 1) * windows / chunks};
}

// g_W[ky, kx, c, o] = sum over the windows n of one chunk of P_i^T g_V_ij, i the window's child
// at (ky, kx) of type c, j = (n, o): a thread per (chunk, weight matrix) into g_weight_parts.
// Consecutive threads take consecutive c of one (ky, kx, o), so a warp reads one parent's rows
// (one broadcast load each) and adjacent poses.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, conv_em_min_blocks<acc_t>())
    conv_em_grad_weight_kernel(const ConvEmInputs<scalar_t, acc_t> in, const acc_t* stats,
                               int64_t chunks, const ConvEmWorkspace<acc_t> ws,
                               const ConvEmBackwardWorkspace<acc_t> bws) {
  const ConvEmIndex at(in.d);
  const ConvEmDims& d = in.d;
  const int64_t matrices = in.weight_matrices();
  for_each_item(chunks * matrices, [&](int64_t item) {
    const int64_t k = item / matrices, rest = item - k * matrices;
    const int64_t c = rest % d.C_in, o = rest / d.C_in % d.C_out,
                  kx = rest / (d.C_in * d.C_out) % d.K, ky = rest / (d.C_in * d.C_out * d.K);
    const int64_t m = at.weight_matrix(ky, kx, c, o) / kPoseSize;
    const scalar_t* Wm = in.weight + m * kPoseSize;
    acc_t P[kPoseSize], V[kPoseSize], g_V[kPoseSize], g_W[kPoseSize];
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) g_W[h] = 0;
    const RowRange range = conv_em_chunk(in.windows(), chunks, k);
    for (int64_t n = range.begin; n < range.end; ++n) {
      const int64_t b = n / (at.Ho * at.Wo), y = n / at.Wo % at.Ho, x = n % at.Wo;
      const int64_t iy = y * d.stride - d.padding + ky, ix = x * d.stride - d.padding + kx;
      if (iy < 0 || iy >= d.H || ix < 0 || ix >= d.W) continue;
      const int64_t i = at.child(b, iy, ix, c);
      load_pose(in.pose + i * kPoseSize, P);
      conv_em_vote(P, Wm, V);
      conv_em_vote_grad(at, stats, ws, bws, i, n, o, static_cast<acc_t>(in.a_in[i]),
                        conv_em_initial<acc_t>(d, iy, ix), V, g_V);
      // g_W[k', col] += sum_r P[r, k'] g_V[r, col]
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int col = 0; col < 4; ++col) {
          acc_t sum = g_W[kk * 4 + col];
#pragma unroll
          for (int r = 0; r < 4; ++r) sum += P[r * 4 + kk] * g_V[r * 4 + col];
          g_W[kk * 4 + col] = sum;
        }
    }
    acc_t* part = bws.g_weight_parts + (k * matrices + m) * kPoseSize;
#pragma unroll
    for (int h = 0; h < kPoseSize; ++h) part[h] = g_W[h];
  });
}

// g_weight (K, K, C_in, C_out, 16), accumulation dtype: the chunks' parts summed in chunk order.
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    conv_em_sum_weight_parts_kernel(const acc_t* parts, int64_t chunks, int64_t values,
                                    acc_t* g_weight) {
  for_each_item(values, [&](int64_t v) {
    acc_t sum = 0;
    for (int64_t k = 0; k < chunks; ++k) sum += parts[k * values + v];
    g_weight[v] = sum;
  });
}

}  // namespace cuda
}  // namespace capsroute
