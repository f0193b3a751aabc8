// Problem sizes shared by the CPU and CUDA backends, so that both name a size the same way.
// Free of torch headers: the CUDA emulator of tests/emulator compiles it on the host.
#pragma once

#include <cstdint>

#include "acc_math.h"  // CAPSROUTE_HD

namespace capsroute {

// Dynamic routing: votes (B, I, J, D), routed for `iters` iterations.
struct RoutingDims {
  int64_t B, I, J, D, iters;
  bool leaky;
  CAPSROUTE_HD int64_t jd() const { return J * D; }
};

// EM routing: votes (B, I, J, H), routed for `iters` iterations with inverse temperature
// schedule em_lambda(final_lambda, t).
struct EmDims {
  int64_t B, I, J, H, iters;
  double final_lambda;
  CAPSROUTE_HD int64_t stats_row() const { return 2 * H + 1; }  // mu (H), var (H), logit
  CAPSROUTE_HD int64_t stats_block() const { return J * stats_row(); }  // per element and iteration
};

// The values of a 4x4 pose matrix, row-major: H of em_routing_pose.
constexpr int64_t kPoseSize = 16;

}  // namespace capsroute
