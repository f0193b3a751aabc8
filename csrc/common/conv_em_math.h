// Math of conv_em_routing (docs/ops.md) per (child, parent) pair that is not em_routing's, shared
// by the CPU and CUDA backends.
#pragma once

#include <cstdint>

#include "dims.h"
#include "em_math.h"

namespace capsroute {

constexpr int64_t kStatsRow = 2 * kPoseSize + 1;  // mu, var, logit of one parent and iteration

// A child's assignment to each parent of the windows that contain it before the first M-step:
// 1 / (cover(i) C_out) (any positive value where no window contains it: it is never used).
template <typename acc_t>
CAPSROUTE_HD acc_t conv_em_initial(const ConvEmDims& d, int64_t iy, int64_t ix) {
  const int64_t cover = d.covering(iy, ix);
  return acc_t(1) / static_cast<acc_t>((cover > 0 ? cover : 1) * d.C_out);
}

// Calls f(window, ky, kx) for every window that contains input position (b, iy, ix), row by row
// (the order both backends sum in): the window's index (b, y, x) into (B, Ho, Wo) and the
// position's place in it.
template <typename F>
CAPSROUTE_HD void conv_em_for_each_covering_window(const ConvEmDims& d, int64_t Ho, int64_t Wo,
                                                   int64_t b, int64_t iy, int64_t ix, F&& f) {
  for (int64_t y = d.first_window(iy); y <= d.last_window(iy, Ho); ++y)
    for (int64_t x = d.first_window(ix); x <= d.last_window(ix, Wo); ++x)
      f((b * Ho + y) * Wo + x, iy + d.padding - y * d.stride, ix + d.padding - x * d.stride);
}

// A vote's assignment gradient g_r = co0 + sum_h co1_h d_h + co2_h (d_h^2 - (var_h - eps)),
// d = V - mu (em_m_step_backward's coefficients co: g_mass, g_mu / M, g_var / M), is
// c + sum_h d_h (co1_h + co2_h d_h): this returns c, the part without the vote.
template <typename acc_t>
CAPSROUTE_HD acc_t assignment_grad_constant(const acc_t* co, const acc_t* var, acc_t eps) {
  acc_t c = co[0];
  for (int64_t h = 0; h < kPoseSize; ++h) c -= co[1 + kPoseSize + h] * (var[h] - eps);
  return c;
}

// One parent's E-step row (kStatsRow values) after its M-step: ln a_j + ln p_ij = lp -
// sum_h (V_h - mu_h)^2 iv_h with lp = em_log_prior, mu, and iv = 1 / (2 var).
template <typename acc_t>
CAPSROUTE_HD void conv_em_e_row(acc_t logit, const acc_t* mu, const acc_t* var, acc_t* row) {
  row[0] = em_log_prior(logit, var, kPoseSize);
  for (int64_t h = 0; h < kPoseSize; ++h) {
    row[1 + h] = mu[h];
    row[1 + kPoseSize + h] = 1 / (2 * var[h]);
  }
}

// ln a_j + ln p_ij of vote V under E-step row e (conv_em_e_row): four partial sums over h, as the
// CPU's vector lanes add them.
template <typename acc_t>
CAPSROUTE_HD acc_t conv_em_log_posterior(const acc_t* V, const acc_t* e) {
  acc_t s[4] = {0, 0, 0, 0};
  for (int h = 0; h < kPoseSize; ++h) {
    const acc_t diff = V[h] - e[1 + h];
    s[h % 4] += diff * diff * e[1 + kPoseSize + h];
  }
  return e[0] - ((s[0] + s[1]) + (s[2] + s[3]));
}

// g_r of vote V under the parent's mean mu and M-step row m (assignment_grad_constant, g_mu / M,
// g_var / M).
template <typename acc_t>
CAPSROUTE_HD acc_t conv_em_assignment_grad(const acc_t* V, const acc_t* mu, const acc_t* m) {
  acc_t s[4] = {0, 0, 0, 0};
  for (int h = 0; h < kPoseSize; ++h) {
    const acc_t diff = V[h] - mu[h];
    s[h % 4] += diff * (m[1 + h] + m[1 + kPoseSize + h] * diff);
  }
  return m[0] + ((s[0] + s[1]) + (s[2] + s[3]));
}

}  // namespace capsroute
