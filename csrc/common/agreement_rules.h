// The rules that tell the agreement routings apart (docs/ops.md, "The agreement routings"): how
// the logits of pass r + 1 come from the output of pass r, the nonlinearity that makes each
// pass's output, and the coupling bias. dynamic_routing, self_attention_routing and
// inverted_attention_routing run the same loop under different rules; the math here is shared by
// the CPU and CUDA kernels. Free of torch headers (the CUDA emulator compiles it on the host).
#pragma once

#include <cstdint>

#include "acc_math.h"

namespace capsroute {

enum class LogitRule : int8_t {
  accumulate,  // b^{r+1} = b^r + <u_ij, v^r_j>        (dynamic_routing)
  replace,     // b^{r+1} = scale <u_ij, v^r_j>         (inverted_attention_routing)
  // b^1 = scale <u_ij, s^0_j>, s^0 the uniformly coupled sum of pass 0 taken as it is, without
  // the nonlinearity: the agreement of each vote with the mean vote (self_attention_routing).
  agree_with_mean,
};

// The output of a pass, v = f(s) per output capsule. The first three are radial:
// v = scale(|s|^2) s.
enum class Nonlinearity : int8_t {
  identity,
  squash,      // Sabour et al.: |s|^2 / (1 + |s|^2) s / sqrt(|s|^2 + eps)
  squash_exp,  // Efficient-CapsNet: (1 - exp(-n)) s / n, n = sqrt(|s|^2 + eps)
  layer_norm,  // (s - mean(s)) / sqrt(var(s) + eps) * weight + bias, over the capsule's D values
};

// A routing's rule. Tensors in the accumulation type; a null pointer is an absent parameter.
template <typename acc_t>
struct RoutingRule {
  LogitRule logits = LogitRule::accumulate;
  Nonlinearity nonlinearity = Nonlinearity::squash;
  acc_t logit_scale = acc_t(1);          // unused by accumulate
  const acc_t* coupling_bias = nullptr;  // (I, J), added to the softmax of every pass r > 0
  const acc_t* norm_weight = nullptr;    // (D,), layer_norm's affine weight (absent: 1)
  const acc_t* norm_bias = nullptr;      // (D,), layer_norm's affine bias (absent: 0)

  // The nonlinearity of pass r of `iters`: agree_with_mean takes s^0 as it is.
  CAPSROUTE_HD Nonlinearity pass_nonlinearity(int64_t r, int64_t iters) const {
    return logits == LogitRule::agree_with_mean && r < iters - 1 ? Nonlinearity::identity
                                                                 : nonlinearity;
  }
  // The logit b^{r+1}_ij of the pass after r, from b^r_ij and the agreement <u_ij, v^r_j>.
  CAPSROUTE_HD acc_t next_logit(acc_t logit, acc_t agreement) const {
    return logits == LogitRule::accumulate ? logit + agreement : logit_scale * agreement;
  }
  // In the backward: dL/db^r carries into dL/db^{r-1} only where the logits accumulate.
  CAPSROUTE_HD bool carries_logit_gradient() const { return logits == LogitRule::accumulate; }
};

// self_attention_routing as a rule of kSelfAttentionPasses passes: pass 0 couples uniformly and
// keeps s^0 = sum_k u_kj / J as it is, so pass 1's logits scale <u_ij, s^0> = <u_ij, sum_k u_kj> /
// sqrt(D) with scale = J / sqrt(D). squash: Nonlinearity::squash_exp ("efficient") or squash.
constexpr int64_t kSelfAttentionPasses = 2;

template <typename acc_t>
CAPSROUTE_HD RoutingRule<acc_t> self_attention_rule(int64_t J, int64_t D, Nonlinearity squash,
                                                    const acc_t* coupling_bias) {
  RoutingRule<acc_t> rule;
  rule.logits = LogitRule::agree_with_mean;
  rule.nonlinearity = squash;
  rule.logit_scale = acc_t(J) / acc_sqrt(acc_t(D));
  rule.coupling_bias = coupling_bias;
  return rule;
}

// inverted_attention_routing: the logits of pass r > 0 are <u_ij, v^{r-1}_j> / sqrt(D), replaced,
// and every pass's output is a LayerNorm of s.
template <typename acc_t>
CAPSROUTE_HD RoutingRule<acc_t> inverted_attention_rule(int64_t D, const acc_t* norm_weight,
                                                        const acc_t* norm_bias) {
  RoutingRule<acc_t> rule;
  rule.logits = LogitRule::replace;
  rule.nonlinearity = Nonlinearity::layer_norm;
  rule.logit_scale = acc_t(1) / acc_sqrt(acc_t(D));
  rule.norm_weight = norm_weight;
  rule.norm_bias = norm_bias;
  return rule;
}

// Efficient-CapsNet's squash: v = squash_exp_scale(q) s with q = |s|^2, n = sqrt(q + eps). Smooth
// at s = 0, where the scale is (1 - e^-n) / n at n = sqrt(eps), and its limit 1 for eps == 0 (the
// formula would read 0/0): v's Jacobian there is that scale times the identity. expm1: 1 - e^-n
// loses every digit to cancellation as n goes to 0.
template <typename T>
CAPSROUTE_HD T squash_exp_scale(T q, T eps) {
  const T n = acc_sqrt(q + eps);
  return n == T(0) ? T(1) : -acc_expm1(-n) / n;
}

// Its vector-Jacobian product in SquashVjp form: g_s = scale g_v + radial <s, g_v> s, where
// radial = 2 d scale / dq = (n e^-n - (1 - e^-n)) / n^3, finite wherever n > 0; at s = 0 the radial
// term vanishes (0 for eps == 0, where radial diverges as -1 / (2n) but <s, g_v> s as n^2).
template <typename T>
CAPSROUTE_HD SquashVjp<T> squash_exp_vjp_coeffs(T q, T eps) {
  const T scale = squash_exp_scale(q, eps);
  if (q == T(0)) return {scale, T(0)};
  const T n = acc_sqrt(q + eps);
  return {scale, (acc_exp(-n) - scale) / (n * n)};
}

template <typename T>
CAPSROUTE_HD T radial_scale(Nonlinearity f, T q, T eps) {
  if (f == Nonlinearity::squash) return squash_scale(q, eps);
  if (f == Nonlinearity::squash_exp) return squash_exp_scale(q, eps);
  return T(1);
}
template <typename T>
CAPSROUTE_HD SquashVjp<T> radial_vjp_coeffs(Nonlinearity f, T q, T eps) {
  if (f == Nonlinearity::squash) return squash_vjp_coeffs(q, eps);
  if (f == Nonlinearity::squash_exp) return squash_exp_vjp_coeffs(q, eps);
  return {T(1), T(0)};
}

// layer_norm of a capsule from its mean and (biased) variance over D: v_d = xhat_d w_d + b_d,
// xhat_d = (s_d - mean) inv_std. Its VJP, with gx_d = w_d g_v_d:
//   g_s_d = inv_std (gx_d - mean(gx) - xhat_d mean(gx xhat)),
//   g_w_d += g_v_d xhat_d,  g_b_d += g_v_d.
template <typename T>
CAPSROUTE_HD T layer_norm_inv_std(T var, T eps) {
  return T(1) / acc_sqrt(var + eps);
}

}  // namespace capsroute
