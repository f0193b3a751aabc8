// Dynamic routing's warp rows (the "v2-warp-rows" path, where warp_rows_fit): a warp per part of
// an element's rows, each row's votes read once per pass into registers and routed there
// (docs/kernels.md, "CUDA, v2").
//
// Lanes. A row's capsules sit on seg consecutive lanes, seg = the power of two >= J (J <= 32), so
// a warp routes 32 / seg rows at once: lane l takes row slot l / seg and capsule j = l % seg, and
// holds that capsule's whole vote vector u_ij (D <= kWarpRowMaxD values) in registers. A capsule's
// agreement <u_ij, v_j> is then D FMAs in one lane, and the softmax over the row's capsules and
// its VJP are reductions over the row's seg lanes (xor butterflies: every lane gets the bitwise
// same value). At MNIST (J = 10, D = 16) a warp routes 2 rows with 20 of its 32 lanes, about 35
// instructions per row and iteration where a lane per vote entry (D lanes per capsule, dot
// products as butterflies) took about 175. The votes are read as 16-byte vectors where the rows
// allow it (vector_capsules).
//
// Each warp routes its part's rows alone: no shared memory, no block barrier. Its sums over the
// rows (s forward, gv walking back) go to its own partial slab, which the reduce kernels of
// agreement_block_kernels.cuh add up per element in part order (deterministic), as they do the
// block kernels' row ranges.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "agreement_block_kernels.cuh"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Most capsule dimensions D a lane holds (registers per vote vector). Larger capsules, and more
// than 32 capsules per row, keep the block kernels.
constexpr int kWarpRowMaxD = 16;

// Resident blocks per SM asked of ptxas (docs/kernels.md, "CUDA, v2"); float64 needs more
// than 128 registers.
template <typename acc_t>
constexpr int warp_rows_min_blocks() {
  return sizeof(acc_t) == 8 ? 1 : 2;
}

// Lanes per row: the power of two >= J.
__host__ __device__ __forceinline__ int row_lanes(int64_t J) {
  int seg = 1;
  while (seg < J) seg *= 2;
  return seg;
}

// Whether the warp-rows kernels take these capsules.
inline bool warp_rows_fit(const RoutingDims& dims) {
  return dims.J <= kWarpSize && dims.D <= kWarpRowMaxD;
}

// The place of one lane (see the top of the file).
struct CapsuleLanes {
  int seg;      // lanes per row
  int rows;     // rows a warp routes at once: 32 / seg
  int slot;     // the lane's row among them
  int j;        // the lane's capsule
  bool active;  // j < J
  __device__ __forceinline__ CapsuleLanes(int64_t J, int lane)
      : seg(row_lanes(J)),
        rows(kWarpSize / seg),
        slot(lane / seg),
        j(lane % seg),
        active(lane % seg < J) {}
};

// Sum / max over the seg lanes of each row; every lane of the row gets the result. All 32 lanes
// call them together.
template <typename T>
__device__ __forceinline__ T row_sum(T x, int seg) {
  for (int offset = seg / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}
template <typename T>
__device__ __forceinline__ T row_max(T x, int seg) {
  for (int offset = seg / 2; offset > 0; offset >>= 1) {
    const T y = __shfl_xor_sync(kFullMask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}

// 16 bytes of T, loaded or stored as one vector.
template <typename T>
struct alignas(16) Vector16 {
  static constexpr int kSize = 16 / sizeof(T);
  T x[kSize];
};

// Whether D values of T at p, p + D, p + 2D, ... can be read as 16-byte vectors.
template <typename T>
__device__ __forceinline__ bool vector_capsules(const T* p, int64_t D) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (D * sizeof(T)) % 16 == 0;
}

// The same for every row (b, i) of values at p + rows.offset(b, i) (MemoryVotes): the strides
// between rows keep each row's capsules on 16-byte boundaries too.
template <typename T>
__device__ __forceinline__ bool vector_capsules(const T* p, const CapsuleStrides& rows, int64_t D) {
  constexpr int64_t kBytes = sizeof(T);
  return vector_capsules(p, D) && rows.element * kBytes % 16 == 0 && rows.row * kBytes % 16 == 0;
}

// The D <= kD values at p into x (0 beyond D, and everywhere when !valid); as 16-byte vectors
// when `vectors` (vector_capsules of the rows read).
template <int kD, typename T, typename acc_t>
__device__ __forceinline__ void load_capsule(const T* p, int D, bool valid, bool vectors,
                                             acc_t (&x)[kD]) {
  constexpr int kPer = Vector16<T>::kSize;
  if (valid && vectors && kD % kPer == 0) {
#pragma unroll
    for (int v = 0; v < kD / kPer; ++v) {
      const Vector16<T> chunk =
          v * kPer < D ? reinterpret_cast<const Vector16<T>*>(p)[v] : Vector16<T>{};
#pragma unroll
      for (int e = 0; e < kPer; ++e)
        x[v * kPer + e] = v * kPer < D ? static_cast<acc_t>(chunk.x[e]) : acc_t(0);
    }
  } else {
#pragma unroll
    for (int d = 0; d < kD; ++d) x[d] = valid && d < D ? static_cast<acc_t>(p[d]) : acc_t(0);
  }
}

// x's first D values to p, as load_capsule reads them (16-byte vectors when `vectors`).
template <int kD, typename T, typename acc_t>
__device__ __forceinline__ void store_capsule(T* p, int D, bool vectors, const acc_t (&x)[kD]) {
  constexpr int kPer = Vector16<T>::kSize;
  if (vectors && kD % kPer == 0) {
#pragma unroll
    for (int v = 0; v < kD / kPer; ++v) {
      if (v * kPer >= D) continue;
      Vector16<T> chunk;
#pragma unroll
      for (int e = 0; e < kPer; ++e) chunk.x[e] = static_cast<T>(x[v * kPer + e]);
      reinterpret_cast<Vector16<T>*>(p)[v] = chunk;
    }
  } else {
#pragma unroll
    for (int d = 0; d < kD; ++d)
      if (d < D) p[d] = static_cast<T>(x[d]);
  }
}

template <int kD, typename acc_t>
__device__ __forceinline__ acc_t capsule_dot(const acc_t (&x)[kD], const acc_t (&y)[kD]) {
  acc_t sum = 0;
#pragma unroll
  for (int d = 0; d < kD; ++d) sum += x[d] * y[d];
  return sum;
}

// The coupling of the lane's capsule: softmax over the row's logits x (an extra zero logit when
// leaky, its share dropped), as warp_coupling_row; 0 where !valid (every lane of a row past the
// part's end is, and gets 0 rather than 0 / 0).
template <typename acc_t>
__device__ __forceinline__ acc_t row_softmax(const CapsuleLanes& lanes, bool valid, bool leaky,
                                             acc_t x) {
  acc_t max_logit = row_max(valid ? x : neg_infinity(acc_t(0)), lanes.seg);
  if (leaky) max_logit = max_logit > acc_t(0) ? max_logit : acc_t(0);
  const acc_t e = valid ? acc_exp(x - max_logit) : acc_t(0);
  acc_t denom = row_sum(e, lanes.seg);
  if (leaky) denom += acc_exp(-max_logit);
  return valid ? e * (acc_t(1) / denom) : acc_t(0);
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

// The rows of a part, lanes.rows at a time in order, each lane's vote vector loaded one step ahead
// (two steps' loads in flight per warp: one step is a few loads per lane, too few to cover the
// memory latency at 16 warps per SM): f(i, valid, u) with i the lane's row and u its votes (0
// where !valid: a capsule beyond J or a row past the part's end).
template <int kD, typename Source, typename F>
__device__ __forceinline__ void for_each_row(const Source& src, const CapsuleLanes& lanes,
                                             int64_t b, RowRange rows, int D, bool vectors, F&& f) {
  using acc_t = typename Source::acc_type;
  const auto load = [&](int64_t i, acc_t(&x)[kD]) {
    const bool valid = lanes.active && i < rows.end;
    load_capsule(valid ? src.row(b, i) + lanes.j * D : nullptr, D, valid, vectors, x);
  };
  acc_t next[kD];
  if (rows.begin < rows.end) load(rows.begin + lanes.slot, next);
  for (int64_t i0 = rows.begin; i0 < rows.end; i0 += lanes.rows) {
    acc_t u[kD];
#pragma unroll
    for (int d = 0; d < kD; ++d) u[d] = next[d];
    if (i0 + lanes.rows < rows.end) load(i0 + lanes.rows + lanes.slot, next);
    const int64_t i = i0 + lanes.slot;
    f(i, lanes.active && i < rows.end, u);
  }
}

// x summed over the warp's row slots (each slot's lanes summed its own rows); every lane of a
// capsule gets the bitwise same sum.
template <int kD, typename acc_t>
__device__ __forceinline__ void sum_row_slots(const CapsuleLanes& lanes, acc_t (&x)[kD]) {
  for (int offset = lanes.seg; offset < kWarpSize; offset *= 2)
#pragma unroll
    for (int d = 0; d < kD; ++d) x[d] += __shfl_xor_sync(kFullMask, x[d], offset);
}

// A sum over the rows of every row slot, x, into part `item`'s (J, D) slab of partial.
template <int kD, typename acc_t>
__device__ __forceinline__ void store_part(const CapsuleLanes& lanes, acc_t (&x)[kD], int64_t item,
                                           int D, int64_t JD, acc_t* partial) {
  sum_row_slots(lanes, x);
  if (lanes.slot != 0 || !lanes.active) return;
  acc_t* capsule = partial + item * JD + lanes.j * D;
#pragma unroll
  for (int d = 0; d < kD; ++d)
    if (d < D) capsule[d] = x[d];
}

// Iteration r of the forward on one row, the lane's capsule: b^r = b^{r-1} + <u, v^{r-1}>
// (b^0 = 0), kept between iterations in the lane's logit (written at r = 1 .. iters-2, read at
// r = 2 .. iters-1: b^1 = <u, v^0>); returns c^r = softmax(b^r) after s_sum += c^r u.
template <int kD, typename acc_t>
__device__ __forceinline__ acc_t route_row_forward(const CapsuleLanes& lanes, bool valid,
                                                   const RoutingDims& dims, int64_t r,
                                                   const acc_t (&u)[kD], const acc_t (&v_prev)[kD],
                                                   acc_t* logit, acc_t (&s_sum)[kD]) {
  acc_t x = valid && r > 1 ? *logit : acc_t(0);
  if (r > 0) x += capsule_dot(u, v_prev);
  if (valid && r > 0 && r < dims.iters - 1) *logit = x;
  const acc_t c = row_softmax(lanes, valid, dims.leaky, x);
#pragma unroll
  for (int d = 0; d < kD; ++d) s_sum[d] += c * u[d];
  return c;
}

// Forward, iteration r, a warp per (b, part): route_row_forward over the part's rows (logits in
// ws.logits, c_out at the last iteration unless nullptr), the part's s sums in partial.
template <typename Source, typename scalar_t, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_forward_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts,
                                     const int64_t r,
                                     const ForwardWorkspace<typename Source::acc_type> ws,
                                     scalar_t* c_out, typename Source::acc_type* partial) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J;
  const int D = static_cast<int>(dims.D);
  const CapsuleLanes lanes(J, threadIdx.x % kWarpSize);
  const bool vectors = vector_capsules(src.votes, src.rows, D);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t item, RowRange rows) {
    acc_t v_prev[kD], s_sum[kD];
    // v^{r-1} (not yet written at r = 0)
    load_capsule(ws.v + (b * J + lanes.j) * D, D, r > 0 && lanes.active, false, v_prev);
#pragma unroll
    for (int d = 0; d < kD; ++d) s_sum[d] = 0;
    for_each_row<kD>(
        src, lanes, b, rows, D, vectors, [&](int64_t i, bool valid, const acc_t(&u)[kD]) {
          const int64_t ij = (b * I + i) * J + lanes.j;
          const acc_t c =
              route_row_forward(lanes, valid, dims, r, u, v_prev, ws.logits + ij, s_sum);
          if (valid && c_out != nullptr && r == dims.iters - 1)
            c_out[ij] = static_cast<scalar_t>(c);
        });
    store_part(lanes, s_sum, item, D, J * D, partial);
  });
}

// One backward step on a row, the lane's capsule, given c = c^r_ij, g_next = G^r_ij and
// gs = gs^r_j: returns G^{r-1}_ij = G^r_ij + the softmax VJP of gc = <gs^r, u> after
// gv_sum += G^{r-1}_ij u.
template <int kD, typename acc_t>
__device__ __forceinline__ acc_t walk_back_row(const CapsuleLanes& lanes, bool valid,
                                               const acc_t (&u)[kD], const acc_t (&gs)[kD], acc_t c,
                                               acc_t g_next, acc_t (&gv_sum)[kD]) {
  const acc_t gc = capsule_dot(gs, u);
  const acc_t weighted = row_sum(c * gc, lanes.seg);
  const acc_t g = valid ? g_next + c * (gc - weighted) : acc_t(0);
#pragma unroll
  for (int d = 0; d < kD; ++d) gv_sum[d] += g * u[d];
  return g;
}

// Backward: c^r for r >= first_r, a warp per (b, part), each row's votes read once for all the
// iterations (v_hist complete); zeroes the part's rows of G^{iters-1}. Unless nothing is walked
// back (first_r = iters-1), also the first step back on the same votes (gs^{iters-1} complete,
// G^{iters-1} = 0): G^{iters-2} and the part's gv^{iters-2} sums in partial, as
// routing_backward_warp_rows_kernel would at r = iters-1.
template <typename Source, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_coupling_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts,
                                      const BackwardState<typename Source::acc_type> st,
                                      typename Source::acc_type* partial) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, R = dims.iters, last = st.nkeep - 1;
  const int D = static_cast<int>(dims.D);
  const bool walks_back = R - 1 > st.first_r;
  const CapsuleLanes lanes(J, threadIdx.x % kWarpSize);
  const bool vectors = vector_capsules(src.votes, src.rows, D),
             state_vectors = vector_capsules(st.v_hist, D);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t item, RowRange rows) {
    const acc_t* v_j = st.v_hist + (b * R * J + lanes.j) * D;  // v^r_j at v_j + r * J * D
    acc_t gs[kD], gv_sum[kD];
    load_capsule(st.gs_hist + ((b * st.nkeep + last) * J + lanes.j) * D, D,
                 walks_back && lanes.active, false, gs);
#pragma unroll
    for (int d = 0; d < kD; ++d) gv_sum[d] = 0;
    // (Each row's index at k = 0 once, then a step per k: fewer registers, which the strided
    // votes' addresses need.)
    for_each_row<kD>(src, lanes, b, rows, D, vectors,
                     [&](int64_t i, bool valid, const acc_t(&u)[kD]) {
                       const int64_t ij0 = (b * st.nkeep * I + i) * J + lanes.j;
                       const auto ij = [&](int64_t k) { return ij0 + k * I * J; };
                       if (valid) st.g_logits[ij(last)] = 0;
                       acc_t logit = 0, c = 0;
                       for (int64_t r = 0; r < R; ++r) {
                         if (r > 0) {
                           acc_t v_prev[kD];
                           load_capsule(v_j + (r - 1) * J * D, D, valid, state_vectors, v_prev);
                           logit += capsule_dot(u, v_prev);
                         }
                         if (r < st.first_r) continue;
                         c = row_softmax(lanes, valid, dims.leaky, logit);
                         if (valid) st.coupling[ij(r - st.first_r)] = c;
                       }
                       if (walks_back) {
                         const acc_t g = walk_back_row(lanes, valid, u, gs, c, acc_t(0), gv_sum);
                         if (valid) st.g_logits[ij(last - 1)] = g;
                       }
                     });
    if (walks_back) store_part(lanes, gv_sum, item, D, J * D, partial);
  });
}

// Backward step r > first_r (gs^r complete), a warp per (b, part): G^{r-1} = G^r + softmax VJP
// of gc = <gs^r, u> per row, and the part's gv^{r-1} sums (of G^{r-1}_ij u_ij) in partial. (Step
// iters-1 is routing_coupling_warp_rows_kernel's.)
template <typename Source, int kD>
__global__ void __launch_bounds__(kBlockThreads, warp_rows_min_blocks<typename Source::acc_type>())
    routing_backward_warp_rows_kernel(const Source src, const RoutingDims dims, const int64_t parts,
                                      const int64_t r,
                                      const BackwardState<typename Source::acc_type> st,
                                      typename Source::acc_type* partial) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, k_r = r - st.first_r;
  const int D = static_cast<int>(dims.D);
  const CapsuleLanes lanes(J, threadIdx.x % kWarpSize);
  const bool vectors = vector_capsules(src.votes, src.rows, D);
  for_each_warp_part(dims.B, I, parts, [&](int64_t b, int64_t item, RowRange rows) {
    const acc_t* c_b = st.coupling + (b * st.nkeep + k_r) * I * J;
    const acc_t* g_next_b = st.g_logits + (b * st.nkeep + k_r) * I * J;  // G^r = dL/db^{r+1}
    acc_t* g_here_b = st.g_logits + (b * st.nkeep + k_r - 1) * I * J;    // G^{r-1} = dL/db^r
    acc_t gs[kD], gv_sum[kD];
    load_capsule(st.gs_hist + ((b * st.nkeep + k_r) * J + lanes.j) * D, D, lanes.active, false, gs);
#pragma unroll
    for (int d = 0; d < kD; ++d) gv_sum[d] = 0;
    for_each_row<kD>(
        src, lanes, b, rows, D, vectors, [&](int64_t i, bool valid, const acc_t(&u)[kD]) {
          const int64_t ij = i * J + lanes.j;
          const acc_t g = walk_back_row(lanes, valid, u, gs, valid ? c_b[ij] : acc_t(0),
                                        valid ? g_next_b[ij] : acc_t(0), gv_sum);
          if (valid) g_here_b[ij] = g;
        });
    store_part(lanes, gv_sum, item, D, J * D, partial);
  });
}

}  // namespace cuda
}  // namespace capsroute
