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
  CAPSROUTE_HD int64_t stats_row() const { return 2 * H + 1; }          // mu (H), var (H), logit
  CAPSROUTE_HD int64_t stats_block() const { return J * stats_row(); }  // per element and iteration
};

// Outputs along one axis of a convolution: windows of K inputs, `stride` apart, over `size` inputs
// padded by `padding` on both sides.
CAPSROUTE_HD int64_t conv_out_size(int64_t size, int64_t K, int64_t stride, int64_t padding) {
  return (size + 2 * padding - K) / stride + 1;
}

// Convolutional EM routing (conv_em_routing): children (B, H, W, C_in), parents (B, Ho, Wo, C_out);
// the window of output (y, x) is K x K positions from (y stride, x stride) of the input padded by
// `padding` on every side.
struct ConvEmDims {
  int64_t B, H, W, C_in, C_out, K, stride, padding, iters;
  double final_lambda;
  CAPSROUTE_HD int64_t Ho() const { return conv_out_size(H, K, stride, padding); }
  CAPSROUTE_HD int64_t Wo() const { return conv_out_size(W, K, stride, padding); }
  // The first and last output index, along an axis of `outs` outputs, whose windows contain input
  // index `in` (none where first > last).
  CAPSROUTE_HD int64_t first_window(int64_t in) const {
    const int64_t d = in + padding - K + 1;
    return d <= 0 ? 0 : (d + stride - 1) / stride;
  }
  CAPSROUTE_HD int64_t last_window(int64_t in, int64_t outs) const {
    const int64_t last = (in + padding) / stride;
    return last < outs - 1 ? last : outs - 1;
  }
  // The number of windows that contain input position (iy, ix): cover(i) of docs/ops.md.
  CAPSROUTE_HD int64_t covering(int64_t iy, int64_t ix) const {
    const int64_t rows = last_window(iy, Ho()) - first_window(iy) + 1;
    const int64_t cols = last_window(ix, Wo()) - first_window(ix) + 1;
    return (rows > 0 ? rows : 0) * (cols > 0 ? cols : 0);
  }
  CAPSROUTE_HD int64_t window_children() const { return K * K * C_in; }
};

// Where the capsules of a (B, I, J, ...) or (B, I, ...) input are, in values: capsule (b, i, j)
// at b * element + i * row + j * capsule, its values contiguous (capsule is 0 for inputs without
// a J dimension: u of dense_capsules, pose of em_routing_pose).
struct CapsuleStrides {
  int64_t element, row, capsule;
  CAPSROUTE_HD int64_t offset(int64_t b, int64_t i, int64_t j = 0) const {
    return b * element + i * row + j * capsule;
  }
};

// The strides of the rows (b, i) of a contiguous (B, I, J, D) tensor (JD = J * D), for the CUDA
// kernels that take a row's J x D values as one contiguous run (capsule stride unused).
CAPSROUTE_HD CapsuleStrides packed_rows(int64_t I, int64_t JD) { return {I * JD, JD, 0}; }

// The values of a 4x4 pose matrix, row-major: H of em_routing_pose.
constexpr int64_t kPoseSize = 16;

}  // namespace capsroute
