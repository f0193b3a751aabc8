// The squash kernel of capsroute.squash (forward and backward). Device code only: the launch is
// in squash_cuda.cu, and tests/emulator runs the kernel on the host.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// out = squash(s) (forward) or squash_vjp(s, grad) (backward), rows of length D.
// Warp per row; the row loop is uniform per warp, so the reductions see all 32 lanes.
template <bool kBackward, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    squash_rows_kernel(const scalar_t* s, const scalar_t* grad, scalar_t* out, int64_t rows,
                       int64_t D, acc_t eps) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t first_row =
      static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = first_row; row < rows; row += row_stride) {
    const scalar_t* x = s + row * D;
    const scalar_t* g = kBackward ? grad + row * D : nullptr;
    scalar_t* o = out + row * D;
    acc_t q = 0, sg = 0;
    for (int64_t d = lane; d < D; d += kWarpSize) {
      const acc_t xd = static_cast<acc_t>(x[d]);
      q += xd * xd;
      if (kBackward) sg += xd * static_cast<acc_t>(g[d]);
    }
    q = warp_sum(q);
    if (kBackward) {
      sg = warp_sum(sg);
      const SquashVjp<acc_t> k = squash_vjp_coeffs(q, eps);
      for (int64_t d = lane; d < D; d += kWarpSize)
        o[d] = static_cast<scalar_t>(k.scale * static_cast<acc_t>(g[d]) +
                                     k.radial * sg * static_cast<acc_t>(x[d]));
    } else {
      const acc_t scale = squash_scale(q, eps);
      for (int64_t d = lane; d < D; d += kWarpSize)
        o[d] = static_cast<scalar_t>(scale * static_cast<acc_t>(x[d]));
    }
  }
}

}  // namespace cuda
}  // namespace capsroute
