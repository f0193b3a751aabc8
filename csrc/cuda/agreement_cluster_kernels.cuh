// Dynamic routing on sm_90 (the "v2-cluster" path), an element per cluster of blocks, each block
// holding its part of the element's rows' votes in shared memory, so that the votes cross HBM once
// per direction (docs/kernels.md, "CUDA, v2"):
//   - the forward on clusters of kClusterBlocks, every iteration on the votes in shared memory;
//   - the backward on clusters of kBackwardClusterBlocks, the couplings and their gradients in
//     shared memory too, the vote gradient written from there.
// The rows are routed by the warp-rows device code (agreement_warp_rows_kernels.cuh) reading shared
// memory; the sums over the element's rows (s^r forward, gv^r backward) meet in the blocks'
// shared memory through the cluster (distributed shared memory), and every block adds them in
// the same order, so each holds the bitwise same values. Launched only where use_clusters
// allows it (the loaded code built for sm_90 or later: elsewhere the bodies trap).
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "agreement_block_kernels.cuh"
#include "agreement_warp_rows_kernels.cuh"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Blocks per cluster (the portable maximum): an element's rows are cut into this many parts.
constexpr int kClusterBlocks = 8;

// Element b's rows `rows` into shared memory, capsule q of them at votes_s + q * stride: a
// capsule's vector per thread (consecutive threads read a row's consecutive capsules), unrolled
// so that each thread keeps two vectors' loads in flight. (q / J in 32 bits: q counts the
// capsules a block holds in shared memory.)
template <int kD, typename Source>
__device__ __forceinline__ void copy_rows_to_shared(const Source& src, int64_t b, RowRange rows,
                                                    int64_t J, int D, int64_t stride, bool vectors,
                                                    typename Source::acc_type* votes_s) {
  using acc_t = typename Source::acc_type;
  const int J32 = static_cast<int>(J);
#pragma unroll 2
  for (int q = threadIdx.x; q < static_cast<int>(rows.end - rows.begin) * J32; q += blockDim.x) {
    const int row = q / J32;
    acc_t u[kD];
    load_capsule(src.row(b, rows.begin + row) + (q - row * J32) * D, D, true, vectors, u);
#pragma unroll
    for (int d = 0; d < kD; ++d)
      if (d < D) votes_s[q * stride + d] = u[d];
  }
}

// Walks f(i, valid, u) over a warp's rows warp_rows (local to the block) in shared memory,
// lanes.rows at a time, u the lane's capsule's votes at votes_s (zeros unless with_votes). (Rows
// in shared memory need no loads ahead, whose registers would spill here.)
template <int kD, typename acc_t, typename F>
__device__ __forceinline__ void for_each_shared_row(const CapsuleLanes& lanes, RowRange warp_rows,
                                                    const acc_t* votes_s, int64_t J, int D,
                                                    int64_t stride, bool with_votes, F&& f) {
  for (int64_t i0 = warp_rows.begin; i0 < warp_rows.end; i0 += lanes.rows) {
    const int64_t i = i0 + lanes.slot;
    const bool valid = lanes.active && i < warp_rows.end;
    acc_t u[kD];
    load_capsule(votes_s + (i * J + lanes.j) * stride, D, valid && with_votes, false, u);
    f(i, valid, u);
  }
}

// out = init (or 0 where init is nullptr) + the sums x over every row of the cluster's blocks
// (each warp's over its rows, as store_part takes them), the blocks' sums added in rank order,
// so that every block gets the bitwise same out. block_sums: this block's (J, D) sums for the
// cluster to read, alternating between two buffers from one call to the next (a block may still
// read the previous call's when another writes this one's). Ends with out complete.
template <int kBlocks, int kD, typename acc_t, typename init_t>
__device__ __forceinline__ void cluster_sum(const CapsuleLanes& lanes, acc_t (&x)[kD], int D,
                                            int64_t JD, acc_t* warp_sums_s, acc_t* block_sums,
                                            const init_t* init, acc_t* out) {
  store_part(lanes, x, threadIdx.x / kWarpSize, D, JD, warp_sums_s);
  __syncthreads();  // the warps' sums complete
  sum_ranges(warp_sums_s, kWarpsPerBlock, 0, JD, static_cast<const acc_t*>(nullptr), block_sums);
  cluster_sync();  // every block's sums complete and visible to the cluster
  for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) {
    acc_t sum = init != nullptr ? static_cast<acc_t>(init[jd]) : acc_t(0);
    for (unsigned q = 0; q < kBlocks; ++q) sum += cluster_shared(block_sums, q)[jd];
    out[jd] = sum;
  }
  __syncthreads();  // out complete
}

// The shared memory of a block, in acc_t: its rows' votes (rows x J capsules of D values, each
// capsule at an odd stride, capsule_stride, so that the lanes of a row, a capsule each, read
// distinct banks), their logits (rows x J), each warp's sums over its rows (8 x J x D), the
// block's sums of the last two iterations, which the cluster reads (2 x J x D, by iteration
// parity), the element's s (J x D) and v (J at capsule_stride: each lane reads its capsule's v).
struct ClusterForwardLayout {
  int64_t rows, J, JD, capsule_stride;
  __host__ __device__ __forceinline__ ClusterForwardLayout(const RoutingDims& dims)
      : rows(ceil_div<int64_t>(dims.I, kClusterBlocks)),
        J(dims.J),
        JD(dims.J * dims.D),
        capsule_stride(dims.D | 1) {}
  __host__ __device__ __forceinline__ int64_t logits() const { return rows * J * capsule_stride; }
  __host__ __device__ __forceinline__ int64_t warp_sums() const { return logits() + rows * J; }
  __host__ __device__ __forceinline__ int64_t block_sums() const {
    return warp_sums() + kWarpsPerBlock * JD;
  }
  __host__ __device__ __forceinline__ int64_t s() const { return block_sums() + 2 * JD; }
  __host__ __device__ __forceinline__ int64_t v() const { return s() + JD; }
  __host__ __device__ __forceinline__ int64_t size() const { return v() + J * capsule_stride; }
};

// Writes s_hist (B, iters, J, D), v_out (B, J, D) and the final coupling c_out (B, I, J) unless
// nullptr, as the other forward paths do. bias (J, D) or nullptr. Grid: whole clusters, grid-stride
// over elements.
template <typename Source, typename scalar_t, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_forward_cluster_kernel(const Source src, const scalar_t* bias, const RoutingDims dims,
                                   const typename Source::acc_type eps,
                                   typename Source::acc_type* s_hist, scalar_t* v_out,
                                   scalar_t* c_out) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, R = dims.iters;
  const int D = static_cast<int>(dims.D), tid = threadIdx.x, lane = tid % kWarpSize,
            warp = tid / kWarpSize;
  const ClusterForwardLayout layout(dims);
  const int64_t stride = layout.capsule_stride;
  acc_t* smem = dynamic_shared<acc_t>();
  acc_t *votes_s = smem, *logits_s = smem + layout.logits(),
        *warp_sums_s = smem + layout.warp_sums();
  acc_t *block_sums_s = smem + layout.block_sums(), *s_s = smem + layout.s(),
        *v_s = smem + layout.v();
  const unsigned rank = cluster_block_rank();
  const RowRange rows = split_rows(I, kClusterBlocks, rank);
  const RowRange warp_rows = split_rows(rows.end - rows.begin, kWarpsPerBlock, warp);  // local rows
  const CapsuleLanes lanes(J, lane);
  const bool vectors = vector_capsules(src.votes, src.rows, D);
  const int64_t clusters = gridDim.x / kClusterBlocks;
  for (int64_t b = blockIdx.x / kClusterBlocks; b < dims.B; b += clusters) {
    copy_rows_to_shared<kD>(src, b, rows, J, D, stride, vectors, votes_s);
    __syncthreads();
    for (int64_t r = 0; r < R; ++r) {
      acc_t v_prev[kD], s_sum[kD];
      load_capsule(v_s + lanes.j * stride, D, r > 0 && lanes.active, false, v_prev);  // v^{r-1}
#pragma unroll
      for (int d = 0; d < kD; ++d) s_sum[d] = 0;
      for_each_shared_row<kD>(
          lanes, warp_rows, votes_s, J, D, stride, true,
          [&](int64_t i, bool valid, const acc_t(&u)[kD]) {
            const acc_t c = route_row_forward(lanes, valid, dims, r, u, v_prev,
                                              logits_s + i * J + lanes.j, s_sum);
            if (valid && c_out != nullptr && r == R - 1)
              c_out[(b * I + rows.begin + i) * J + lanes.j] = static_cast<scalar_t>(c);
          });
      cluster_sum<kClusterBlocks>(lanes, s_sum, D, JD, warp_sums_s, block_sums_s + (r % 2) * JD,
                                  bias, s_s);
      if (rank == 0)
        for (int64_t jd = tid; jd < JD; jd += blockDim.x) s_hist[(b * R + r) * JD + jd] = s_s[jd];
      block_squash(s_s, J, dims.D, eps, v_s, warp, kWarpsPerBlock, lane, stride);
      __syncthreads();  // v^r complete before the next iteration reads it
      if (r == R - 1 && rank == 0)
        for (int64_t jd = tid; jd < JD; jd += blockDim.x)
          v_out[b * JD + jd] = static_cast<scalar_t>(v_s[jd / D * stride + jd % D]);
    }
    // No block refills its sums (next element) or exits while another still reads them.
    cluster_sync();
  }
#else
  __trap();  // code built for an arch without clusters: use_clusters never launches it
#endif
}

// Blocks per cluster of the backward: 16, the most an H100 schedules (non-portable: asked for
// with cudaFuncAttributeNonPortableClusterSizeAllowed), because the backward keeps its rows'
// couplings and G in shared memory too: with 1/16 of the rows each, 2 blocks fit an SM (at 1/8,
// MNIST's 135 KiB a block would leave 1).
constexpr int kBackwardClusterBlocks = 16;

// The shared memory of a backward block, in acc_t: its rows' votes as in the forward (rows x J
// at capsule_stride), their kept couplings c^r (nkeep x rows x J) and G^r = dL/db^{r+1} but the
// last, which is 0 ((nkeep - 1) x rows x J), the warps' and blocks' sums as in the forward, v^r
// for every r (iters x J at capsule_stride), gs^r for the kept r (nkeep x J at capsule_stride),
// and the element's gv (J x D).
struct ClusterBackwardLayout {
  int64_t rows, J, JD, capsule_stride, iters, nkeep;
  __host__ __device__ __forceinline__ ClusterBackwardLayout(const RoutingDims& dims, int64_t nkeep_)
      : rows(ceil_div<int64_t>(dims.I, kBackwardClusterBlocks)),
        J(dims.J),
        JD(dims.J * dims.D),
        capsule_stride(dims.D | 1),
        iters(dims.iters),
        nkeep(nkeep_) {}
  __host__ __device__ __forceinline__ int64_t coupling() const { return rows * J * capsule_stride; }
  __host__ __device__ __forceinline__ int64_t g_logits() const {
    return coupling() + nkeep * rows * J;
  }
  __host__ __device__ __forceinline__ int64_t warp_sums() const {
    return g_logits() + (nkeep - 1) * rows * J;
  }
  __host__ __device__ __forceinline__ int64_t block_sums() const {
    return warp_sums() + kWarpsPerBlock * JD;
  }
  __host__ __device__ __forceinline__ int64_t v() const { return block_sums() + 2 * JD; }
  __host__ __device__ __forceinline__ int64_t gs() const {
    return v() + iters * J * capsule_stride;
  }
  __host__ __device__ __forceinline__ int64_t gv() const {
    return gs() + nkeep * J * capsule_stride;
  }
  __host__ __device__ __forceinline__ int64_t size() const { return gv() + JD; }
};

// The whole backward of the other paths (agreement_sequence.cuh) in one launch, an element per
// cluster of kBackwardClusterBlocks blocks, grid-stride over elements: each block copies its rows'
// votes into shared memory once, recomputes their kept couplings there and takes the first step
// back on them, then walks back the other steps on the same votes (each step's gv^{r-1} summed
// over the cluster as the forward sums s^r), and writes its rows' vote gradient
//   g_u[b, i, j, d] = sum_{r >= first_r} c^r_ij gs^r_jd + G^r_ij v^r_jd
// to grad_votes (rows at grad_rows, as MemoryVotes) from shared memory: the votes cross HBM once,
// their gradient once, and no (B, I, J) state at all. grad_v (B, J, D) and s_hist (B, iters, J, D)
// in the accumulation dtype, grad_bias_items (B, J, D) = sum_r gs^r as the other paths write it.
template <typename Source, typename grad_t, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_backward_cluster_kernel(const Source src, const typename Source::acc_type* grad_v,
                                    const typename Source::acc_type* s_hist, const RoutingDims dims,
                                    const typename Source::acc_type eps, const int64_t first_r,
                                    typename Source::acc_type* grad_bias_items,
                                    const CapsuleStrides grad_rows, grad_t* grad_votes) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, R = dims.iters, nkeep = R - first_r;
  const int D = static_cast<int>(dims.D), tid = threadIdx.x, lane = tid % kWarpSize,
            warp = tid / kWarpSize;
  const ClusterBackwardLayout layout(dims, nkeep);
  const int64_t stride = layout.capsule_stride;
  acc_t* smem = dynamic_shared<acc_t>();
  acc_t *votes_s = smem, *c_s = smem + layout.coupling(), *g_s = smem + layout.g_logits();
  acc_t *warp_sums_s = smem + layout.warp_sums(), *block_sums_s = smem + layout.block_sums();
  acc_t *v_s = smem + layout.v(), *gs_s = smem + layout.gs(), *gv_s = smem + layout.gv();
  const unsigned rank = cluster_block_rank();
  const RowRange rows = split_rows(I, kBackwardClusterBlocks, rank);
  const int64_t n = layout.rows * J;  // values per kept iteration of c_s and g_s
  const RowRange warp_rows = split_rows(rows.end - rows.begin, kWarpsPerBlock, warp);  // local rows
  const CapsuleLanes lanes(J, lane);
  const bool vectors = vector_capsules(src.votes, src.rows, D),
             grad_vectors = vector_capsules(grad_votes, grad_rows, D);
  const auto for_each_local_row = [&](bool with_votes, auto&& f) {
    for_each_shared_row<kD>(lanes, warp_rows, votes_s, J, D, stride, with_votes, f);
  };
  const int64_t clusters = gridDim.x / kBackwardClusterBlocks;
  for (int64_t b = blockIdx.x / kBackwardClusterBlocks; b < dims.B; b += clusters) {
    copy_rows_to_shared<kD>(src, b, rows, J, D, stride, vectors, votes_s);
    // v^r = squash(s^r) for every r, gv = grad_v and gs^{iters-1} (every block the same).
    block_squash(s_hist + b * R * JD, R * J, dims.D, eps, v_s, warp, kWarpsPerBlock, lane, stride);
    for (int64_t jd = tid; jd < JD; jd += blockDim.x) gv_s[jd] = grad_v[b * JD + jd];
    __syncthreads();  // votes, v and gv complete
    block_squash_vjp(s_hist + (b * R + R - 1) * JD, gv_s, J, dims.D, eps,
                     gs_s + (nkeep - 1) * J * stride, stride);
    __syncthreads();  // gs^{iters-1} complete
    // Walk the iterations back (step r: G^{r-1} and gv^{r-1} from G^r and gs^r), the first step
    // with the couplings' recompute, on the same votes.
    for (int64_t r = R - 1; r > first_r || r == R - 1; --r) {
      const int64_t k_r = r - first_r;
      acc_t gs[kD], gv_sum[kD];
      load_capsule(gs_s + (k_r * J + lanes.j) * stride, D, lanes.active && r > first_r, false, gs);
#pragma unroll
      for (int d = 0; d < kD; ++d) gv_sum[d] = 0;
      for_each_local_row(true, [&](int64_t i, bool valid, const acc_t(&u)[kD]) {
        const int64_t ij = i * J + lanes.j;
        acc_t c = 0, g_next = 0;
        if (r == R - 1) {
          acc_t logit = 0;
          for (int64_t t = 0; t < R; ++t) {
            if (t > 0) {
              acc_t v_prev[kD];
              load_capsule(v_s + ((t - 1) * J + lanes.j) * stride, D, valid, false, v_prev);
              logit += capsule_dot(u, v_prev);
            }
            if (t < first_r) continue;
            c = row_softmax(lanes, valid, dims.leaky, logit);
            if (valid) c_s[(t - first_r) * n + ij] = c;
          }
        } else if (valid) {
          c = c_s[k_r * n + ij];
          g_next = g_s[k_r * n + ij];
        }
        if (r == first_r) return;  // detach or one iteration: nothing to walk back
        const acc_t g = walk_back_row(lanes, valid, u, gs, c, g_next, gv_sum);
        if (valid) g_s[(k_r - 1) * n + ij] = g;
      });
      if (r == first_r) break;
      cluster_sum<kBackwardClusterBlocks>(lanes, gv_sum, D, JD, warp_sums_s,
                                          block_sums_s + (r % 2) * JD,
                                          static_cast<const acc_t*>(nullptr), gv_s);
      block_squash_vjp(s_hist + (b * R + r - 1) * JD, gv_s, J, dims.D, eps,
                       gs_s + (k_r - 1) * J * stride, stride);
      __syncthreads();  // gs^{r-1} complete
    }
    // The block's rows' vote gradient (each lane's c and G are its own writes; gs is complete), at
    // grad_lane, which steps with the lane's row.
    grad_t* grad_lane =
        grad_votes + grad_rows.offset(b, rows.begin + warp_rows.begin + lanes.slot) + lanes.j * D;
    for_each_local_row(false, [&](int64_t i, bool valid, const acc_t(&)[kD]) {
      acc_t grad[kD];
#pragma unroll
      for (int d = 0; d < kD; ++d) grad[d] = 0;
      for (int64_t k = 0; k < nkeep; ++k) {
        acc_t x[kD];
        const acc_t c = valid ? c_s[k * n + i * J + lanes.j] : acc_t(0);
        load_capsule(gs_s + (k * J + lanes.j) * stride, D, valid, false, x);
#pragma unroll
        for (int d = 0; d < kD; ++d) grad[d] += c * x[d];
        if (k == nkeep - 1) continue;  // G^{iters-1} = 0
        const acc_t g = valid ? g_s[k * n + i * J + lanes.j] : acc_t(0);
        load_capsule(v_s + ((first_r + k) * J + lanes.j) * stride, D, valid, false, x);
#pragma unroll
        for (int d = 0; d < kD; ++d) grad[d] += g * x[d];
      }
      if (valid) store_capsule(grad_lane, D, grad_vectors, grad);
      grad_lane += lanes.rows * grad_rows.row;
    });
    if (rank == 0)
      for (int64_t jd = tid; jd < JD; jd += blockDim.x) {
        const int64_t j = jd / dims.D, d = jd % dims.D;
        acc_t sum = 0;
        for (int64_t k = nkeep - 1; k >= 0; --k) sum += gs_s[(k * J + j) * stride + d];
        grad_bias_items[b * JD + jd] = sum;
      }
    // No block refills its shared memory (next element) or exits while another still reads it.
    cluster_sync();
  }
#else
  __trap();  // code built for an arch without clusters: use_clusters never launches it
#endif
}

}  // namespace cuda
}  // namespace capsroute
