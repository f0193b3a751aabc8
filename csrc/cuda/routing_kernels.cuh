// Dynamic routing kernels shared by dynamic_routing (votes read from memory) and
// dense_capsules (votes computed on the fly as weight_ij @ u_i, never stored).
//
// The kernels are templated on a "vote source": a functor with
//   using acc_type = ...;                                    // accumulation type
//   __device__ acc_type operator()(int64_t b, int64_t i, int64_t jd) const;
// returning vote u[b, i, j, d] with jd = j * D + d.
//
// Structure (one thread block of kBlockThreads threads per batch element b; everything that
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
// The algorithm is exactly the CPU one (csrc/cpu/routing_element.h) and reads/writes the same
// saved state (s_hist).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../common/math.h"
#include "utils.cuh"

namespace capsroute {
namespace cuda {

// Input rows per tile: phase 1 (warp per row) then phase 2 (column owners) run over the same
// rows while their votes are still in cache.
constexpr int64_t kRoutingTile = 32;

struct RoutingDims {
  int64_t B, I, J, D, iters;
  bool leaky;
};

// ---- vote sources ----

// votes (B, I, J, D), contiguous.
template <typename scalar_t, typename acc_t>
struct MemoryVotes {
  using acc_type = acc_t;
  const scalar_t* votes;
  int64_t I, JD;
  __device__ __forceinline__ acc_t operator()(int64_t b, int64_t i, int64_t jd) const {
    return static_cast<acc_t>(votes[(b * I + i) * JD + jd]);
  }
};

// votes_bij = weight_ij @ u_bi: u (B, I, Din), weight (I, J, D, Din), both contiguous.
template <typename scalar_t, typename acc_t>
struct DenseVotes {
  using acc_type = acc_t;
  const scalar_t* u;
  const scalar_t* weight;
  int64_t I, JD, Din;
  __device__ __forceinline__ acc_t operator()(int64_t b, int64_t i, int64_t jd) const {
    const scalar_t* w = weight + (i * JD + jd) * Din;
    const scalar_t* x = u + (b * I + i) * Din;
    acc_t sum = 0;
    for (int64_t k = 0; k < Din; ++k) sum += static_cast<acc_t>(w[k]) * static_cast<acc_t>(x[k]);
    return sum;
  }
};

// ---- device helpers ----

// Coupling of one input row: c = softmax over the J logits (with an extra zero logit when
// leaky, its share dropped), as coupling_row in common/math.h. Called by a whole warp; lane l
// reads logits[j] and writes c[j] for j = l, l + 32, ... only.
template <typename acc_t>
__device__ __forceinline__ void warp_coupling_row(const acc_t* logits, int64_t J, bool leaky, acc_t* c, int lane) {
  acc_t max_logit = leaky ? acc_t(0) : neg_infinity(acc_t(0));
  for (int64_t j = lane; j < J; j += kWarpSize) max_logit = logits[j] > max_logit ? logits[j] : max_logit;
  max_logit = warp_max(max_logit);
  acc_t denom = 0;
  for (int64_t j = lane; j < J; j += kWarpSize) denom += acc_exp(logits[j] - max_logit);
  denom = warp_sum(denom);
  if (leaky) denom += acc_exp(-max_logit);
  const acc_t inv_denom = acc_t(1) / denom;
  for (int64_t j = lane; j < J; j += kWarpSize) c[j] = acc_exp(logits[j] - max_logit) * inv_denom;
}

// v = squash(s) for the J capsules of one (J, D) slab; warp per capsule.
template <typename acc_t>
__device__ __forceinline__ void block_squash(const acc_t* s, int64_t J, int64_t D, acc_t eps, acc_t* v, int warp,
                                             int nwarps, int lane) {
  for (int64_t j = warp; j < J; j += nwarps) {
    const acc_t* sj = s + j * D;
    acc_t q = 0;
    for (int64_t d = lane; d < D; d += kWarpSize) q += sj[d] * sj[d];
    q = warp_sum(q);
    const acc_t scale = squash_scale(q, eps);
    for (int64_t d = lane; d < D; d += kWarpSize) v[j * D + d] = scale * sj[d];
  }
}

// ---- forward ----

// Per element b, slices of: logits (B, I, J), coupling (B, I, J), v (B, J, D).
template <typename acc_t>
struct ForwardWorkspace {
  acc_t* logits;
  acc_t* coupling;
  acc_t* v;
};

// Writes s_hist (B, iters, J, D), v_out (B, J, D) and the final coupling c_out (B, I, J).
// bias (J, D) or nullptr.
template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads)
    routing_forward_kernel(const Source src, const scalar_t* bias, const RoutingDims dims,
                           const typename Source::acc_type eps, const ForwardWorkspace<typename Source::acc_type> ws,
                           typename Source::acc_type* s_hist, scalar_t* v_out, scalar_t* c_out) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, D = dims.D, JD = J * D, R = dims.iters;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;

  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    acc_t* logits = ws.logits + b * I * J;
    acc_t* coupling = ws.coupling + b * I * J;
    acc_t* v = ws.v + b * JD;  // v^{r-1} while iteration r runs

    for (int64_t r = 0; r < R; ++r) {
      acc_t* s = s_hist + (b * R + r) * JD;
      // Column owners: s = bias (their own columns only until the squash below).
      for (int64_t jd = tid; jd < JD; jd += nthreads) s[jd] = bias != nullptr ? static_cast<acc_t>(bias[jd]) : acc_t(0);

      for (int64_t i0 = 0; i0 < I; i0 += kRoutingTile) {
        const int64_t i1 = i0 + kRoutingTile < I ? i0 + kRoutingTile : I;
        // Phase 1, warp per row: b^r_ij = b^{r-1}_ij + <u_ij, v^{r-1}_j> (b^0 = 0), c^r = softmax.
        for (int64_t i = i0 + warp; i < i1; i += nwarps) {
          acc_t* li = logits + i * J;
          for (int64_t j = lane; j < J; j += kWarpSize) {
            acc_t logit = 0;
            if (r > 0) {
              const acc_t* vj = v + j * D;
              acc_t agreement = 0;
              for (int64_t d = 0; d < D; ++d) agreement += src(b, i, j * D + d) * vj[d];
              logit = li[j] + agreement;
            }
            li[j] = logit;
          }
          acc_t* ci = coupling + i * J;
          warp_coupling_row(li, J, dims.leaky, ci, lane);
          if (r == R - 1) {
            for (int64_t j = lane; j < J; j += kWarpSize) c_out[(b * I + i) * J + j] = static_cast<scalar_t>(ci[j]);
          }
        }
        __syncthreads();  // coupling of the tile written by warps, read by column owners
        // Phase 2, column owners: s_jd += sum_{i in tile} c_ij u_ijd.
        for (int64_t jd = tid; jd < JD; jd += nthreads) {
          const int64_t j = jd / D;
          acc_t acc = s[jd];
          for (int64_t i = i0; i < i1; ++i) acc += coupling[i * J + j] * src(b, i, jd);
          s[jd] = acc;
        }
        __syncthreads();  // end of tile
      }
      __syncthreads();  // s complete (also when I == 0 and no tile ran)
      block_squash(s, J, D, eps, v, warp, nwarps, lane);
      __syncthreads();  // v^r complete before the next iteration's agreement reads it
    }
    for (int64_t jd = tid; jd < JD; jd += nthreads) v_out[b * JD + jd] = static_cast<scalar_t>(v[jd]);
    __syncthreads();
  }
}

// Allocates the workspaces and launches the forward on the current stream (B > 0).
template <typename Source, typename scalar_t>
void launch_routing_forward(const Source& src, const scalar_t* bias, const RoutingDims& dims, double eps,
                            at::Tensor& s_hist, at::Tensor& v, at::Tensor& c) {
  using acc_t = typename Source::acc_type;
  const auto acc_options = s_hist.options();
  at::Tensor logits = at::empty({dims.B, dims.I, dims.J}, acc_options);
  at::Tensor coupling = at::empty({dims.B, dims.I, dims.J}, acc_options);
  at::Tensor v_ws = at::empty({dims.B, dims.J, dims.D}, acc_options);
  const ForwardWorkspace<acc_t> ws{logits.mutable_data_ptr<acc_t>(), coupling.mutable_data_ptr<acc_t>(),
                                   v_ws.mutable_data_ptr<acc_t>()};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  routing_forward_kernel<Source, scalar_t><<<blocks_for_items(dims.B), kBlockThreads, 0, stream>>>(
      src, bias, dims, static_cast<acc_t>(eps), ws, s_hist.mutable_data_ptr<acc_t>(), v.mutable_data_ptr<scalar_t>(),
      c.mutable_data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // The workspaces go back to the caching allocator on this stream: later work on the stream
  // runs after the kernel, so reusing them is safe.
}

// ---- backward ----

// Saved state of the backward pass, per element b (see RoutingBackward in
// csrc/cpu/routing_element.h). Iterations r = first_r .. iters-1 are kept (nkeep of them,
// slot k = r - first_r): first_r = iters-1 with detach, 0 without.
//   v_hist   (B, iters, J, D)  v^r = squash(s^r), every r
//   gs_hist  (B, nkeep, J, D)  gs^r = dL/ds^r
//   coupling (B, nkeep, I, J)  c^r
//   g_logits (B, nkeep, I, J)  G^r = dL/db^{r+1}; G^{iters-1} = 0 (with detach the one slot
//                              stays 0, so the vote gradient below needs no special case)
// and the vote gradient
//   g_u[b, i, j, d] = sum_{r >= first_r} c^r_ij gs^r_jd + G^r_ij v^r_jd.
template <typename acc_t>
struct BackwardState {
  acc_t* v_hist;
  acc_t* gs_hist;
  acc_t* coupling;
  acc_t* g_logits;
  int64_t I, J, D, iters, first_r, nkeep;

  __device__ __forceinline__ acc_t vote_grad(int64_t b, int64_t i, int64_t jd) const {
    const int64_t JD = J * D, j = jd / D;
    acc_t sum = 0;
    for (int64_t k = 0; k < nkeep; ++k) {
      const int64_t r = first_r + k;
      const int64_t ij = ((b * nkeep + k) * I + i) * J + j;
      sum += coupling[ij] * gs_hist[(b * nkeep + k) * JD + jd] + g_logits[ij] * v_hist[(b * iters + r) * JD + jd];
    }
    return sum;
  }
};

// Fills the BackwardState buffers and grad_bias_items (B, J, D) = sum_r gs^r for each b.
// grad_v (B, J, D), s_hist (B, iters, J, D); logits (B, I, J), gv and gv_next (B, J, D) are
// scratch.
template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads)
    routing_backward_kernel(const Source src, const scalar_t* grad_v, const typename Source::acc_type* s_hist,
                            const RoutingDims dims, const bool detach, const typename Source::acc_type eps,
                            const BackwardState<typename Source::acc_type> st, typename Source::acc_type* logits_ws,
                            typename Source::acc_type* gv_ws, typename Source::acc_type* gv_next_ws,
                            typename Source::acc_type* grad_bias_items) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, D = dims.D, JD = J * D, R = dims.iters;
  const int64_t first_r = st.first_r, nkeep = st.nkeep;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;

  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    const acc_t* s_b = s_hist + b * R * JD;
    acc_t* v_b = st.v_hist + b * R * JD;
    acc_t* gs_b = st.gs_hist + b * nkeep * JD;
    acc_t* c_b = st.coupling + b * nkeep * I * J;
    acc_t* g_b = st.g_logits + b * nkeep * I * J;
    acc_t* logits = logits_ws + b * I * J;
    acc_t* gv = gv_ws + b * JD;
    acc_t* gv_next = gv_next_ws + b * JD;

    // 1. v^r = squash(s^r) for every r (warp per capsule row of the (R*J, D) slab).
    block_squash(s_b, R * J, D, eps, v_b, warp, nwarps, lane);
    __syncthreads();

    // 2. c^r for r >= first_r, from b^{r+1} = b^r + <u, v^r>, b^0 = 0 (warp per row).
    for (int64_t i = warp; i < I; i += nwarps) {
      acc_t* li = logits + i * J;
      for (int64_t j = lane; j < J; j += kWarpSize) li[j] = 0;
      for (int64_t r = 0; r < R; ++r) {
        if (r > 0) {
          const acc_t* v_prev = v_b + (r - 1) * JD;
          for (int64_t j = lane; j < J; j += kWarpSize) {
            acc_t agreement = 0;
            for (int64_t d = 0; d < D; ++d) agreement += src(b, i, j * D + d) * v_prev[j * D + d];
            li[j] += agreement;
          }
        }
        if (r >= first_r) warp_coupling_row(li, J, dims.leaky, c_b + (r - first_r) * I * J + i * J, lane);
      }
    }

    // 3. gv = grad_v (column owners); G^{iters-1} = 0.
    for (int64_t jd = tid; jd < JD; jd += nthreads) gv[jd] = static_cast<acc_t>(grad_v[b * JD + jd]);
    acc_t* g_last = g_b + (nkeep - 1) * I * J;
    for (int64_t ij = tid; ij < I * J; ij += nthreads) g_last[ij] = 0;
    __syncthreads();

    // 4. Walk the iterations backwards.
    for (int64_t r = R - 1; r >= first_r; --r) {
      const int64_t k = r - first_r;
      const acc_t* s = s_b + r * JD;
      acc_t* gs = gs_b + k * JD;
      // gs^r = squash_vjp(s^r, gv) (warp per capsule).
      for (int64_t j = warp; j < J; j += nwarps) {
        acc_t q = 0, sg = 0;
        for (int64_t d = lane; d < D; d += kWarpSize) {
          q += s[j * D + d] * s[j * D + d];
          sg += s[j * D + d] * gv[j * D + d];
        }
        q = warp_sum(q);
        sg = warp_sum(sg);
        const SquashVjp<acc_t> coeffs = squash_vjp_coeffs(q, eps);
        const acc_t radial = coeffs.radial * sg;
        for (int64_t d = lane; d < D; d += kWarpSize) gs[j * D + d] = coeffs.scale * gv[j * D + d] + radial * s[j * D + d];
      }
      __syncthreads();  // gs^r complete
      if (r == 0 || detach) break;  // b^0 = 0 is a constant; detach stops at the last s (uniform per block)

      // dL/db^r = dL/db^{r+1} + softmax VJP of gc = <gs^r, u>; gv^{r-1} = sum_i dL/db^r_ij u_ij.
      const acc_t* c = c_b + k * I * J;
      const acc_t* g_next = g_b + k * I * J;   // G^r = dL/db^{r+1}
      acc_t* g_here = g_b + (k - 1) * I * J;   // G^{r-1} = dL/db^r
      for (int64_t jd = tid; jd < JD; jd += nthreads) gv_next[jd] = 0;
      for (int64_t i0 = 0; i0 < I; i0 += kRoutingTile) {
        const int64_t i1 = i0 + kRoutingTile < I ? i0 + kRoutingTile : I;
        // Phase 1, warp per row (lanes only touch their own j entries).
        for (int64_t i = i0 + warp; i < i1; i += nwarps) {
          acc_t weighted = 0;
          for (int64_t j = lane; j < J; j += kWarpSize) {
            acc_t gc = 0;
            for (int64_t d = 0; d < D; ++d) gc += gs[j * D + d] * src(b, i, j * D + d);
            g_here[i * J + j] = gc;  // gc for now, G^{r-1} below
            weighted += c[i * J + j] * gc;
          }
          weighted = warp_sum(weighted);
          for (int64_t j = lane; j < J; j += kWarpSize)
            g_here[i * J + j] = g_next[i * J + j] + c[i * J + j] * (g_here[i * J + j] - weighted);
        }
        __syncthreads();  // G^{r-1} of the tile written by warps, read by column owners
        // Phase 2, column owners: gv_next_jd += sum_{i in tile} G^{r-1}_ij u_ijd.
        for (int64_t jd = tid; jd < JD; jd += nthreads) {
          const int64_t j = jd / D;
          acc_t acc = gv_next[jd];
          for (int64_t i = i0; i < i1; ++i) acc += g_here[i * J + j] * src(b, i, jd);
          gv_next[jd] = acc;
        }
        __syncthreads();  // end of tile
      }
      __syncthreads();  // gv_next complete (also when I == 0)
      acc_t* tmp = gv;
      gv = gv_next;
      gv_next = tmp;
    }

    // 5. grad_bias_items[b] = sum_r gs^r (column owners; gs complete after the barrier above).
    for (int64_t jd = tid; jd < JD; jd += nthreads) {
      acc_t sum = 0;
      for (int64_t k = nkeep - 1; k >= 0; --k) sum += gs_b[k * JD + jd];
      grad_bias_items[b * JD + jd] = sum;
    }
    __syncthreads();
  }
}

// Owns the backward buffers (they must outlive every kernel that reads the state; stream
// order makes freeing them afterwards safe).
template <typename acc_t>
struct BackwardBuffers {
  at::Tensor v_hist, gs_hist, coupling, g_logits;
  BackwardState<acc_t> state;
};

// Allocates the state, launches routing_backward_kernel on the current stream (B > 0) and
// returns the state for the op-specific vote-gradient kernels.
template <typename Source, typename scalar_t>
BackwardBuffers<typename Source::acc_type> launch_routing_backward(const Source& src, const scalar_t* grad_v,
                                                                   const at::Tensor& s_hist, const RoutingDims& dims,
                                                                   bool detach, double eps,
                                                                   at::Tensor& grad_bias_items) {
  using acc_t = typename Source::acc_type;
  const int64_t B = dims.B, I = dims.I, J = dims.J, D = dims.D, R = dims.iters;
  const int64_t first_r = detach ? R - 1 : 0, nkeep = R - first_r;
  const auto acc_options = s_hist.options();
  at::Tensor v_hist = at::empty({B, R, J, D}, acc_options);
  at::Tensor gs_hist = at::empty({B, nkeep, J, D}, acc_options);
  at::Tensor coupling = at::empty({B, nkeep, I, J}, acc_options);
  at::Tensor g_logits = at::empty({B, nkeep, I, J}, acc_options);
  const BackwardState<acc_t> state{v_hist.mutable_data_ptr<acc_t>(),
                                   gs_hist.mutable_data_ptr<acc_t>(),
                                   coupling.mutable_data_ptr<acc_t>(),
                                   g_logits.mutable_data_ptr<acc_t>(),
                                   I,
                                   J,
                                   D,
                                   R,
                                   first_r,
                                   nkeep};
  at::Tensor logits = at::empty({B, I, J}, acc_options);
  at::Tensor gv = at::empty({B, J, D}, acc_options);
  at::Tensor gv_next = at::empty({B, J, D}, acc_options);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  routing_backward_kernel<Source, scalar_t><<<blocks_for_items(B), kBlockThreads, 0, stream>>>(
      src, grad_v, s_hist.const_data_ptr<acc_t>(), dims, detach, static_cast<acc_t>(eps), state,
      logits.mutable_data_ptr<acc_t>(), gv.mutable_data_ptr<acc_t>(), gv_next.mutable_data_ptr<acc_t>(),
      grad_bias_items.mutable_data_ptr<acc_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return BackwardBuffers<acc_t>{v_hist, gs_hist, coupling, g_logits, state};
}

}  // namespace cuda
}  // namespace capsroute
