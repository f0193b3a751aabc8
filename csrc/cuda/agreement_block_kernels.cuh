// The block kernels of the agreement routings (the "v2-block" path: every rule, and dynamic
// routing's capsules the warp rows do not fit, agreement_launch.cuh), over votes read from memory:
// dynamic_routing's, the attention routings' own, or a chunk of dense_capsules' votes made by a
// GEMM. Their reduce and backward-start kernels, and the writer of the vote gradient from the saved
// state, serve the warp-rows kernels too. The routing's rule (RoutingRule, agreement_rules.h: the
// logit update, each pass's nonlinearity, the coupling bias) is a kernel parameter.
//
// The kernels are templated on a vote source (vote_sources.cuh: MemoryVotes, or a chunk of
// dense_capsules' votes), returning vote u[b, i, j, d] with jd = j * D + d.
//
// Structure (one thread block of kBlockThreads threads per batch element b, or per range of its
// input rows when the batch is too small to fill the GPU, see routing_splits; everything that
// scales with I, J or D lives in global-memory workspaces in the accumulation dtype, so any
// size works and no shared memory is needed):
//   * "warp per row": warp w handles input rows i = i0 + w, i0 + w + nwarps, ... of a tile;
//     lane l handles outputs j = l, l + 32, ... of that row (only ever its own entries of the
//     (I, J) workspaces, so a row needs no barrier, only warp reductions).
//   * "column owner": thread t owns the flat (j, d) columns jd = t, t + blockDim, ... of the
//     (J, D) accumulators (s, gv); it reads coalesced rows of votes.
//   * "warp per capsule": warp w handles capsules j = w, w + nwarps, ...; lanes split d.
// Every loop bound is uniform per warp (rows, capsules) or per block (iterations, tiles), and
// every phase that reads what other threads wrote is preceded by __syncthreads().
//
// The algorithm is exactly the CPU one (csrc/cpu/agreement_element.h) and reads/writes the same
// saved state (s_hist). Device code only: the launches are in agreement_launch.cuh, and
// tests/emulator runs these kernels on the host.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "agreement_pass.cuh"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Input rows per tile: phase 1 (warp per row) then phase 2 (column owners) run over the same
// rows while their votes are still in cache.
constexpr int64_t kRoutingTile = 32;

// Resident blocks per SM asked of ptxas (0: no hint). sm_90's ptxas (CUDA 13) spills none of
// these kernels unhinted; sm_80's squeezes the float64 ones into 32-80 registers and spills,
// which asking for 2 blocks of 256 threads (up to 128 registers) removes. Decided in the device
// pass for each architecture, as PyTorch's C10_MIN_BLOCKS_PER_SM is.
template <typename acc_t>
constexpr int routing_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return sizeof(acc_t) == 8 ? 2 : 0;
#else
  return 0;
#endif
}

// ---- rows of one element ----
//
// Each element's I input rows are routed by one block (splits = 1, the fused kernels) or, when
// the batch alone cannot fill the GPU, split into `splits` contiguous ranges, one block each,
// whose partial sums over their rows are added up, in range order, by a per-element kernel
// between phases (the split kernels). Both run the same device functions below.

// The (b, range g) items of the split kernels (RowRange, split_rows: device_utils.cuh): each
// gets its partial sums partial[b, g] (J, D) zeroed by their column owners, then
// rows(b, range g, partial[b, g]).
template <typename acc_t, typename Rows>
__device__ __forceinline__ void for_each_range(const RoutingDims& dims, int64_t splits,
                                               acc_t* partial, Rows&& rows) {
  // (Not through for_each_row_range: one more lambda level made ptxas spill the float64
  // routing_backward_rows_kernel on sm_90.)
  const int64_t JD = dims.J * dims.D;
  for (int64_t item = blockIdx.x; item < dims.B * splits; item += gridDim.x) {
    acc_t* acc = partial + item * JD;
    for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) acc[jd] = 0;
    rows(item / splits, split_rows(dims.I, splits, item % splits), acc);
    __syncthreads();
  }
}

// Column owners: out = init (or 0 where init is nullptr) + element b's partial sums, ranges in
// order.
template <typename init_t, typename acc_t>
__device__ __forceinline__ void sum_ranges(const acc_t* partial, int64_t splits, int64_t b,
                                           int64_t JD, const init_t* init, acc_t* out) {
  for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) {
    acc_t sum = init != nullptr ? static_cast<acc_t>(init[jd]) : acc_t(0);
    for (int64_t g = 0; g < splits; ++g) sum += partial[(b * splits + g) * JD + jd];
    out[jd] = sum;
  }
}

// The capsule j and value d of a column owner's columns jd = threadIdx.x, + blockDim.x, ... (D
// values a capsule), found once and then stepped: a 64-bit jd / D per column is a call, and the
// registers it saves made ptxas spill. (32-bit divisions: the thread index and block size are
// below 2^31, and a D beyond that has them all in capsule 0.)
struct ColumnWalk {
  int64_t j, d, step_j, step_d, D;
  __device__ __forceinline__ explicit ColumnWalk(int64_t D_) : D(D_) {
    const unsigned d32 = D_ < (int64_t(1) << 31) ? static_cast<unsigned>(D_) : 1u << 31;
    j = threadIdx.x / d32;
    d = threadIdx.x % d32;
    step_j = blockDim.x / d32;
    step_d = blockDim.x % d32;
  }
  __device__ __forceinline__ void next() {
    j += step_j;
    d += step_d;
    if (d >= D) {
      d -= D;
      ++j;
    }
  }
};

// Per element b, slices of: logits (B, I, J), coupling (B, I, J), v (B, J, D).
template <typename acc_t>
struct ForwardWorkspace {
  acc_t* logits;
  acc_t* coupling;
  acc_t* v;
};

// Phase 2 of a tile, column owners: acc_jd += sum_{i0 <= i < i1} weight_ij u_ijd, i in order.
template <typename Source>
__device__ __forceinline__ void accumulate_tile_columns(const Source& src, int64_t b, int64_t i0,
                                                        int64_t i1,
                                                        const typename Source::acc_type* weight,
                                                        int64_t J, int64_t D,
                                                        typename Source::acc_type* acc) {
  using acc_t = typename Source::acc_type;
  ColumnWalk col(D);
  for (int64_t jd = threadIdx.x; jd < J * D; jd += blockDim.x, col.next()) {
    acc_t sum = acc[jd];
    for (int64_t i = i0; i < i1; ++i) sum += weight[i * J + col.j] * src(b, i, jd);
    acc[jd] = sum;
  }
}

// Logits b^r of row i of element b (a warp; lane l its j = l, l + 32, ...): 0 at r = 0, else
// rule.next_logit(b^{r-1}_ij, <u_ij, v^{r-1}_j>) over b^{r-1} in `logits`; v_prev = v^{r-1}.
template <typename Source>
__device__ __forceinline__ void warp_logit_row(const Source& src, int64_t b, int64_t i, int64_t r,
                                               int64_t J, int64_t D,
                                               const typename Source::acc_type* v_prev,
                                               const RoutingRule<typename Source::acc_type>& rule,
                                               typename Source::acc_type* logits, int lane) {
  using acc_t = typename Source::acc_type;
  for (int64_t j = lane; j < J; j += kWarpSize) {
    acc_t logit = 0;
    if (r > 0) {
      const acc_t* vj = v_prev + j * D;
      acc_t agreement = 0;
      for (int64_t d = 0; d < D; ++d) agreement += src(b, i, j * D + d) * vj[d];
      logit = rule.next_logit(logits[j], agreement);
    }
    logits[j] = logit;
  }
}

// c^r_ij += the coupling bias of row i at pass r > 0, where the rule has one (a warp; lane l its
// j = l, l + 32, ...). (Added after warp_coupling_row, not in it: a bias pointer live across the
// softmax made ptxas spill.)
template <typename acc_t>
__device__ __forceinline__ void add_coupling_bias(const RoutingRule<acc_t>& rule, int64_t r,
                                                  int64_t i, int64_t J, acc_t* c, int lane) {
  if (r == 0 || rule.coupling_bias == nullptr) return;
  const acc_t* bias = rule.coupling_bias + i * J;
  for (int64_t j = lane; j < J; j += kWarpSize) c[j] += bias[j];
}

// Iteration r of the forward over `rows` of element b: the logits b^r (warp_logit_row) and
// c^r = softmax + the coupling bias (warp per row; written to c_out at the last iteration), then
// s_acc_jd += sum_i c_ij u_ijd (column owners, over s_acc as they left it).
template <typename Source, typename scalar_t>
__device__ __forceinline__ void forward_rows(const Source& src, int64_t b, RowRange rows, int64_t r,
                                             const RoutingDims& dims,
                                             const RoutingRule<typename Source::acc_type>& rule,
                                             const ForwardWorkspace<typename Source::acc_type>& ws,
                                             scalar_t* c_out, typename Source::acc_type* s_acc) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, D = dims.D, JD = J * D;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;
  acc_t* logits = ws.logits + b * I * J;
  acc_t* coupling = ws.coupling + b * I * J;
  const acc_t* v = ws.v + b * JD;  // v^{r-1}
  for (int64_t i0 = rows.begin; i0 < rows.end; i0 += kRoutingTile) {
    const int64_t i1 = i0 + kRoutingTile < rows.end ? i0 + kRoutingTile : rows.end;
    // Phase 1, warp per row.
    for (int64_t i = i0 + warp; i < i1; i += nwarps) {
      acc_t* li = logits + i * J;
      warp_logit_row(src, b, i, r, J, D, v, rule, li, lane);
      acc_t* ci = coupling + i * J;
      warp_coupling_row(li, J, dims.leaky, ci, lane);
      add_coupling_bias(rule, r, i, J, ci, lane);
      if (c_out != nullptr && r == dims.iters - 1) {
        for (int64_t j = lane; j < J; j += kWarpSize)
          c_out[(b * I + i) * J + j] = static_cast<scalar_t>(ci[j]);
      }
    }
    __syncthreads();  // coupling of the tile written by warps, read by column owners
    accumulate_tile_columns(src, b, i0, i1, coupling, J, D, s_acc);
    __syncthreads();  // end of tile
  }
}

// v^r = f_r(s^r) of element b (s complete), and v_out at the last iteration.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void finish_forward_iteration(int64_t b, int64_t r,
                                                         const RoutingDims& dims,
                                                         const RoutingRule<acc_t>& rule, acc_t eps,
                                                         const acc_t* s, acc_t* v,
                                                         scalar_t* v_out) {
  const int64_t JD = dims.J * dims.D;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  __syncthreads();  // s complete (also when no row ran)
  block_pass_outputs(rule.logits, rule.nonlinearity, rule.norm_weight, rule.norm_bias, r, 1,
                     dims.iters, s, dims.J, dims.D, eps, v);
  __syncthreads();  // v^r complete before the next iteration's agreement (or the copy) reads it
  if (r == dims.iters - 1) {
    for (int64_t jd = tid; jd < JD; jd += nthreads)
      v_out[b * JD + jd] = static_cast<scalar_t>(v[jd]);
    __syncthreads();
  }
}

// ---- forward ----

// Writes s_hist (B, iters, J, D), v_out (B, J, D) and the final coupling c_out (B, I, J) unless
// nullptr. bias (J, D) or nullptr. One block per element, every iteration.
template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<typename Source::acc_type>())
    routing_forward_kernel(const Source src, const scalar_t* bias, const RoutingDims dims,
                           const typename Source::acc_type eps,
                           const RoutingRule<typename Source::acc_type> rule,
                           const ForwardWorkspace<typename Source::acc_type> ws,
                           typename Source::acc_type* s_hist, scalar_t* v_out, scalar_t* c_out) {
  using acc_t = typename Source::acc_type;
  const int64_t JD = dims.J * dims.D, R = dims.iters;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    for (int64_t r = 0; r < R; ++r) {
      acc_t* s = s_hist + (b * R + r) * JD;
      for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x)
        s[jd] = bias != nullptr ? static_cast<acc_t>(bias[jd]) : acc_t(0);
      forward_rows(src, b, {0, dims.I}, r, dims, rule, ws, c_out, s);
      finish_forward_iteration(b, r, dims, rule, eps, s, ws.v + b * JD, v_out);
    }
  }
}

// Split forward, iteration r, block per (b, g): partial[b, g] = sum over range g's rows.
template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<typename Source::acc_type>())
    routing_forward_rows_kernel(const Source src, const RoutingDims dims, const int64_t splits,
                                const int64_t r, const RoutingRule<typename Source::acc_type> rule,
                                const ForwardWorkspace<typename Source::acc_type> ws,
                                scalar_t* c_out, typename Source::acc_type* partial) {
  for_each_range(dims, splits, partial,
                 [&](int64_t b, RowRange rows, typename Source::acc_type* s_acc) {
                   forward_rows(src, b, rows, r, dims, rule, ws, c_out, s_acc);
                 });
}

// Split forward, iteration r, block per b: s^r = bias + the partials in range order; v^r.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<acc_t>())
    routing_forward_reduce_kernel(const acc_t* partial, const int64_t splits, const scalar_t* bias,
                                  const RoutingDims dims, const int64_t r, const acc_t eps,
                                  const RoutingRule<acc_t> rule, acc_t* v_ws, acc_t* s_hist,
                                  scalar_t* v_out) {
  const int64_t JD = dims.J * dims.D;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    acc_t* s = s_hist + (b * dims.iters + r) * JD;
    sum_ranges(partial, splits, b, JD, bias, s);
    finish_forward_iteration(b, r, dims, rule, eps, s, v_ws + b * JD, v_out);
  }
}

// ---- backward ----

// Saved state of the backward pass, per element b (see RoutingBackward in
// csrc/cpu/agreement_element.h). Iterations r = first_r .. iters-1 are kept (nkeep of them,
// slot k = r - first_r): first_r = iters-1 with detach, 0 without.
//   v_hist   (B, iters, J, D)  v^r = f_r(s^r), every r
//   gs_hist  (B, nkeep, J, D)  gs^r = dL/ds^r
//   coupling (B, nkeep, I, J)  c^r
//   g_logits (B, nkeep, I, J)  G^r = dL/d<u_ij, v^r_j>, the logits' gradient dL/db^{r+1} times
//                              the rule's logit scale (1 where they accumulate); G^{iters-1} = 0
//                              (with detach the one slot stays 0, so the vote gradient below
//                              needs no special case)
// and the vote gradient
//   g_u[b, i, j, d] = sum_{r >= first_r} c^r_ij gs^r_jd + G^r_ij v^r_jd,
// and the gradient items of the rule's parameters (grads; null buffers where none).
template <typename acc_t>
struct BackwardState {
  acc_t* v_hist;
  acc_t* gs_hist;
  acc_t* coupling;
  acc_t* g_logits;
  int64_t I, J, D, iters, first_r, nkeep;
  RuleGradItems<acc_t> grads = {};

  // (The capsule j = jd / D is given: its callers find it once per column.)
  __device__ __forceinline__ acc_t vote_grad(int64_t b, int64_t i, int64_t j, int64_t jd) const {
    const int64_t JD = J * D;
    acc_t sum = 0;
    for (int64_t k = 0; k < nkeep; ++k) {
      const int64_t r = first_r + k;
      const int64_t ij = ((b * nkeep + k) * I + i) * J + j;
      sum += coupling[ij] * gs_hist[(b * nkeep + k) * JD + jd] +
             g_logits[ij] * v_hist[(b * iters + r) * JD + jd];
    }
    return sum;
  }
};

// Scratch of the backward kernels: logits (B, I, J); gv (B, J, D), dL/dv^r of the step at hand.
template <typename acc_t>
struct BackwardWorkspace {
  acc_t* logits;
  acc_t* gv;
};

// Start of the backward of element b: v^r = f_r(s^r) for every r and gv = grad_v. grad_v is in
// the accumulation dtype: a float16 gradient above 65504 is finite in float32.
template <typename acc_t>
__device__ __forceinline__ void backward_outputs(int64_t b, const acc_t* grad_v,
                                                 const acc_t* s_hist, const RoutingDims& dims,
                                                 const RoutingRule<acc_t>& rule, acc_t eps,
                                                 const BackwardState<acc_t>& st, acc_t* gv) {
  const int64_t JD = dims.J * dims.D, R = dims.iters;
  block_pass_outputs(rule.logits, rule.nonlinearity, rule.norm_weight, rule.norm_bias, 0, R, R,
                     s_hist + b * R * JD, dims.J, dims.D, eps, st.v_hist + b * R * JD);
  for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) gv[jd] = grad_v[b * JD + jd];
  __syncthreads();  // v_hist and gv complete
}

// gs^r = f_r's VJP at s^r of gv (complete) for element b, into its slot of gs_hist.
template <typename acc_t>
__device__ __forceinline__ void backward_pass_vjp(int64_t b, int64_t r, const acc_t* s_hist,
                                                  const RoutingDims& dims,
                                                  const RoutingRule<acc_t>& rule, acc_t eps,
                                                  const BackwardState<acc_t>& st, const acc_t* gv) {
  const int64_t JD = dims.jd();
  block_pass_vjp(rule.pass_nonlinearity(r, dims.iters), rule.norm_weight,
                 s_hist + (b * dims.iters + r) * JD, gv, dims.J, dims.D, eps,
                 st.gs_hist + (b * st.nkeep + r - st.first_r) * JD, st.grads.norm_weight,
                 st.grads.norm_bias, b * JD);
  __syncthreads();  // gs^r complete
}

// c^r for r >= first_r over `rows` of element b, from the logits b^r of warp_logit_row (warp
// per row; v_hist complete); zeroes those rows of G^{iters-1}.
template <typename Source>
__device__ __forceinline__ void recompute_coupling_rows(
    const Source& src, int64_t b, RowRange rows, const RoutingDims& dims,
    const RoutingRule<typename Source::acc_type>& rule,
    const BackwardState<typename Source::acc_type>& st, typename Source::acc_type* logits_ws) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, D = dims.D, JD = J * D, R = dims.iters;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize,
            nwarps = blockDim.x / kWarpSize;
  const acc_t* v_b = st.v_hist + b * R * JD;
  acc_t* c_b = st.coupling + b * st.nkeep * I * J;
  acc_t* g_last = st.g_logits + (b * st.nkeep + st.nkeep - 1) * I * J;
  for (int64_t i = rows.begin + warp; i < rows.end; i += nwarps) {
    acc_t* li = logits_ws + (b * I + i) * J;
    for (int64_t j = lane; j < J; j += kWarpSize) g_last[i * J + j] = 0;
    for (int64_t r = 0; r < R; ++r) {
      warp_logit_row(src, b, i, r, J, D, v_b + (r > 0 ? r - 1 : 0) * JD, rule, li, lane);
      if (r >= st.first_r)
        warp_coupling_row(li, J, dims.leaky, c_b + (r - st.first_r) * I * J + i * J, lane);
    }
  }
  for (int64_t i = rows.begin + warp; i < rows.end; i += nwarps)
    for (int64_t r = st.first_r; r < R; ++r)
      add_coupling_bias(rule, r, i, J, c_b + (r - st.first_r) * I * J + i * J, lane);
}

// One backward step over `rows` of element b, for r > first_r (gs^r complete): the softmax VJP
// of gc = <gs^r, u> at p = c^r - coupling bias, plus G^r where the logits accumulate, else times
// the logit scale, makes G^{r-1} (warp per row; gc also into the coupling bias's gradient items),
// then gv_acc_jd += sum_i G^{r-1}_ij u_ijd (column owners, over gv_acc as they left it).
template <typename Source>
__device__ __forceinline__ void backward_rows(const Source& src, int64_t b, RowRange rows,
                                              int64_t r, const RoutingDims& dims,
                                              const RoutingRule<typename Source::acc_type>& rule,
                                              const BackwardState<typename Source::acc_type>& st,
                                              typename Source::acc_type* gv_acc) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, D = dims.D, JD = J * D, k = r - st.first_r;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;
  const acc_t* gs = st.gs_hist + (b * st.nkeep + k) * JD;
  const acc_t* c = st.coupling + (b * st.nkeep + k) * I * J;
  const acc_t* g_next = st.g_logits + (b * st.nkeep + k) * I * J;  // G^r = dL/db^{r+1}
  acc_t* g_here = st.g_logits + (b * st.nkeep + k - 1) * I * J;    // G^{r-1} = dL/db^r
  for (int64_t i0 = rows.begin; i0 < rows.end; i0 += kRoutingTile) {
    const int64_t i1 = i0 + kRoutingTile < rows.end ? i0 + kRoutingTile : rows.end;
    // Phase 1, warp per row (lanes only touch their own j entries).
    for (int64_t i = i0 + warp; i < i1; i += nwarps) {
      const acc_t* bias = rule.coupling_bias != nullptr ? rule.coupling_bias + i * J : nullptr;
      acc_t weighted = 0;
      for (int64_t j = lane; j < J; j += kWarpSize) {
        acc_t gc = 0;
        for (int64_t d = 0; d < D; ++d) gc += gs[j * D + d] * src(b, i, j * D + d);
        g_here[i * J + j] = gc;  // gc for now, G^{r-1} below
        weighted += (bias != nullptr ? c[i * J + j] - bias[j] : c[i * J + j]) * gc;
        if (st.grads.coupling_bias != nullptr) st.grads.coupling_bias[(b * I + i) * J + j] += gc;
      }
      weighted = warp_sum(weighted);
      for (int64_t j = lane; j < J; j += kWarpSize) {
        const acc_t p = bias != nullptr ? c[i * J + j] - bias[j] : c[i * J + j];
        g_here[i * J + j] = rule.carries_logit_gradient()
                                ? g_next[i * J + j] + p * (g_here[i * J + j] - weighted)
                                : rule.logit_scale * (p * (g_here[i * J + j] - weighted));
      }
    }
    __syncthreads();  // G^{r-1} of the tile written by warps, read by column owners
    accumulate_tile_columns(src, b, i0, i1, g_here, J, D, gv_acc);
    __syncthreads();  // end of tile
  }
}

// grad_bias_items[b] = sum_r gs^r (column owners; gs complete), where grad_bias_items is given.
template <typename acc_t>
__device__ __forceinline__ void sum_gs(int64_t b, int64_t JD, const BackwardState<acc_t>& st,
                                       acc_t* grad_bias_items) {
  if (grad_bias_items == nullptr) return;
  const acc_t* gs_b = st.gs_hist + b * st.nkeep * JD;
  for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) {
    acc_t sum = 0;
    for (int64_t k = st.nkeep - 1; k >= 0; --k) sum += gs_b[k * JD + jd];
    grad_bias_items[b * JD + jd] = sum;
  }
}

// Fills the BackwardState buffers and grad_bias_items (B, J, D) = sum_r gs^r for each b (where
// given). grad_v (B, J, D) and s_hist (B, iters, J, D) in the accumulation dtype; detach is
// st.first_r = iters - 1. One block per element.
template <typename Source>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<typename Source::acc_type>())
    routing_backward_kernel(const Source src, const typename Source::acc_type* grad_v,
                            const typename Source::acc_type* s_hist, const RoutingDims dims,
                            const typename Source::acc_type eps,
                            __grid_constant__ const RoutingRule<typename Source::acc_type> rule,
                            const BackwardState<typename Source::acc_type> st,
                            const BackwardWorkspace<typename Source::acc_type> ws,
                            typename Source::acc_type* grad_bias_items) {
  using acc_t = typename Source::acc_type;
  const int64_t JD = dims.J * dims.D, R = dims.iters;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    acc_t* gv = ws.gv + b * JD;
    backward_outputs(b, grad_v, s_hist, dims, rule, eps, st, gv);
    recompute_coupling_rows(src, b, {0, dims.I}, dims, rule, st, ws.logits);
    __syncthreads();  // c^r and G^{iters-1} complete
    backward_pass_vjp(b, R - 1, s_hist, dims, rule, eps, st, gv);
    // Walk the iterations backwards; detach stops at the last s, and b^0 = 0 is a constant.
    for (int64_t r = R - 1; r > st.first_r; --r) {
      for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x) gv[jd] = 0;
      backward_rows(src, b, {0, dims.I}, r, dims, rule, st, gv);
      __syncthreads();  // gv^{r-1} complete (also when I == 0)
      backward_pass_vjp(b, r - 1, s_hist, dims, rule, eps, st, gv);  // before gv is cleared
    }
    sum_gs(b, JD, st, grad_bias_items);
    __syncthreads();
  }
}

// Split backward: the start of the backward (backward_outputs, gs^{iters-1}) for each b (block
// per b).
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<acc_t>())
    routing_backward_start_kernel(const acc_t* grad_v, const acc_t* s_hist,
                                  __grid_constant__ const RoutingDims dims, const acc_t eps,
                                  __grid_constant__ const RoutingRule<acc_t> rule,
                                  __grid_constant__ const BackwardState<acc_t> st, acc_t* gv_ws) {
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    backward_outputs(b, grad_v, s_hist, dims, rule, eps, st, gv_ws + b * dims.jd());
    backward_pass_vjp(b, dims.iters - 1, s_hist, dims, rule, eps, st, gv_ws + b * dims.jd());
  }
}

// Split backward: recompute_coupling_rows, block per (b, g).
template <typename Source>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<typename Source::acc_type>())
    routing_coupling_rows_kernel(const Source src, const RoutingDims dims, const int64_t splits,
                                 const RoutingRule<typename Source::acc_type> rule,
                                 const BackwardState<typename Source::acc_type> st,
                                 typename Source::acc_type* logits_ws) {
  for (int64_t item = blockIdx.x; item < dims.B * splits; item += gridDim.x)
    recompute_coupling_rows(src, item / splits, split_rows(dims.I, splits, item % splits), dims,
                            rule, st, logits_ws);
}

// Split backward, step r, block per (b, g): partial[b, g] = range g's share of gv^{r-1}.
template <typename Source>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<typename Source::acc_type>())
    routing_backward_rows_kernel(const Source src, const RoutingDims dims, const int64_t splits,
                                 const int64_t r, const RoutingRule<typename Source::acc_type> rule,
                                 const BackwardState<typename Source::acc_type> st,
                                 typename Source::acc_type* partial) {
  for_each_range(dims, splits, partial,
                 [&](int64_t b, RowRange rows, typename Source::acc_type* gv_acc) {
                   backward_rows(src, b, rows, r, dims, rule, st, gv_acc);
                 });
}

// Split backward, step r, block per b: gv^{r-1} = the partials in range order, then gs^{r-1} =
// f_{r-1}'s VJP at s^{r-1} of gv^{r-1}, and at the last step grad_bias_items.
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<acc_t>())
    routing_backward_reduce_kernel(const acc_t* partial, const int64_t splits, const acc_t* s_hist,
                                   const RoutingDims dims, const int64_t r, const acc_t eps,
                                   const RoutingRule<acc_t> rule, const BackwardState<acc_t> st,
                                   acc_t* gv_ws, acc_t* grad_bias_items) {
  const int64_t JD = dims.J * dims.D;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    acc_t* gv = gv_ws + b * JD;
    sum_ranges(partial, splits, b, JD, static_cast<const acc_t*>(nullptr), gv);
    __syncthreads();  // gv^{r-1} complete
    backward_pass_vjp(b, r - 1, s_hist, dims, rule, eps, st, gv);
    if (r - 1 == st.first_r) {
      sum_gs(b, JD, st, grad_bias_items);
      __syncthreads();
    }
  }
}

// Split backward with nothing to walk back (detach, or one iteration): grad_bias_items.
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<acc_t>())
    routing_sum_gs_kernel(const RoutingDims dims, const BackwardState<acc_t> st,
                          acc_t* grad_bias_items) {
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x)
    sum_gs(b, dims.J * dims.D, st, grad_bias_items);
}

// ---- the vote gradient of the saved state ----

// Rows of an item of write_vote_grad_rows_kernel.
constexpr int64_t kVoteGradRows = 8;

// grad_votes (B, I, J, D) in rows at grad_rows = the vote gradient of the saved state, an item
// per (b, tile of kVoteGradRows rows) (grid-stride over items); thread t owns the columns
// jd = t, t + blockDim, ... and finds its capsule j once per column, not per element (per element
// that is four 64-bit divisions, most of the work of writing it). Each row's writes are coalesced.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, routing_min_blocks<acc_t>())
    write_vote_grad_rows_kernel(const BackwardState<acc_t> st, int64_t B,
                                const CapsuleStrides grad_rows, scalar_t* grad_votes) {
  const int64_t JD = st.J * st.D, tiles = ceil_div<int64_t>(st.I, kVoteGradRows);
  for (int64_t item = blockIdx.x; item < B * tiles; item += gridDim.x) {
    const int64_t b = item / tiles, i0 = (item % tiles) * kVoteGradRows;
    const int64_t i1 = i0 + kVoteGradRows < st.I ? i0 + kVoteGradRows : st.I;
    ColumnWalk col(st.D);
    for (int64_t jd = threadIdx.x; jd < JD; jd += blockDim.x, col.next())
      for (int64_t i = i0; i < i1; ++i)
        grad_votes[grad_rows.offset(b, i) + jd] =
            static_cast<scalar_t>(st.vote_grad(b, i, col.j, jd));
  }
}

// Blocks of write_vote_grad_rows_kernel for B elements of I rows.
inline unsigned int vote_grad_rows_blocks(int64_t B, int64_t I) {
  return blocks_for_items(B * ceil_div<int64_t>(I, kVoteGradRows));
}

}  // namespace cuda
}  // namespace capsroute
