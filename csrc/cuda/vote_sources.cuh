// The vote sources of the routing kernels: where a kernel reads vote (b, i, j, k) from. The kernels
// are templated on one (agreement_block_kernels.cuh, agreement_warp_rows_kernels.cuh,
// agreement_cluster_kernels.cuh, em_kernels.cuh), a functor with
//   using acc_type = ...;                                    // accumulation type
//   __device__ acc_type operator()(int64_t b, int64_t i, int64_t jk) const;
// returning vote [b, i, j, k] with jk = j * K + k (K: the capsule size, D or H).
#pragma once

#include <cstdint>

#include "../common/dims.h"

namespace capsroute {
namespace cuda {

// votes (B, I, J, D) at any strides over b and i, each row (b, i) of J x D votes contiguous
// (docs/ops.md, "Layouts"): row (b, i) at rows.offset(b, i) (the capsule stride unused;
// packed_rows where contiguous). Rows, not capsules: a capsule stride of its own costs a 64-bit
// division per vote in the block kernels, which index a row by jd.
template <typename scalar_t, typename acc_t>
struct MemoryVotes {
  using acc_type = acc_t;
  const scalar_t* votes;
  CapsuleStrides rows;
  __device__ __forceinline__ acc_t operator()(int64_t b, int64_t i, int64_t jd) const {
    return static_cast<acc_t>(row(b, i)[jd]);
  }
  // Row (b, i)'s J * D votes (the warp-rows kernels index it in 32-bit arithmetic).
  __device__ __forceinline__ const scalar_t* row(int64_t b, int64_t i) const {
    return votes + rows.offset(b, i);
  }
};

// V[b, i, j, (r, c)] = sum_k P[b, i, r, k] W[i, j, k, c] in the accumulation type, k in order
// (the CPU's compute_votes): pose (B, I, 4, 4) at any strides over b and i (pose_strides), each
// P_bi's 16 values contiguous; weight (I, J, 4, 4) contiguous; H = 16, jh = j * 16 + r * 4 + c.
template <typename scalar_t, typename acc_t>
struct PoseVotes {
  using acc_type = acc_t;
  const scalar_t* pose;
  CapsuleStrides pose_strides;
  const scalar_t* weight;
  int64_t J;
  __device__ __forceinline__ acc_t operator()(int64_t b, int64_t i, int64_t jh) const {
    const int64_t j = jh / kPoseSize, rc = jh - j * kPoseSize, r = rc / 4, c = rc - r * 4;
    const scalar_t* P = pose + pose_strides.offset(b, i) + r * 4;  // row r of P_i
    const scalar_t* W = weight + (i * J + j) * kPoseSize + c;      // column c of W_ij
    acc_t sum = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) sum += static_cast<acc_t>(P[k]) * static_cast<acc_t>(W[k * 4]);
    return sum;
  }
};

}  // namespace cuda
}  // namespace capsroute
