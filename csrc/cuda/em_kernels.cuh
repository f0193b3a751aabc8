// EM routing kernels (docs/ops.md, em_routing): the forward (M-step, E-step) and the exact backward
// of csrc/cpu/em_element.h, step by step, with the same saved statistics.
//
// The kernels are templated on a vote source (vote_sources.cuh: MemoryVotes reads votes
// (B, I, J, H) from memory; PoseVotes computes V_ij = P_i @ W_ij of em_routing_pose on the fly),
// returning vote V[b, i, j, h] with jh = j * H + h.
//
// Structure (one thread block of kBlockThreads threads per (element b, range of its input rows)
// in the rows kernels, per element in the others, grid-stride; everything that scales with I, J
// or H lives in global-memory workspaces in the accumulation dtype, so any size works and no
// shared memory is needed):
//   * "column owner": thread t owns the flat (j, h) columns jh = t, t + blockDim, ... and sums
//     over the range's rows in order (mean, variance and their gradients); a warp reads coalesced
//     vote rows. A per-element kernel adds the ranges' sums in range order.
//   * "capsule": thread t owns capsules j = t, t + blockDim, ... (cost, activation logit,
//     E-step normaliser, mass and the beta gradients).
//   * "warp per row": warp w handles the range's input rows i0 + w, i0 + w + nwarps, ...; lane l
//     handles j = l, l + 32, ... of that row (E-step softmax, its VJP, the M-step's per-row terms)
//     and only touches its own (i, j) entries, so a row needs warp reductions but no barrier.
// Every loop bound is uniform per warp (rows) or per block (iterations), and every phase that
// reads what other threads wrote is preceded by __syncthreads(). Every sum runs in a fixed
// order (no atomics): results are deterministic. With one range the sums over i run in the CPU's
// order; sums over j within a row are warp butterflies. Device code only: the launches are in
// em_launch.cuh, and tests/emulator runs these kernels on the host.
//
// Saved statistics, stats (B, iters, J, 2H + 1) in the accumulation dtype, laid out as the CPU
// writes them: per element and iteration t one block of J (2H + 1) values,
// mu (J*H) | var (J*H) | logit (J).
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/dims.h"
#include "../common/em_math.h"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// ---- device helpers ----

// How a warp covers an input row in the rows kernels ("warp per row" above):
//   capsule  lane l takes capsules j = l, l + 32, ... and loops over their H values: any H, but
//            each warp instruction gathers 32 values H apart (16 lines for H = 16 in float);
//   column   lane l takes the row's entries jh = l, l + 32, ..., so capsule j has H consecutive
//            lanes and a warp instruction reads 32 consecutive values; sums over h are xor
//            shuffles within groups of H lanes. Only where H divides the warp size.
enum class EmLanes { capsule, column };

__host__ __device__ __forceinline__ bool em_column_lanes_fit(int64_t H) {
  return H >= 1 && H <= kWarpSize && kWarpSize % H == 0;
}

// log2 of H where em_column_lanes_fit(H): entry jh's capsule is jh >> bits (a 64-bit division by
// a run-time H costs tens of instructions, once per entry and row).
__device__ __forceinline__ int em_column_bits(int64_t H) {
  int bits = 0;
  while ((int64_t(1) << bits) < H) ++bits;
  return bits;
}

// Sum over aligned groups of `group` lanes (a power of two <= 32): every lane of a group gets
// its group's sum, bitwise the same (as warp_sum). All 32 lanes must call it together.
template <typename T>
__device__ __forceinline__ T lane_group_sum(T x, int group) {
  for (int offset = group >> 1; offset > 0; offset >>= 1)
    x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The part of ln a_j + ln p_ij that does not depend on i:
// ln sigmoid(logit_j) - sum_h (ln var_jh / 2 + ln(2 pi) / 2).
template <typename acc_t>
__device__ __forceinline__ acc_t em_e_step_norm(acc_t logit, const acc_t* var_j, int64_t H) {
  acc_t norm = em_log_sigmoid(logit);
  for (int64_t h = 0; h < H; ++h) norm -= acc_t(0.5) * acc_log(var_j[h]) + em_half_log_2pi<acc_t>();
  return norm;
}

// E-step of one input row: R_ij = softmax_j(norm_j - sum_h (V_ijh - mu_jh)^2 / (2 var_jh)), in
// the log domain. Called by a whole warp; writes Ri[j] from its lane of capsule j only.
template <typename Source>
__device__ __forceinline__ void warp_em_e_step_row(EmLanes lanes, const Source& src, int64_t b,
                                                   int64_t i, int64_t J, int64_t H,
                                                   const typename Source::acc_type* mu,
                                                   const typename Source::acc_type* var,
                                                   const typename Source::acc_type* norm,
                                                   typename Source::acc_type* Ri, int lane) {
  using acc_t = typename Source::acc_type;
  acc_t max_log = neg_infinity(acc_t(0));
  if (lanes == EmLanes::column) {
    const int64_t JH = J * H;
    const int bits = em_column_bits(H);
    for (int64_t base = 0; base < JH; base += kWarpSize) {
      const int64_t jh = base + lane, j = jh >> bits;
      acc_t sq = 0;
      if (jh < JH) {
        const acc_t diff = src(b, i, jh) - mu[jh];
        sq = diff * diff / (acc_t(2) * var[jh]);
      }
      sq = lane_group_sum(sq, static_cast<int>(H));
      if (jh < JH) {
        const acc_t log_p = norm[j] - sq;
        if (jh == j << bits) Ri[j] = log_p;
        max_log = log_p > max_log ? log_p : max_log;
      }
    }
    __syncwarp();  // Ri written by the capsules' first lanes, read below by lane j % 32
  } else {
    for (int64_t j = lane; j < J; j += kWarpSize) {
      acc_t log_p = norm[j];
      for (int64_t h = 0; h < H; ++h) {
        const acc_t diff = src(b, i, j * H + h) - mu[j * H + h];
        log_p -= diff * diff / (acc_t(2) * var[j * H + h]);
      }
      Ri[j] = log_p;
      max_log = log_p > max_log ? log_p : max_log;
    }
  }
  max_log = warp_max(max_log);
  acc_t denom = 0;
  for (int64_t j = lane; j < J; j += kWarpSize) denom += (Ri[j] = acc_exp(Ri[j] - max_log));
  denom = warp_sum(denom);
  for (int64_t j = lane; j < J; j += kWarpSize) Ri[j] /= denom;
}

// M-step sums of column jh (capsule j) over rows [i0, i1), in order: m += r_ij and
// sum += r_ij V_ijh, r_ij = R_ij a_i (R: the element's (I, J) assignments).
template <typename Source, typename scalar_t>
__device__ __forceinline__ void em_mean_sums(const Source& src, int64_t b, int64_t i0, int64_t i1,
                                             int64_t J, int64_t jh, int64_t j,
                                             const typename Source::acc_type* R, const scalar_t* a,
                                             typename Source::acc_type& m,
                                             typename Source::acc_type& sum) {
  using acc_t = typename Source::acc_type;
  for (int64_t i = i0; i < i1; ++i) {
    const acc_t r = R[i * J + j] * static_cast<acc_t>(a[i]);
    m += r;
    sum += r * src(b, i, jh);
  }
}

// sum_i r_ij (V_ijh - mean)^2 over rows [i0, i1), in order.
template <typename Source, typename scalar_t>
__device__ __forceinline__ typename Source::acc_type em_var_sum(
    const Source& src, int64_t b, int64_t i0, int64_t i1, int64_t J, int64_t jh, int64_t j,
    const typename Source::acc_type* R, const scalar_t* a, typename Source::acc_type mean) {
  using acc_t = typename Source::acc_type;
  acc_t sq = 0;
  for (int64_t i = i0; i < i1; ++i) {
    const acc_t r = R[i * J + j] * static_cast<acc_t>(a[i]);
    const acc_t diff = src(b, i, jh) - mean;
    sq += r * diff * diff;
  }
  return sq;
}

// Capsule j after the M-step of iteration t: the activation logit lam (beta_a - sum_h (beta_u +
// ln(var_jh) / 2) m_j) into logit[j] and, when an E-step follows, its normaliser into norm[j].
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ void em_capsule_logit(int64_t j, int64_t H, acc_t m, const acc_t* var,
                                                 scalar_t beta_u, scalar_t beta_a, acc_t lam,
                                                 bool before_e_step, acc_t* logit, acc_t* norm) {
  const acc_t lg = em_activation_logit(lam, static_cast<acc_t>(beta_u), static_cast<acc_t>(beta_a),
                                       m, var + j * H, H);
  logit[j] = lg;
  if (before_e_step) norm[j] = em_e_step_norm(lg, var + j * H, H);
}

// The outputs of element b from its last statistics: pose (J*H) = the means, a_out (J) =
// sigmoid(logit).
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ void em_write_outputs(const acc_t* last, int64_t J, int64_t JH,
                                                 scalar_t* pose_b, scalar_t* a_out_b, int tid,
                                                 int nthreads) {
  for (int64_t jh = tid; jh < JH; jh += nthreads) pose_b[jh] = static_cast<scalar_t>(last[jh]);
  for (int64_t j = tid; j < J; j += nthreads)
    a_out_b[j] = static_cast<scalar_t>(em_sigmoid(last[2 * JH + j]));
}

// ---- forward ----

// The EM kernels are declared for at least 2 resident blocks per SM, which allows 128
// registers a thread. Without it ptxas aimed at 3-4 blocks (64-80 registers) and spilled to get
// there (scripts/kernel_resources.py, which CI runs, fails on any spill). The float64 backward
// still spilled at 128 on sm_80: 1 block there (up to 255 registers; float64 is for checking).
template <typename acc_t>
constexpr int em_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  return sizeof(acc_t) == 8 ? 1 : 2;
#else
  return 2;
#endif
}

// Per element b, slices of: R (B, I, J) the running assignments, mass (B, J), norm (B, J); and
// partial (B, splits, J + J*H): each range's column sums.
template <typename acc_t>
struct EmForwardWorkspace {
  acc_t* R;
  acc_t* mass;
  acc_t* norm;
  acc_t* partial;
};

// The forward: each element's I rows cut into `splits` ranges, a block per (element, range), so a
// small batch still fills the GPU and no thread walks all I rows. Writes stats
// (B, iters, J, 2H + 1), pose (B, J, H) = the last means and a_out (B, J) from a_in (B, I),
// beta_u and beta_a (J,), all contiguous. Per iteration t, four launches (em_sequence.cuh):
//   em_mean_rows_kernel     R^t of the range's rows (1/J, or the E-step of iteration t - 1), then
//                           the range's sums m_j and sum_i r_ij V_ijh into partial;
//   em_mean_reduce_kernel   per element: the ranges' sums in range order, mu and m;
//   em_var_rows_kernel      the range's sum_i r_ij (V_ijh - mu_jh)^2 into partial;
//   em_var_reduce_kernel    per element: var, the logits, the E-step normalisers, and after the
//                           last iteration the outputs.
// Results are deterministic for a given number of ranges; the sums over i run range by range
// (with more than one range, not in the CPU's one chain: the same values up to rounding).

template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, em_min_blocks<typename Source::acc_type>())
    em_mean_rows_kernel(const Source src, const scalar_t* a_in, const EmDims dims, int64_t splits,
                        EmLanes lanes, int64_t t, const typename Source::acc_type* stats,
                        const EmForwardWorkspace<typename Source::acc_type> ws) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H, block = dims.stats_block();
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;

  for_each_row_range(dims.B, I, splits, [&](int64_t b, int64_t item, RowRange rows) {
    const int64_t i0 = rows.begin, i1 = rows.end;
    acc_t* R = ws.R + b * I * J;
    const scalar_t* a = a_in + b * I;
    if (t == 0) {
      for (int64_t ij = i0 * J + tid; ij < i1 * J; ij += nthreads) R[ij] = acc_t(1) / acc_t(J);
    } else {
      const acc_t* mu = stats + (b * dims.iters + t - 1) * block;
      for (int64_t i = i0 + warp; i < i1; i += nwarps)
        warp_em_e_step_row(lanes, src, b, i, J, H, mu, mu + JH, ws.norm + b * J, R + i * J, lane);
    }
    __syncthreads();                            // the range's R^t complete
    acc_t* out = ws.partial + item * (J + JH);  // m (J) | sum (JH)
    for (int64_t jh = tid; jh < JH; jh += nthreads) {
      const int64_t j = jh / H;
      acc_t m = 0, sum = 0;
      em_mean_sums(src, b, i0, i1, J, jh, j, R, a, m, sum);
      out[J + jh] = sum;
      if (jh == j * H) out[j] = m;
    }
  });
}

template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    em_mean_reduce_kernel(const EmDims dims, int64_t splits, int64_t t, const acc_t eps,
                          const EmForwardWorkspace<acc_t> ws, acc_t* stats) {
  const int64_t J = dims.J, H = dims.H, JH = J * H;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    const acc_t* part = ws.partial + b * splits * (J + JH);
    acc_t* mu = stats + (b * dims.iters + t) * dims.stats_block();
    for (int64_t jh = threadIdx.x; jh < JH; jh += blockDim.x) {
      const int64_t j = jh / H;
      acc_t m = 0, sum = 0;
      for (int64_t s = 0; s < splits; ++s) {
        m += part[s * (J + JH) + j];
        sum += part[s * (J + JH) + J + jh];
      }
      mu[jh] = sum / (m + eps);
      if (jh == j * H) ws.mass[b * J + j] = m;
    }
  }
}

template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, em_min_blocks<typename Source::acc_type>())
    em_var_rows_kernel(const Source src, const scalar_t* a_in, const EmDims dims, int64_t splits,
                       int64_t t, const typename Source::acc_type* stats,
                       const EmForwardWorkspace<typename Source::acc_type> ws) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H;
  for_each_row_range(dims.B, I, splits, [&](int64_t b, int64_t item, RowRange rows) {
    const int64_t i0 = rows.begin, i1 = rows.end;
    const acc_t* mu = stats + (b * dims.iters + t) * dims.stats_block();
    acc_t* out = ws.partial + item * (J + JH);  // sq (JH)
    for (int64_t jh = threadIdx.x; jh < JH; jh += blockDim.x)
      out[jh] = em_var_sum(src, b, i0, i1, J, jh, jh / H, ws.R + b * I * J, a_in + b * I, mu[jh]);
  });
}

template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    em_var_reduce_kernel(const scalar_t* beta_u, const scalar_t* beta_a, const EmDims dims,
                         int64_t splits, int64_t t, const acc_t eps,
                         const EmForwardWorkspace<acc_t> ws, acc_t* stats, scalar_t* pose,
                         scalar_t* a_out) {
  const int64_t J = dims.J, H = dims.H, JH = J * H, iters = dims.iters, block = dims.stats_block();
  const int tid = threadIdx.x, nthreads = blockDim.x;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    const acc_t* part = ws.partial + b * splits * (J + JH);
    const acc_t* mass = ws.mass + b * J;
    acc_t* st = stats + b * iters * block;
    acc_t* var = st + t * block + JH;
    for (int64_t jh = tid; jh < JH; jh += nthreads) {
      acc_t sq = 0;
      for (int64_t s = 0; s < splits; ++s) sq += part[s * (J + JH) + jh];
      var[jh] = sq / (mass[jh / H] + eps) + eps;
    }
    __syncthreads();  // var complete
    const acc_t lam = static_cast<acc_t>(em_lambda(dims.final_lambda, t));
    for (int64_t j = tid; j < J; j += nthreads)
      em_capsule_logit(j, H, mass[j], var, beta_u[j], beta_a[j], lam, t < iters - 1, var + JH,
                       ws.norm + b * J);
    if (t == iters - 1) {
      __syncthreads();  // logits complete
      em_write_outputs(st + t * block, J, JH, pose + b * JH, a_out + b * J, tid, nthreads);
    }
    __syncthreads();  // end of element
  }
}

// ---- backward ----

// Per element b, slices of:
//   R_hist  (B, iters, I, J)  R^t of every iteration, recomputed from the saved statistics
//   g_R     (B, I, J)         dL/dR^t; the E-step overwrites it with dL/dL_ij, L the E-step logits
//   norm    (B, iters, J)     E-step normaliser of the statistics of iteration t (t < iters - 1)
//   g_mu, g_var (B, J, H)     dL/dmu^t, dL/dvar^t
//   g_logit, mass, g_mass (B, J)
// and per (element, range):
//   partial_cols (B, splits, 2 J H + J)  the range's sums of g_mu | g_var | g_logit
//   partial_mass (B, splits, iters, J)   the range's sums of R^t a
template <typename acc_t>
struct EmBackwardWorkspace {
  acc_t* R_hist;
  acc_t* g_R;
  acc_t* norm;
  acc_t* g_mu;
  acc_t* g_var;
  acc_t* g_logit;
  acc_t* mass;
  acc_t* g_mass;
  acc_t* partial_cols;
  acc_t* partial_mass;
};

// What the backward writes, in the accumulation dtype: g_V (B, I, J, H) in rows at g_V_rows (as
// MemoryVotes reads votes), g_a (B, I) and the per-element beta gradients g_beta (B, 2, J) =
// [beta_u | beta_a] (summed over b by the caller).
template <typename acc_t>
struct EmGrads {
  acc_t* g_V;
  CapsuleStrides g_V_rows;
  acc_t* g_a;
  acc_t* g_beta;
};

// The per-element start of the backward: the E-step normalisers of iterations 0 .. iters-2, the
// gradients reaching the last M-step's outputs (g_mu = grad_pose, g_var = 0, g_logit through the
// sigmoid of a_out) and zeroed beta gradients. The block's threads, flat loops.
template <typename acc_t>
__device__ __forceinline__ void em_backward_start(const acc_t* st, const acc_t* grad_pose_b,
                                                  const acc_t* grad_a_out_b, const EmDims& dims,
                                                  acc_t* norm, acc_t* g_mu, acc_t* g_var,
                                                  acc_t* g_logit, acc_t* g_beta_u, acc_t* g_beta_a,
                                                  int tid, int nthreads) {
  const int64_t J = dims.J, H = dims.H, JH = J * H, block = dims.stats_block();
  for (int64_t tj = tid; tj < (dims.iters - 1) * J; tj += nthreads) {
    const int64_t t = tj / J, j = tj - t * J;
    const acc_t* st_t = st + t * block;
    norm[tj] = em_e_step_norm(st_t[2 * JH + j], st_t + JH + j * H, H);
  }
  const acc_t* last = st + (dims.iters - 1) * block;
  for (int64_t jh = tid; jh < JH; jh += nthreads) {
    g_mu[jh] = grad_pose_b[jh];
    g_var[jh] = 0;
  }
  for (int64_t j = tid; j < J; j += nthreads) {
    const acc_t s = em_sigmoid(last[2 * JH + j]);
    g_logit[j] = grad_a_out_b[j] * s * (1 - s);
    g_beta_u[j] = 0;
    g_beta_a[j] = 0;
  }
}

// sum_i R_ij a_i over rows [i0, i1), in order.
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ acc_t em_mass_sum(const acc_t* R, const scalar_t* a, int64_t i0,
                                             int64_t i1, int64_t J, int64_t j) {
  acc_t m = 0;
  for (int64_t i = i0; i < i1; ++i) m += R[i * J + j] * static_cast<acc_t>(a[i]);
  return m;
}

// The VJP of E-step t for row i, by a warp: R^{t+1}_ij = softmax_j(L_ij), so
// g_L = R^{t+1} (g_R - <R^{t+1}_i, g_R_i>) overwrites g_R's row, and g_V -= g_L (V - mu) / var.
// mu, var: the statistics of iteration t.
template <typename Source>
__device__ __forceinline__ void warp_em_e_step_vjp_row(EmLanes lanes, const Source& src, int64_t b,
                                                       int64_t i, int64_t J, int64_t H,
                                                       const typename Source::acc_type* mu,
                                                       const typename Source::acc_type* var,
                                                       const typename Source::acc_type* R_next_i,
                                                       typename Source::acc_type* g_R_i,
                                                       typename Source::acc_type* g_V_i, int lane) {
  using acc_t = typename Source::acc_type;
  acc_t weighted = 0;
  for (int64_t j = lane; j < J; j += kWarpSize) weighted += R_next_i[j] * g_R_i[j];
  weighted = warp_sum(weighted);
  if (lanes == EmLanes::column) {
    for (int64_t j = lane; j < J; j += kWarpSize) g_R_i[j] = R_next_i[j] * (g_R_i[j] - weighted);
    __syncwarp();  // the row's g_L complete, read below by every lane of capsule j
    const int64_t JH = J * H;
    const int bits = em_column_bits(H);
    for (int64_t jh = lane; jh < JH; jh += kWarpSize) {
      const acc_t inv_var = 1 / var[jh];
      const acc_t diff = src(b, i, jh) - mu[jh];
      g_V_i[jh] -= g_R_i[jh >> bits] * diff * inv_var;
    }
    return;
  }
  for (int64_t j = lane; j < J; j += kWarpSize) {
    const acc_t g_L = R_next_i[j] * (g_R_i[j] - weighted);
    g_R_i[j] = g_L;
    acc_t* gv = g_V_i + j * H;
    for (int64_t h = 0; h < H; ++h) {
      const acc_t inv_var = 1 / var[j * H + h];
      const acc_t diff = src(b, i, j * H + h) - mu[j * H + h];
      gv[h] -= g_L * diff * inv_var;
    }
  }
}

// The E-step VJP's sums over rows [i0, i1) for column jh (capsule j), from g_L (in g_R): g_mu,
// g_var and, when `first` (h = 0), g_logit through d log sigmoid(logit_j).
template <typename Source>
__device__ __forceinline__ void em_e_step_vjp_sums(
    const Source& src, int64_t b, int64_t i0, int64_t i1, int64_t J, int64_t jh, int64_t j,
    bool first, const typename Source::acc_type* mu, const typename Source::acc_type* var,
    const typename Source::acc_type* logit, const typename Source::acc_type* g_L,
    typename Source::acc_type& gm, typename Source::acc_type& gvar, typename Source::acc_type& gl) {
  using acc_t = typename Source::acc_type;
  const acc_t inv_var = 1 / var[jh], mean = mu[jh];
  const acc_t d_log_sigmoid = 1 - em_sigmoid(logit[j]);  // d log sigmoid(x) / dx
  for (int64_t i = i0; i < i1; ++i) {
    const acc_t g = g_L[i * J + j];
    const acc_t diff = src(b, i, jh) - mean;
    gm += g * diff * inv_var;
    gvar += g * acc_t(0.5) * inv_var * (diff * diff * inv_var - 1);
    if (first) gl += g * d_log_sigmoid;
  }
}

// The VJP of M-step t for capsule j, given m_j = sum_i r_ij:
// logit = lam (beta_a - sum_h (beta_u + ln(var) / 2) m): the beta gradients, g_var += d cost / d
// var, g_mass = d logit / d m, and the eps-term of var0 = var - eps through
// sum_i r (V - mu) = eps mu folded into g_mu.
template <typename acc_t, typename scalar_t>
__device__ __forceinline__ void em_m_step_capsule_vjp(int64_t j, int64_t H, acc_t m, acc_t lam,
                                                      acc_t eps, scalar_t beta_u, const acc_t* mu,
                                                      const acc_t* var, const acc_t* g_logit,
                                                      acc_t* g_mu, acc_t* g_var, acc_t* mass,
                                                      acc_t* g_mass, acc_t* g_beta_u,
                                                      acc_t* g_beta_a) {
  const acc_t g_cost = -lam * g_logit[j];  // the same for every h
  g_beta_a[j] += lam * g_logit[j];
  g_beta_u[j] += g_cost * static_cast<acc_t>(H) * m;
  const acc_t bu = static_cast<acc_t>(beta_u);
  acc_t g_m = 0;
  for (int64_t h = 0; h < H; ++h) {
    g_var[j * H + h] += g_cost * acc_t(0.5) * m / var[j * H + h];
    g_m += g_cost * (bu + acc_t(0.5) * acc_log(var[j * H + h]));
  }
  const acc_t M = m + eps;
  for (int64_t h = 0; h < H; ++h) g_mu[j * H + h] -= g_var[j * H + h] * 2 * eps * mu[j * H + h] / M;
  mass[j] = m;
  g_mass[j] = g_m;
}

// The VJP of M-step t for row i, by a warp: g_V += r (g_mu + 2 g_var (V - mu)) / M,
// g_R = dL/dR^t, g_a += sum_j g_r R. R_i: R^t's row; mu, var: the statistics of iteration t.
template <typename Source, typename scalar_t>
__device__ __forceinline__ void warp_em_m_step_vjp_row(
    EmLanes lanes, const Source& src, int64_t b, int64_t i, int64_t J, int64_t H, scalar_t a_i,
    typename Source::acc_type eps, const typename Source::acc_type* R_i,
    const typename Source::acc_type* mu, const typename Source::acc_type* var,
    const typename Source::acc_type* mass, const typename Source::acc_type* g_mass,
    const typename Source::acc_type* g_mu, const typename Source::acc_type* g_var,
    typename Source::acc_type* g_V_i, typename Source::acc_type* g_R_i,
    typename Source::acc_type* g_a_i, int lane) {
  using acc_t = typename Source::acc_type;
  const acc_t ai = static_cast<acc_t>(a_i);
  acc_t g_ai = 0;
  if (lanes == EmLanes::column) {
    const int64_t JH = J * H;
    const int bits = em_column_bits(H);
    for (int64_t base = 0; base < JH; base += kWarpSize) {
      const int64_t jh = base + lane, j = jh >> bits;
      acc_t g_r_h = 0;  // capsule j's term of g_r from entry h
      if (jh < JH) {
        const acc_t inv_M = 1 / (mass[j] + eps);
        const acc_t diff = src(b, i, jh) - mu[jh];
        g_r_h = (g_mu[jh] * diff + g_var[jh] * (diff * diff - (var[jh] - eps))) * inv_M;
        g_V_i[jh] += R_i[j] * ai * (g_mu[jh] + 2 * g_var[jh] * diff) * inv_M;
      }
      const acc_t g_r_sum = lane_group_sum(g_r_h, static_cast<int>(H));
      if (jh < JH && jh == j << bits) {
        const acc_t g_r = g_mass[j] + g_r_sum;
        g_R_i[j] = g_r * ai;
        g_ai += g_r * R_i[j];
      }
    }
  } else {
    for (int64_t j = lane; j < J; j += kWarpSize) {
      const acc_t M = mass[j] + eps;
      const acc_t r = R_i[j] * ai;
      acc_t* gv = g_V_i + j * H;
      acc_t g_r = g_mass[j];
      for (int64_t h = 0; h < H; ++h) {
        const int64_t jh = j * H + h;
        const acc_t diff = src(b, i, jh) - mu[jh];
        const acc_t var0 = var[jh] - eps;
        g_r += (g_mu[jh] * diff + g_var[jh] * (diff * diff - var0)) / M;
        gv[h] += r * (g_mu[jh] + 2 * g_var[jh] * diff) / M;
      }
      g_R_i[j] = g_r * ai;
      g_ai += g_r * R_i[j];
    }
  }
  g_ai = warp_sum(g_ai);
  if (lane == 0) *g_a_i += g_ai;
}

// The backward (EmBackward::run of csrc/cpu/em_element.h), each element's rows cut as in the
// forward:
//   em_backward_start_kernel       per element: em_backward_start;
//   em_backward_rows_start_kernel  per range: zeroed g_V and g_a rows, R^t of the range's rows for
//                                  every t, and the range's sums of R^t a (partial_mass);
// then for t = iters - 1 .. 0:
//   em_backward_capsule_kernel     per element: (t < iters - 1) g_mu, g_var and g_logit from the
//                                  ranges' sums in range order; the M-step VJP of the capsules;
//   em_backward_rows_kernel        per range: the M-step VJP of the rows, then (t > 0) the VJP
//                                  of E-step t - 1 on the same rows (with a lane per entry, row
//                                  by row after the M-step's), and its sums (partial_cols).
template <typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    em_backward_start_kernel(const acc_t* stats, const acc_t* grad_pose, const acc_t* grad_a_out,
                             const EmDims dims, const EmBackwardWorkspace<acc_t> ws,
                             const EmGrads<acc_t> out) {
  const int64_t J = dims.J, JH = J * dims.H;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x)
    em_backward_start(stats + b * dims.iters * dims.stats_block(), grad_pose + b * JH,
                      grad_a_out + b * J, dims, ws.norm + b * dims.iters * J, ws.g_mu + b * JH,
                      ws.g_var + b * JH, ws.g_logit + b * J, out.g_beta + b * 2 * J,
                      out.g_beta + b * 2 * J + J, threadIdx.x, blockDim.x);
}

template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, em_min_blocks<typename Source::acc_type>())
    em_backward_rows_start_kernel(const Source src, const scalar_t* a_in,
                                  const typename Source::acc_type* stats, const EmDims dims,
                                  int64_t splits, EmLanes lanes,
                                  const EmBackwardWorkspace<typename Source::acc_type> ws,
                                  const EmGrads<typename Source::acc_type> out) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H, IJ = I * J, iters = dims.iters;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;
  for_each_row_range(dims.B, I, splits, [&](int64_t b, int64_t item, RowRange rows) {
    const int64_t i0 = rows.begin, i1 = rows.end;
    const acc_t* st = stats + b * iters * dims.stats_block();
    acc_t* R_hist = ws.R_hist + b * iters * IJ;
    for (int64_t i = i0 + tid; i < i1; i += nthreads) out.g_a[b * I + i] = 0;
    for (int64_t ij = i0 * J + tid; ij < i1 * J; ij += nthreads) R_hist[ij] = acc_t(1) / acc_t(J);
    for (int64_t i = i0 + warp; i < i1; i += nwarps) {
      acc_t* g_V_i = out.g_V + out.g_V_rows.offset(b, i);
      for (int64_t jh = lane; jh < JH; jh += kWarpSize) g_V_i[jh] = 0;
      for (int64_t t = 0; t + 1 < iters; ++t) {
        const acc_t* mu = st + t * dims.stats_block();
        warp_em_e_step_row(lanes, src, b, i, J, H, mu, mu + JH, ws.norm + (b * iters + t) * J,
                           R_hist + ((t + 1) * I + i) * J, lane);
      }
    }
    __syncthreads();  // the range's R^t complete
    for (int64_t tj = tid; tj < iters * J; tj += nthreads) {
      const int64_t t = tj / J, j = tj - t * J;
      ws.partial_mass[item * iters * J + tj] =
          em_mass_sum(R_hist + t * IJ, a_in + b * I, i0, i1, J, j);
    }
  });
}

// (The 2-block hint: unhinted, ptxas put it at 64 registers on sm_80 and spilled.)
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads, em_min_blocks<acc_t>())
    em_backward_capsule_kernel(const scalar_t* beta_u, const acc_t* stats, const EmDims dims,
                               int64_t splits, int64_t t, const acc_t eps,
                               const EmBackwardWorkspace<acc_t> ws, const EmGrads<acc_t> out) {
  const int64_t J = dims.J, H = dims.H, JH = J * H, iters = dims.iters, cols = 2 * JH + J;
  const int tid = threadIdx.x, nthreads = blockDim.x;
  for (int64_t b = blockIdx.x; b < dims.B; b += gridDim.x) {
    const acc_t* mu = stats + (b * iters + t) * dims.stats_block();
    acc_t* g_mu = ws.g_mu + b * JH;
    acc_t* g_var = ws.g_var + b * JH;
    acc_t* g_logit = ws.g_logit + b * J;
    if (t < iters - 1) {
      const acc_t* part =
          ws.partial_cols + b * splits * cols;  // g_mu (JH) | g_var (JH) | g_logit (J)
      for (int64_t jh = tid; jh < JH; jh += nthreads) {
        acc_t gm = 0, gvar = 0;
        for (int64_t s = 0; s < splits; ++s) {
          gm += part[s * cols + jh];
          gvar += part[s * cols + JH + jh];
        }
        g_mu[jh] = gm;
        g_var[jh] = gvar;
      }
      for (int64_t j = tid; j < J; j += nthreads) {
        acc_t gl = 0;
        for (int64_t s = 0; s < splits; ++s) gl += part[s * cols + 2 * JH + j];
        g_logit[j] = gl;
      }
      __syncthreads();  // g_mu, g_var, g_logit complete
    }
    const acc_t lam = static_cast<acc_t>(em_lambda(dims.final_lambda, t));
    for (int64_t j = tid; j < J; j += nthreads) {
      acc_t m = 0;
      for (int64_t s = 0; s < splits; ++s)
        m += ws.partial_mass[((b * splits + s) * iters + t) * J + j];
      em_m_step_capsule_vjp(j, H, m, lam, eps, beta_u[j], mu, mu + JH, g_logit, g_mu, g_var,
                            ws.mass + b * J, ws.g_mass + b * J, out.g_beta + b * 2 * J,
                            out.g_beta + b * 2 * J + J);
    }
    __syncthreads();  // end of element
  }
}

template <typename Source, typename scalar_t>
__global__ void __launch_bounds__(kBlockThreads, em_min_blocks<typename Source::acc_type>())
    em_backward_rows_kernel(const Source src, const scalar_t* a_in,
                            const typename Source::acc_type* stats, const EmDims dims,
                            int64_t splits, EmLanes lanes, int64_t t,
                            const typename Source::acc_type eps,
                            const EmBackwardWorkspace<typename Source::acc_type> ws,
                            const EmGrads<typename Source::acc_type> out) {
  using acc_t = typename Source::acc_type;
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H, IJ = I * J, iters = dims.iters;
  const int64_t block = dims.stats_block(), cols = 2 * JH + J;
  const int tid = threadIdx.x, lane = tid % kWarpSize, warp = tid / kWarpSize;
  const int nthreads = blockDim.x, nwarps = nthreads / kWarpSize;
  for_each_row_range(dims.B, I, splits, [&](int64_t b, int64_t item, RowRange rows) {
    const int64_t i0 = rows.begin, i1 = rows.end;
    const acc_t* st = stats + b * iters * block;
    const acc_t* R_hist = ws.R_hist + b * iters * IJ;
    acc_t* g_R = ws.g_R + b * IJ;
    const acc_t* mu = st + t * block;
    const acc_t* prev = t > 0 ? st + (t - 1) * block : nullptr;  // what E-step t - 1 used
    // Both VJPs of a row are the row's own work. With a lane per entry a warp takes them one
    // after the other on each row, whose votes and vote gradient it then finds in cache; with a
    // lane per capsule (as measured on the H100) the range's rows pass by twice.
    const bool row_by_row = lanes == EmLanes::column && t > 0;
    for (int64_t i = i0 + warp; i < i1; i += nwarps) {
      acc_t* g_V_i = out.g_V + out.g_V_rows.offset(b, i);
      warp_em_m_step_vjp_row(lanes, src, b, i, J, H, a_in[b * I + i], eps, R_hist + (t * I + i) * J,
                             mu, mu + JH, ws.mass + b * J, ws.g_mass + b * J, ws.g_mu + b * JH,
                             ws.g_var + b * JH, g_V_i, g_R + i * J, out.g_a + b * I + i, lane);
      if (row_by_row) {
        __syncwarp();  // the row's g_R, written by its capsules' first lanes
        warp_em_e_step_vjp_row(lanes, src, b, i, J, H, prev, prev + JH, R_hist + (t * I + i) * J,
                               g_R + i * J, g_V_i, lane);
      }
    }
    if (t > 0) {
      if (!row_by_row) {
        __syncthreads();  // the range's g_R = dL/dR^t complete
        for (int64_t i = i0 + warp; i < i1; i += nwarps)
          warp_em_e_step_vjp_row(lanes, src, b, i, J, H, prev, prev + JH, R_hist + (t * I + i) * J,
                                 g_R + i * J, out.g_V + out.g_V_rows.offset(b, i), lane);
      }
      __syncthreads();  // the range's g_L complete
      acc_t* part = ws.partial_cols + item * cols;
      for (int64_t jh = tid; jh < JH; jh += nthreads) {
        const int64_t j = jh / H;
        const bool first = jh == j * H;
        acc_t gm = 0, gvar = 0, gl = 0;
        em_e_step_vjp_sums(src, b, i0, i1, J, jh, j, first, prev, prev + JH, prev + 2 * JH, g_R, gm,
                           gvar, gl);
        part[jh] = gm;
        part[JH + jh] = gvar;
        if (first) part[2 * JH + j] = gl;
      }
    }
  });
}

// ---- em_routing_pose: contracting the vote gradient with the pose and the weight ----
//
// V_ij = P_i W_ij (4x4), so with G = g_V_ij (the em backward's vote gradient, (B, I, J, 16) in
// the accumulation dtype): g_P_i = sum_j G W_ij^T and g_W_ij = sum_b P_i^T G.

// grad_pose[b, i, r, k] = sum_j sum_c G[b, i, j, r, c] W[i, j, k, c], j then c in order (the
// CPU's order); thread per (b, i, r, k) over B elements (a chunk: g_V and grad_pose offset),
// grad_pose at grad_strides (as PoseVotes reads pose).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    pose_grad_pose_kernel(const acc_t* g_V, const scalar_t* weight, int64_t B, int64_t I, int64_t J,
                          const CapsuleStrides grad_strides, scalar_t* grad_pose) {
  const int64_t n = B * I * kPoseSize;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t bi = idx / kPoseSize, rk = idx - bi * kPoseSize, r = rk / 4, k = rk - r * 4;
    const int64_t b = bi / I, i = bi - b * I;
    const acc_t* G = g_V + bi * J * kPoseSize + r * 4;       // row r of G_ij, j = 0
    const scalar_t* W = weight + i * J * kPoseSize + k * 4;  // row k of W_ij, j = 0
    acc_t sum = 0;
    for (int64_t j = 0; j < J; ++j) {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        sum += G[j * kPoseSize + c] * static_cast<acc_t>(W[j * kPoseSize + c]);
    }
    grad_pose[grad_strides.offset(b, i) + rk] = static_cast<scalar_t>(sum);
  }
}

// g_W[i, j, k, c] = (accumulate ? g_W[i, j, k, c] : 0) + sum_b sum_r P[b, i, r, k] G[b, i, j, r,
// c], b then r in order; thread per (i, j, k, c). Called chunk after chunk of the batch with
// accumulate set after the first, it adds the elements one by one in batch order into one
// running sum in the accumulation dtype: the result does not depend on the chunking. pose at
// pose_strides (PoseVotes).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    pose_grad_weight_kernel(const acc_t* g_V, const scalar_t* pose,
                            const CapsuleStrides pose_strides, int64_t B, int64_t I, int64_t J,
                            bool accumulate, acc_t* g_W) {
  const int64_t n = I * J * kPoseSize;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t ij = idx / kPoseSize, kc = idx - ij * kPoseSize, k = kc / 4, c = kc - k * 4;
    const int64_t i = ij / J;
    acc_t sum = accumulate ? g_W[idx] : acc_t(0);
    for (int64_t b = 0; b < B; ++b) {
      const scalar_t* P = pose + pose_strides.offset(b, i) + k;  // column k of P_i
      const acc_t* G = g_V + (b * I * J + ij) * kPoseSize + c;   // column c of G_ij
#pragma unroll
      for (int r = 0; r < 4; ++r) sum += static_cast<acc_t>(P[r * 4]) * G[r * 4];
    }
    g_W[idx] = sum;
  }
}

}  // namespace cuda
}  // namespace capsroute
