// The per-pass math of the routing kernels under a RoutingRule (csrc/common/agreement_rules.h): a
// row's couplings by a warp, and a capsule's output v = f(s) and its vector-Jacobian product by a
// warp (lanes split d), and of a pass's J capsules by a block (warp per capsule), with the gradient
// items of the rule's parameters. The block kernels (agreement_block_kernels.cuh) run every rule;
// the warp-rows and cluster kernels only dynamic routing's (squash, no coupling bias), through
// block_squash and block_squash_vjp. Device code only.
#pragma once

#include <cstdint>

#include "../common/acc_math.h"
#include "../common/agreement_rules.h"
#include "../common/dims.h"
#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Coupling of one input row: c = softmax over the J logits (with an extra zero logit when
// leaky, its share dropped), as softmax_lanes in csrc/cpu/vec_math.h. Called by a whole warp; lane
// l reads logits[j] and writes c[j] for j = l, l + 32, ... only.
template <typename acc_t>
__device__ __forceinline__ void warp_coupling_row(const acc_t* logits, int64_t J, bool leaky,
                                                  acc_t* c, int lane) {
  acc_t max_logit = leaky ? acc_t(0) : neg_infinity(acc_t(0));
  for (int64_t j = lane; j < J; j += kWarpSize)
    max_logit = logits[j] > max_logit ? logits[j] : max_logit;
  max_logit = warp_max(max_logit);
  acc_t denom = 0;
  for (int64_t j = lane; j < J; j += kWarpSize) denom += acc_exp(logits[j] - max_logit);
  denom = warp_sum(denom);
  if (leaky) denom += acc_exp(-max_logit);
  const acc_t inv_denom = acc_t(1) / denom;
  for (int64_t j = lane; j < J; j += kWarpSize) c[j] = acc_exp(logits[j] - max_logit) * inv_denom;
}

// layer_norm's mean and 1 / std over a capsule's D values (biased variance, two passes over s);
// inv_D = 1 / D. (Means as sums times inv_D: a division per mean made ptxas spill.)
template <typename acc_t>
struct CapsuleMoments {
  acc_t mean, inv_std;
};
template <typename acc_t>
__device__ __forceinline__ CapsuleMoments<acc_t> warp_capsule_moments(const acc_t* s, int64_t D,
                                                                      acc_t inv_D, acc_t eps,
                                                                      int lane) {
  acc_t sum = 0;
  for (int64_t d = lane; d < D; d += kWarpSize) sum += s[d];
  const acc_t mean = warp_sum(sum) * inv_D;
  acc_t sq = 0;
  for (int64_t d = lane; d < D; d += kWarpSize) sq += (s[d] - mean) * (s[d] - mean);
  return {mean, layer_norm_inv_std(warp_sum(sq) * inv_D, eps)};
}

// v = f(s) of one capsule (D values); norm_weight, norm_bias: layer_norm's affine parameters (D,)
// or null.
template <typename acc_t>
__device__ __forceinline__ void warp_capsule_output(Nonlinearity f, const acc_t* norm_weight,
                                                    const acc_t* norm_bias, const acc_t* s,
                                                    int64_t D, acc_t eps, acc_t* v, int lane) {
  if (f == Nonlinearity::layer_norm) {
    const CapsuleMoments<acc_t> m = warp_capsule_moments(s, D, acc_t(1) / acc_t(D), eps, lane);
    for (int64_t d = lane; d < D; d += kWarpSize) {
      acc_t x = (s[d] - m.mean) * m.inv_std;
      if (norm_weight != nullptr) x *= norm_weight[d];
      if (norm_bias != nullptr) x += norm_bias[d];
      v[d] = x;
    }
    return;
  }
  acc_t q = 0;
  for (int64_t d = lane; d < D; d += kWarpSize) q += s[d] * s[d];
  const acc_t scale = radial_scale(f, warp_sum(q), eps);
  for (int64_t d = lane; d < D; d += kWarpSize) v[d] = scale * s[d];
}

// gs = f's VJP at s of gv for one capsule. layer_norm also adds its affine parameters' gradient
// items, g_v xhat to grad_weight[d] and g_v to grad_bias[d], where given.
template <typename acc_t>
__device__ __forceinline__ void warp_capsule_vjp(Nonlinearity f, const acc_t* norm_weight,
                                                 const acc_t* s, const acc_t* gv, int64_t D,
                                                 acc_t eps, acc_t* gs, int lane, acc_t* grad_weight,
                                                 acc_t* grad_bias) {
  if (f == Nonlinearity::layer_norm) {
    const acc_t inv_D = acc_t(1) / acc_t(D);
    const CapsuleMoments<acc_t> m = warp_capsule_moments(s, D, inv_D, eps, lane);
    const acc_t* w = norm_weight;
    acc_t gx_sum = 0, gx_xhat_sum = 0;
    for (int64_t d = lane; d < D; d += kWarpSize) {
      const acc_t gx = w != nullptr ? w[d] * gv[d] : gv[d];
      gx_sum += gx;
      gx_xhat_sum += gx * (s[d] - m.mean) * m.inv_std;
    }
    const acc_t gx_mean = warp_sum(gx_sum) * inv_D, gx_xhat_mean = warp_sum(gx_xhat_sum) * inv_D;
    for (int64_t d = lane; d < D; d += kWarpSize) {
      const acc_t xhat = (s[d] - m.mean) * m.inv_std;
      const acc_t gx = w != nullptr ? w[d] * gv[d] : gv[d];
      gs[d] = m.inv_std * (gx - gx_mean - xhat * gx_xhat_mean);
      if (grad_weight != nullptr) grad_weight[d] += gv[d] * xhat;
      if (grad_bias != nullptr) grad_bias[d] += gv[d];
    }
    return;
  }
  acc_t q = 0, sg = 0;
  for (int64_t d = lane; d < D; d += kWarpSize) {
    q += s[d] * s[d];
    sg += s[d] * gv[d];
  }
  q = warp_sum(q);
  sg = warp_sum(sg);
  const SquashVjp<acc_t> coeffs = radial_vjp_coeffs(f, q, eps);
  const acc_t radial = coeffs.radial * sg;
  for (int64_t d = lane; d < D; d += kWarpSize) gs[d] = coeffs.scale * gv[d] + radial * s[d];
}

// v = squash(s) for the J capsules of one (J, D) slab; warp per capsule. v_stride: values from
// one capsule of v to the next (D, or more for a padded layout in shared memory).
template <typename acc_t>
__device__ __forceinline__ void block_squash(const acc_t* s, int64_t J, int64_t D, acc_t eps,
                                             acc_t* v, int warp, int nwarps, int lane,
                                             int64_t v_stride) {
  for (int64_t j = warp; j < J; j += nwarps)
    warp_capsule_output(Nonlinearity::squash, static_cast<const acc_t*>(nullptr),
                        static_cast<const acc_t*>(nullptr), s + j * D, D, eps, v + j * v_stride,
                        lane);
}

// gs = squash_vjp(s, gv) for the J capsules of one element (warp per capsule); gs_stride as
// block_squash's v_stride.
template <typename acc_t>
__device__ __forceinline__ void block_squash_vjp(const acc_t* s, const acc_t* gv, int64_t J,
                                                 int64_t D, acc_t eps, acc_t* gs,
                                                 int64_t gs_stride) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize,
            nwarps = blockDim.x / kWarpSize;
  for (int64_t j = warp; j < J; j += nwarps)
    warp_capsule_vjp(Nonlinearity::squash, static_cast<const acc_t*>(nullptr), s + j * D,
                     gv + j * D, D, eps, gs + j * gs_stride, lane, static_cast<acc_t*>(nullptr),
                     static_cast<acc_t*>(nullptr));
}

// The gradient items of a rule's parameters (null where absent), zeroed by the host, which sums
// them over the batch (and the capsules) in a fixed order:
//   coupling_bias (B, I, J): sum over passes r > 0 of gc^r_ij = <gs^r_j, u_ij>
//   norm_weight, norm_bias (B, J, D): sum over passes of g_v^r xhat^r and g_v^r (layer_norm)
template <typename acc_t>
struct RuleGradItems {
  acc_t* coupling_bias = nullptr;
  acc_t* norm_weight = nullptr;
  acc_t* norm_bias = nullptr;
};

// v^r = f_r(s^r) for passes r = r0 .. r0 + passes - 1 of `iters` under a rule of these logits
// and nonlinearity (RoutingRule::pass_nonlinearity) with layer_norm's affine parameters (null
// where absent), s and v their (J, D) slabs from pass r0 on (warp per capsule). Called, not
// inlined, by the kernels that run every rule: inlined in their loops, the nonlinearities'
// divisions and square roots made ptxas spill (and so did the whole rule as an argument).
template <typename acc_t>
__device__ __noinline__ void block_pass_outputs(LogitRule logits, Nonlinearity nonlinearity,
                                                const acc_t* norm_weight, const acc_t* norm_bias,
                                                int64_t r0, int64_t passes, int64_t iters,
                                                const acc_t* s, int64_t J, int64_t D, acc_t eps,
                                                acc_t* v) {
  RoutingRule<acc_t> rule;
  rule.logits = logits;
  rule.nonlinearity = nonlinearity;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t k = 0; k < passes; ++k) {
    const Nonlinearity f = rule.pass_nonlinearity(r0 + k, iters);
    for (int64_t j = threadIdx.x / kWarpSize; j < J; j += blockDim.x / kWarpSize) {
      const int64_t jd = (k * J + j) * D;
      warp_capsule_output(f, norm_weight, norm_bias, s + jd, D, eps, v + jd, lane);
    }
  }
}

// gs = f's VJP at s of gv for the J capsules of a pass (warp per capsule; called as
// block_pass_outputs), adding layer_norm's parameter gradient items, (J, D) from grad_weight +
// item and grad_bias + item, where given.
template <typename acc_t>
__device__ __noinline__ void block_pass_vjp(Nonlinearity f, const acc_t* norm_weight,
                                            const acc_t* s, const acc_t* gv, int64_t J, int64_t D,
                                            acc_t eps, acc_t* gs, acc_t* grad_weight,
                                            acc_t* grad_bias, int64_t item) {
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t j = threadIdx.x / kWarpSize; j < J; j += blockDim.x / kWarpSize) {
    const int64_t jd = j * D;
    warp_capsule_vjp(f, norm_weight, s + jd, gv + jd, D, eps, gs + jd, lane,
                     grad_weight != nullptr ? grad_weight + item + jd : nullptr,
                     grad_bias != nullptr ? grad_bias + item + jd : nullptr);
  }
}

}  // namespace cuda
}  // namespace capsroute
