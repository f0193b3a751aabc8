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

// The shared memory of a block, in acc_t: its rows' votes (rows x J capsules of D values, each
// capsule at an odd stride, capsule_stride, so that the lanes of a row, a capsule each, read
// distinct banks), their logits (rows x J), each warp's sums over its rows (8 x J x D), the
// block's sums of the last two iterations, which the cluster reads (2 x J x D, by iteration
// parity), and the element's s and v (J x D each).
struct ClusterForwardLayout {
  int64_t rows, J, JD, capsule_stride;
  __host__ __device__ __forceinline__ ClusterForwardLayout(const RoutingDims& dims)
      : rows(ceil_div<int64_t>(dims.I, kClusterBlocks)), J(dims.J), JD(dims.J * dims.D), capsule_stride(dims.D | 1) {}
  __host__ __device__ __forceinline__ int64_t logits() const { return rows * J * capsule_stride; }
  __host__ __device__ __forceinline__ int64_t warp_sums() const { return logits() + rows * J; }
  __host__ __device__ __forceinline__ int64_t block_sums() const { return warp_sums() + kWarpsPerBlock * JD; }
  __host__ __device__ __forceinline__ int64_t s() const { return block_sums() + 2 * JD; }
  __host__ __device__ __forceinline__ int64_t v() const { return s() + JD; }
  __host__ __device__ __forceinline__ int64_t size() const { return v() + JD; }
};

// Writes s_hist (B, iters, J, D), v_out (B, J, D) and the final coupling c_out (B, I, J), as the
// other forward paths do. bias (J, D) or nullptr. Grid: whole clusters, grid-stride over elements.
template <typename Source, typename scalar_t, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_forward_cluster_kernel(const Source src, const scalar_t* bias, const RoutingDims dims,
                                   const typename Source::acc_type eps, typename Source::acc_type* s_hist,
                                   scalar_t* v_out, scalar_t* c_out) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, R = dims.iters;
  const int D = static_cast<int>(dims.D), tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const ClusterForwardLayout layout(dims);
  const int64_t stride = layout.capsule_stride;
  acc_t* smem = dynamic_shared<acc_t>();
  acc_t *votes_s = smem, *logits_s = smem + layout.logits(), *warp_sums_s = smem + layout.warp_sums();
  acc_t *block_sums_s = smem + layout.block_sums(), *s_s = smem + layout.s(), *v_s = smem + layout.v();
  const unsigned rank = cluster_block_rank();
  const RowRange rows = split_rows(I, kClusterBlocks, rank);
  const RowRange warp_rows = split_rows(rows.end - rows.begin, kWarpsPerBlock, warp);  // local rows
  const CapsuleLanes lanes(J, lane);
  const bool vectors = vector_capsules(src.row(0, 0), D);
  const int64_t clusters = gridDim.x / kClusterBlocks;
  for (int64_t b = blockIdx.x / kClusterBlocks; b < dims.B; b += clusters) {
    // The block's rows' votes, once: a capsule's vector per thread (the rows are contiguous in
    // memory, so consecutive threads read consecutive vectors), unrolled so that each thread
    // keeps two vectors' loads in flight.
    const auto* votes_b = src.row(b, rows.begin);
#pragma unroll 2
    for (int64_t q = tid; q < (rows.end - rows.begin) * J; q += blockDim.x) {
      acc_t u[kD];
      load_capsule(votes_b + q * D, D, true, vectors, u);
#pragma unroll
      for (int d = 0; d < kD; ++d)
        if (d < D) votes_s[q * stride + d] = u[d];
    }
    __syncthreads();
    for (int64_t r = 0; r < R; ++r) {
      acc_t v_prev[kD], s_sum[kD];
      load_capsule(v_s + lanes.j * D, D, r > 0 && lanes.active, false, v_prev);  // v^{r-1}
#pragma unroll
      for (int d = 0; d < kD; ++d) s_sum[d] = 0;
      // (Rows in shared memory need no loads ahead, whose registers would spill here.)
      for (int64_t i0 = warp_rows.begin; i0 < warp_rows.end; i0 += lanes.rows) {
        const int64_t i = i0 + lanes.slot;
        const bool valid = lanes.active && i < warp_rows.end;
        acc_t u[kD];
        load_capsule(votes_s + (i * J + lanes.j) * stride, D, valid, false, u);
        const acc_t c = route_row_forward(lanes, valid, dims, r, u, v_prev, logits_s + i * J + lanes.j, s_sum);
        if (valid && r == R - 1) c_out[(b * I + rows.begin + i) * J + lanes.j] = static_cast<scalar_t>(c);
      }
      store_part(lanes, s_sum, warp, D, JD, warp_sums_s);
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
