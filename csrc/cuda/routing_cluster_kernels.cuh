// The v2 kernel set's dynamic routing forward on sm_90 (bench/NOTES.md, GPU section 7): an
// element per cluster of kClusterBlocks blocks, each block holding its part of the element's rows'
// votes in shared memory for every iteration, so the votes are read from HBM once per forward
// instead of once per iteration. The rows are routed by the warp-rows device code
// (routing_warp_kernels.cuh) reading shared memory; the iterations' sums over the element's rows
// meet in the blocks' shared memory through the cluster (distributed shared memory), and every
// block adds them in the same order, so each holds the bitwise same s^r and v^r. Launched only
// where use_cluster_forward allows it (the loaded code built for sm_90 or later: elsewhere the body traps).
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "device_utils.cuh"
#include "routing_kernels.cuh"
#include "routing_warp_kernels.cuh"

namespace capsroute {
namespace cuda {

// Blocks per cluster (the portable maximum): an element's rows are cut into this many parts.
constexpr int kClusterBlocks = 8;

// The shared memory of a block, in acc_t: its rows' votes (rows x J x D), their logits (rows x J),
// each warp's sums over its rows (8 x J x D), the block's sums of the last two iterations, which the
// cluster reads (2 x J x D, by iteration parity), and the element's s and v (J x D each).
struct ClusterForwardLayout {
  int64_t rows, J, JD;
  __host__ __device__ __forceinline__ ClusterForwardLayout(const RoutingDims& dims)
      : rows(ceil_div<int64_t>(dims.I, kClusterBlocks)), J(dims.J), JD(dims.J * dims.D) {}
  __host__ __device__ __forceinline__ int64_t logits() const { return rows * JD; }
  __host__ __device__ __forceinline__ int64_t warp_sums() const { return logits() + rows * J; }
  __host__ __device__ __forceinline__ int64_t block_sums() const { return warp_sums() + kWarpsPerBlock * JD; }
  __host__ __device__ __forceinline__ int64_t s() const { return block_sums() + 2 * JD; }
  __host__ __device__ __forceinline__ int64_t v() const { return s() + JD; }
  __host__ __device__ __forceinline__ int64_t size() const { return v() + JD; }
};

// Rows of votes in shared memory, as a vote source of the warp-rows device code (row(b, i): local
// row i of the block, b unused).
template <typename acc_t>
struct SharedRows {
  using acc_type = acc_t;
  const acc_t* votes;
  int64_t JD;
  __device__ __forceinline__ const acc_t* row(int64_t, int64_t i) const { return votes + i * JD; }
};

// Writes s_hist (B, iters, J, D), v_out (B, J, D) and the final coupling c_out (B, I, J), as the
// other forward paths do. bias (J, D) or nullptr. Grid: whole clusters, grid-stride over elements.
template <typename Source, typename scalar_t, int kGroups>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_forward_cluster_kernel(const Source src, const scalar_t* bias, const RoutingDims dims,
                                   const typename Source::acc_type eps, typename Source::acc_type* s_hist,
                                   scalar_t* v_out, scalar_t* c_out) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, R = dims.iters;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const ClusterForwardLayout layout(dims);
  acc_t* smem = dynamic_shared<acc_t>();
  acc_t *votes_s = smem, *logits_s = smem + layout.logits(), *warp_sums_s = smem + layout.warp_sums();
  acc_t *block_sums_s = smem + layout.block_sums(), *s_s = smem + layout.s(), *v_s = smem + layout.v();
  const unsigned rank = cluster_block_rank();
  const RowRange rows = split_rows(I, kClusterBlocks, rank);
  const RowRange warp_rows = split_rows(rows.end - rows.begin, kWarpsPerBlock, warp);  // local rows
  const WarpSlots slots(J, dims.D, lane);
  const SharedRows<acc_t> shared_rows{votes_s, JD};
  const int64_t clusters = gridDim.x / kClusterBlocks;
  for (int64_t b = blockIdx.x / kClusterBlocks; b < dims.B; b += clusters) {
    // The block's rows' votes, once (contiguous in memory: one coalesced copy, unrolled so that
    // each thread keeps several loads in flight).
    const auto* votes_b = src.row(b, rows.begin);
#pragma unroll 4
    for (int64_t idx = tid; idx < (rows.end - rows.begin) * JD; idx += blockDim.x)
      votes_s[idx] = static_cast<acc_t>(votes_b[idx]);
    __syncthreads();
    for (int64_t r = 0; r < R; ++r) {
      acc_t v_prev[kGroups], s_sum[kGroups];
#pragma unroll
      for (int k = 0; k < kGroups; ++k) v_prev[k] = s_sum[k] = 0;
      if (r > 0) load_slab(v_s, slots, v_prev);
      // (Rows in shared memory need no loads ahead, whose registers would spill here.)
      for (int64_t i = warp_rows.begin; i < warp_rows.end; ++i) {
        acc_t u[kGroups], x[kGroups];
        load_row(shared_rows, slots, 0, i, u);
        route_row_forward(slots, dims, r, u, v_prev, logits_s + i * J, x, s_sum);
        if (r == R - 1) store_row_coupling(slots, x, c_out + (b * I + rows.begin + i) * J);
      }
      store_part(slots, s_sum, warp, JD, warp_sums_s);
      __syncthreads();  // the warps' sums complete
      acc_t* block_sums = block_sums_s + (r % 2) * JD;
      sum_ranges(warp_sums_s, kWarpsPerBlock, 0, JD, static_cast<const acc_t*>(nullptr), block_sums);
      cluster_sync();  // every block's sums of iteration r complete and visible to the cluster
      for (int64_t jd = tid; jd < JD; jd += blockDim.x) {
        acc_t sum = bias != nullptr ? static_cast<acc_t>(bias[jd]) : acc_t(0);
        for (unsigned q = 0; q < kClusterBlocks; ++q) sum += cluster_shared(block_sums, q)[jd];
        s_s[jd] = sum;
        if (rank == 0) s_hist[(b * R + r) * JD + jd] = sum;
      }
      __syncthreads();  // s^r complete
      block_squash(s_s, J, dims.D, eps, v_s, warp, kWarpsPerBlock, lane);
      __syncthreads();  // v^r complete before the next iteration reads it
      if (r == R - 1 && rank == 0)
        for (int64_t jd = tid; jd < JD; jd += blockDim.x) v_out[b * JD + jd] = static_cast<scalar_t>(v_s[jd]);
    }
    // No block refills its sums (next element) or exits while another still reads them.
    cluster_sync();
  }
#else
  __trap();  // code built for an arch without clusters: use_cluster_forward never launches it
#endif
}

}  // namespace cuda
}  // namespace capsroute
