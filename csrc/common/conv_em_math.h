// Math of conv_em_routing (docs/ops.md) per (child, parent) pair that is not em_routing's.
#pragma once

#include <cstdint>

#include "dims.h"

namespace capsroute {

constexpr int64_t kStatsRow = 2 * kPoseSize + 1;  // mu, var, logit of one parent and iteration

// A vote's assignment gradient g_r = co0 + sum_h co1_h d_h + co2_h (d_h^2 - (var_h - eps)),
// d = V - mu (em_m_step_backward's coefficients co: g_mass, g_mu / M, g_var / M), is
// c + sum_h d_h (co1_h + co2_h d_h): this returns c, the part without the vote.
template <typename acc_t>
CAPSROUTE_HD acc_t assignment_grad_constant(const acc_t* co, const acc_t* var, acc_t eps) {
  acc_t c = co[0];
  for (int64_t h = 0; h < kPoseSize; ++h) c -= co[1 + kPoseSize + h] * (var[h] - eps);
  return c;
}

}  // namespace capsroute
