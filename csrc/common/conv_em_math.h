// Math of conv_em_routing (docs/ops.md) per (child, parent) pair, shared by the CPU and CUDA
// backends: the vote, its log-posterior and the gradient of its assignment.
#pragma once

#include <cstdint>

#include "dims.h"

namespace capsroute {

constexpr int64_t kStatsRow = 2 * kPoseSize + 1;  // mu, var, logit of one parent and iteration
constexpr int64_t kPriorRow = 1 + kPoseSize;      // em_log_prior, then 1 / (2 var)

// V = P @ Wt for 4x4 matrices, in the accumulation type.
template <typename scalar_t, typename acc_t>
CAPSROUTE_HD void pose_vote(const scalar_t* P, const scalar_t* Wt, acc_t* V) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) {
      acc_t sum = 0;
      for (int k = 0; k < 4; ++k)
        sum += static_cast<acc_t>(P[r * 4 + k]) * static_cast<acc_t>(Wt[k * 4 + c]);
      V[r * 4 + c] = sum;
    }
}

// ln a_j + ln p_ij of a vote V under a parent's mean mu and prior row pr.
template <typename acc_t>
CAPSROUTE_HD acc_t log_posterior(const acc_t* V, const acc_t* mu, const acc_t* pr) {
  acc_t distance = 0;
  for (int64_t h = 0; h < kPoseSize; ++h) {
    const acc_t diff = V[h] - mu[h];
    distance += diff * diff * pr[1 + h];
  }
  return pr[0] - distance;
}

// g_r of an assignment (em_m_step_backward's coefficients co: g_mass, g_mu / M, g_var / M).
template <typename acc_t>
CAPSROUTE_HD acc_t assignment_grad(const acc_t* V, const acc_t* mu, const acc_t* var,
                                   const acc_t* co, acc_t eps) {
  acc_t g_r = co[0];
  for (int64_t h = 0; h < kPoseSize; ++h) {
    const acc_t diff = V[h] - mu[h];
    g_r += co[1 + h] * diff + co[1 + kPoseSize + h] * (diff * diff - (var[h] - eps));
  }
  return g_r;
}

}  // namespace capsroute
