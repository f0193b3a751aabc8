// The v2 kernel set's dynamic routing rows (CAPSROUTE_CUDA_KERNELS=v2, votes read from memory,
// warp_rows_fit): a warp per part of an element's rows, each row's votes read once per pass,
// coalesced, into registers and routed there. The block kernels of routing_kernels.cuh read a
// row with a lane per capsule and a serial loop over d (10 of 32 lanes busy at J = 10, lanes
// 64 bytes apart), then again by column owners behind two barriers per tile (bench/NOTES.md,
// GPU section 6).
//
// Slots. Lane l of a warp holds, in group k = 0 .. groups-1, the vote entry (j, d) with
//   j = k * (32 / seg) + l / seg,  d = l % seg,  seg = the power of two >= D (D <= 32),
// so that a capsule's D entries sit in one segment of seg consecutive lanes and a row's groups
// are kWarpRowGroups coalesced loads at most. A capsule's dot products are segment sums (xor
// butterflies inside the segment: every lane of it gets the bitwise same value), so its logit,
// coupling and logit gradient are held by all of its segment's lanes; lane d = 0 writes them.
//
// Each warp routes its part's rows alone: no shared memory, no block barrier. Its sums over the
// rows (s forward, gv walking back) go to its own partial slab, which the reduce kernels of
// routing_kernels.cuh add up per element in part order (deterministic), as they do the block
// kernels' row ranges.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "device_utils.cuh"
#include "routing_kernels.cuh"

namespace capsroute {
namespace cuda {

// Most groups a lane holds (registers per row and per sum): J * seg <= 256, e.g. J = 10 and
// D = 16 (MNIST) is 5 groups. Larger capsule layers keep the block kernels.
constexpr int kWarpRowGroups = 8;

// Lanes per capsule: the power of two >= D (D <= kWarpSize).
__host__ __device__ __forceinline__ int segment_lanes(int64_t D) {
  int seg = 1;
  while (seg < D) seg *= 2;
  return seg;
}

// Groups of a row: ceil(J / capsules per group), for D <= kWarpSize.
__host__ __device__ __forceinline__ int64_t warp_row_groups(int64_t J, int64_t D) {
  return ceil_div<int64_t>(J, kWarpSize / segment_lanes(D));
}

// Resident blocks per SM asked of ptxas: unhinted, the float32 kernels took 106-144 registers on
// sm_90 (1-2 blocks of 256 threads: as few as 8 warps per SM to keep loads in flight); 2 blocks
// (up to 128 registers) puts them at 103-124 with no spill on sm_80 and sm_90. float64 needs more
// than 128 (bench/NOTES.md, GPU section 6).
template <typename acc_t>
constexpr int warp_rows_min_blocks() {
  return sizeof(acc_t) == 8 ? 1 : 2;
}

// Whether the warp-rows kernels take these capsules (D first: warp_row_groups needs D <= 32).
inline bool warp_rows_fit(const RoutingDims& dims) {
  return dims.D <= kWarpSize && warp_row_groups(dims.J, dims.D) <= kWarpRowGroups;
}

// The slots of one lane (see the top of the file), in 32-bit arithmetic (J * seg <= 256 where the
// warp kernels run, warp_rows_fit) and with the per-group conditions as bit masks: registers are
// what limits these kernels.
struct WarpSlots {
  int groups, seg;
  int jd0, jd_step;      // group k's flat (j, d) index: jd0 + k * jd_step
  int j0, j_step;        // group k's capsule: j0 + k * j_step
  unsigned capsules;     // bit k: group k holds a capsule (its logit)
  unsigned entries;      // bit k: group k holds a vote entry (d < D too)
  unsigned writers;      // bit k: group k writes its capsule's values (d = 0)
  __device__ __forceinline__ WarpSlots(int64_t J, int64_t D, int lane)
      : groups(static_cast<int>(warp_row_groups(J, D))), seg(segment_lanes(D)), capsules(0), entries(0), writers(0) {
    const int d = lane % seg;
    j0 = lane / seg;
    j_step = kWarpSize / seg;
    jd0 = j0 * static_cast<int>(D) + d;
    jd_step = j_step * static_cast<int>(D);
    for (int k = 0; k < groups; ++k) {
      const bool holds_capsule = j0 + k * j_step < J;
      capsules |= unsigned(holds_capsule) << k;
      entries |= unsigned(holds_capsule && d < D) << k;
      writers |= unsigned(holds_capsule && d == 0) << k;
    }
  }
  __device__ __forceinline__ int j(int k) const { return j0 + k * j_step; }
  __device__ __forceinline__ int jd(int k) const { return jd0 + k * jd_step; }
  __device__ __forceinline__ bool capsule(int k) const { return (capsules >> k) & 1u; }
  __device__ __forceinline__ bool entry(int k) const { return (entries >> k) & 1u; }
  __device__ __forceinline__ bool writer(int k) const { return (writers >> k) & 1u; }
};

// Sum over the lanes of each segment of seg lanes (a power of two); every lane gets its
// segment's sum. All 32 lanes call it together.
template <typename T>
__device__ __forceinline__ T segment_sum(T x, int seg) {
  for (int offset = seg / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The (element b, part p) items of a warp-rows kernel, grid-stride over the grid's warps, item =
// b * parts + p: f(b, item, rows of part p). The loop bounds are uniform per warp.
template <typename F>
__device__ __forceinline__ void for_each_warp_part(int64_t B, int64_t I, int64_t parts, F&& f) {
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  for (int64_t item = blockIdx.x * warps_per_block + threadIdx.x / kWarpSize; item < B * parts;
       item += gridDim.x * warps_per_block)
    f(item / parts, item, split_rows(I, parts, item % parts));
}

// One row's votes into the lane's groups (0 where the lane holds no entry).
template <int kGroups, typename Source>
__device__ __forceinline__ void load_row(const Source& src, const WarpSlots& slots, int64_t b, int64_t i,
                                         typename Source::acc_type (&u)[kGroups]) {
  using acc_t = typename Source::acc_type;
  const auto* row = src.row(b, i);
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    u[k] = k < slots.groups && slots.entry(k) ? static_cast<acc_t>(row[slots.jd(k)]) : acc_t(0);
}

// The rows of a part in order, each row's votes loaded into registers one row ahead (two rows'
// loads in flight per warp: a warp's row is only kWarpRowGroups loads of 128 bytes, too few to
// cover the memory latency at 16 warps per SM): f(i, u) with u the votes of row i.
template <int kGroups, typename Source, typename F>
__device__ __forceinline__ void for_each_row(const Source& src, const WarpSlots& slots, int64_t b, RowRange rows,
                                             F&& f) {
  using acc_t = typename Source::acc_type;
  acc_t next[kGroups];
  if (rows.begin < rows.end) load_row(src, slots, b, rows.begin, next);
  for (int64_t i = rows.begin; i < rows.end; ++i) {
    acc_t u[kGroups];
#pragma unroll
    for (int k = 0; k < kGroups; ++k) u[k] = next[k];
    if (i + 1 < rows.end) load_row(src, slots, b, i + 1, next);
    f(i, u);
  }
}

// The lane's groups of an element's (J, D) slab (0 where the lane holds no entry).
template <int kGroups, typename acc_t>
__device__ __forceinline__ void load_slab(const acc_t* slab, const WarpSlots& slots, acc_t (&x)[kGroups]) {
#pragma unroll
  for (int k = 0; k < kGroups; ++k) x[k] = k < slots.groups && slots.entry(k) ? slab[slots.jd(k)] : acc_t(0);
}

// logit[k] += <u_j, v_j> for the lane's capsules.
template <int kGroups, typename acc_t>
__device__ __forceinline__ void add_agreement(const WarpSlots& slots, const acc_t (&u)[kGroups],
                                              const acc_t (&v)[kGroups], acc_t (&logit)[kGroups]) {
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    if (k < slots.groups) logit[k] += segment_sum(u[k] * v[k], slots.seg);
}

// x = softmax over the row's J logits x (an extra zero logit when leaky, its share dropped), as
// warp_coupling_row; 0 in groups without a capsule.
template <int kGroups, typename acc_t>
__device__ __forceinline__ void softmax_in_place(const WarpSlots& slots, bool leaky, acc_t (&x)[kGroups]) {
  acc_t max_logit = leaky ? acc_t(0) : neg_infinity(acc_t(0));
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    if (k < slots.groups && slots.capsule(k)) max_logit = x[k] > max_logit ? x[k] : max_logit;
  max_logit = warp_max(max_logit);
  acc_t denom = 0;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) {
    x[k] = k < slots.groups && slots.capsule(k) ? acc_exp(x[k] - max_logit) : acc_t(0);
    if (slots.writer(k)) denom += x[k];
  }
  denom = warp_sum(denom);
  if (leaky) denom += acc_exp(-max_logit);
  const acc_t inv_denom = acc_t(1) / denom;
#pragma unroll
  for (int k = 0; k < kGroups; ++k) x[k] *= inv_denom;
}

// The lane's groups of a sum over rows into part `item`'s (J, D) slab of partial.
template <int kGroups, typename acc_t>
__device__ __forceinline__ void store_part(const WarpSlots& slots, const acc_t (&x)[kGroups], int64_t item, int64_t JD,
                                           acc_t* partial) {
  acc_t* slab = partial + item * JD;
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    if (k < slots.groups && slots.entry(k)) slab[slots.jd(k)] = x[k];
}

// Iteration r of the forward on one row of votes u: b^r = b^{r-1} + <u, v^{r-1}> (b^0 = 0), kept
// between iterations in the row's logits (written at r = 1 .. iters-2, read at r = 2 .. iters-1:
// b^1 = <u, v^0>), then x = c^r = softmax(b^r) and s_sum += c^r u.
template <int kGroups, typename acc_t>
__device__ __forceinline__ void route_row_forward(const WarpSlots& slots, const RoutingDims& dims, int64_t r,
                                                  const acc_t (&u)[kGroups], const acc_t (&v_prev)[kGroups],
                                                  acc_t* logits, acc_t (&x)[kGroups], acc_t (&s_sum)[kGroups]) {
  const bool reads_logits = r > 1, writes_logits = r > 0 && r < dims.iters - 1;
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    x[k] = reads_logits && k < slots.groups && slots.capsule(k) ? logits[slots.j(k)] : acc_t(0);
  if (r > 0) add_agreement(slots, u, v_prev, x);
  if (writes_logits) {
    if (reads_logits) __syncwarp();  // every lane of a capsule has read its logit before the writer stores
#pragma unroll
    for (int k = 0; k < kGroups; ++k)
      if (k < slots.groups && slots.writer(k)) logits[slots.j(k)] = x[k];
  }
  softmax_in_place(slots, dims.leaky, x);
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    if (k < slots.groups) s_sum[k] += x[k] * u[k];
}

// The row's couplings x into c_row (J values) by the capsules' writers.
template <int kGroups, typename acc_t, typename scalar_t>
__device__ __forceinline__ void store_row_coupling(const WarpSlots& slots, const acc_t (&x)[kGroups], scalar_t* c_row) {
#pragma unroll
  for (int k = 0; k < kGroups; ++k)
    if (k < slots.groups && slots.writer(k)) c_row[slots.j(k)] = static_cast<scalar_t>(x[k]);
}

// Forward, iteration r, a warp per (b, part): route_row_forward over the part's rows (logits in
// ws.logits, c_out at the last iteration), the part's s sums in partial.
template <typename Source, typename scalar_t, int kGroups>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_forward_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts, const int64_t r,
                                     const ForwardWorkspace<typename Source::acc_type> ws, scalar_t* c_out,
                                     typename Source::acc_type* partial) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J;
  const WarpSlots slots(J, dims.D, threadIdx.x % kWarpSize);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t item, RowRange rows) {
    acc_t v_prev[kGroups], s_sum[kGroups];
#pragma unroll
    for (int k = 0; k < kGroups; ++k) v_prev[k] = s_sum[k] = 0;
    if (r > 0) load_slab(ws.v + b * J * dims.D, slots, v_prev);  // v^{r-1} (not yet written at r = 0)
    for_each_row<kGroups>(src, slots, b, rows, [&](int64_t i, const acc_t(&u)[kGroups]) {
      acc_t x[kGroups];
      route_row_forward(slots, dims, r, u, v_prev, ws.logits + (b * I + i) * J, x, s_sum);
      if (r == dims.iters - 1) store_row_coupling(slots, x, c_out + (b * I + i) * J);
    });
    store_part(slots, s_sum, item, J * dims.D, partial);
  });
}

// Backward: c^r for r >= first_r, a warp per (b, part), each row's votes read once for all the
// iterations (v_hist complete); zeroes the part's rows of G^{iters-1}.
template <typename Source, int kGroups>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_coupling_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts,
                                      const BackwardState<typename Source::acc_type> st) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, R = dims.iters;
  const WarpSlots slots(J, dims.D, threadIdx.x % kWarpSize);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t, RowRange rows) {
    const acc_t* v_b = st.v_hist + b * R * JD;
    for_each_row<kGroups>(src, slots, b, rows, [&](int64_t i, const acc_t(&u)[kGroups]) {
      acc_t logit[kGroups];
      acc_t* g_last_i = st.g_logits + ((b * st.nkeep + st.nkeep - 1) * I + i) * J;
#pragma unroll
      for (int k = 0; k < kGroups; ++k) {
        logit[k] = 0;
        if (k < slots.groups && slots.writer(k)) g_last_i[slots.j(k)] = 0;
      }
      for (int64_t r = 0; r < R; ++r) {
        if (r > 0) {
          acc_t v_prev[kGroups];
          load_slab(v_b + (r - 1) * JD, slots, v_prev);
          add_agreement(slots, u, v_prev, logit);
        }
        if (r < st.first_r) continue;
        acc_t c[kGroups];
#pragma unroll
        for (int k = 0; k < kGroups; ++k) c[k] = logit[k];
        softmax_in_place(slots, dims.leaky, c);
        acc_t* c_i = st.coupling + ((b * st.nkeep + r - st.first_r) * I + i) * J;
#pragma unroll
        for (int k = 0; k < kGroups; ++k)
          if (k < slots.groups && slots.writer(k)) c_i[slots.j(k)] = c[k];
      }
    });
  });
}

// Backward step r > first_r (gs^r complete), a warp per (b, part): G^{r-1} = G^r + softmax VJP
// of gc = <gs^r, u> per row, and the part's gv^{r-1} sums (of G^{r-1}_ij u_ij) in partial.
template <typename Source, int kGroups>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_backward_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts, const int64_t r,
                                      const BackwardState<typename Source::acc_type> st,
                                      typename Source::acc_type* partial) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, JD = J * dims.D, k_r = r - st.first_r;
  const WarpSlots slots(J, dims.D, threadIdx.x % kWarpSize);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t item, RowRange rows) {
    const acc_t* c_b = st.coupling + (b * st.nkeep + k_r) * I * J;
    const acc_t* g_next_b = st.g_logits + (b * st.nkeep + k_r) * I * J;  // G^r = dL/db^{r+1}
    acc_t* g_here_b = st.g_logits + (b * st.nkeep + k_r - 1) * I * J;    // G^{r-1} = dL/db^r
    acc_t gs[kGroups], gv_sum[kGroups];
    load_slab(st.gs_hist + (b * st.nkeep + k_r) * JD, slots, gs);
#pragma unroll
    for (int k = 0; k < kGroups; ++k) gv_sum[k] = 0;
    for_each_row<kGroups>(src, slots, b, rows, [&](int64_t i, const acc_t(&u)[kGroups]) {
      acc_t gc[kGroups], c[kGroups];
      const acc_t* c_i = c_b + i * J;
      acc_t weighted = 0;
#pragma unroll
      for (int k = 0; k < kGroups; ++k) {
        gc[k] = c[k] = 0;
        if (k >= slots.groups) continue;
        gc[k] = segment_sum(gs[k] * u[k], slots.seg);
        if (slots.capsule(k)) c[k] = c_i[slots.j(k)];
        if (slots.writer(k)) weighted += c[k] * gc[k];
      }
      weighted = warp_sum(weighted);
      const acc_t* g_next_i = g_next_b + i * J;
      acc_t* g_here_i = g_here_b + i * J;
#pragma unroll
      for (int k = 0; k < kGroups; ++k) {
        if (k >= slots.groups || !slots.capsule(k)) continue;
        const acc_t g = g_next_i[slots.j(k)] + c[k] * (gc[k] - weighted);
        if (slots.writer(k)) g_here_i[slots.j(k)] = g;
        gv_sum[k] += g * u[k];
      }
    });
    store_part(slots, gv_sum, item, JD, partial);
  });
}

}  // namespace cuda
}  // namespace capsroute
