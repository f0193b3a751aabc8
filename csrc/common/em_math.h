// Math of EM routing (docs/ops.md, em_routing) shared by the CPU and CUDA backends: plain
// arithmetic on the accumulation type (float for float/half/bfloat16 storage, double for double),
// so that both backends compute the same thing.
#pragma once

#include <cmath>
#include <cstdint>

#include "acc_math.h"

namespace capsroute {

CAPSROUTE_HD float acc_log(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}
CAPSROUTE_HD double acc_log(double x) {
#if defined(__CUDA_ARCH__)
  return ::log(x);
#else
  return std::log(x);
#endif
}
CAPSROUTE_HD float acc_log1p(float x) {
#if defined(__CUDA_ARCH__)
  return log1pf(x);
#else
  return std::log1p(x);
#endif
}
CAPSROUTE_HD double acc_log1p(double x) {
#if defined(__CUDA_ARCH__)
  return ::log1p(x);
#else
  return std::log1p(x);
#endif
}

// ln(2 pi) / 2, the constant of each Gaussian factor of ln p_ij.
template <typename T>
CAPSROUTE_HD T em_half_log_2pi() {
  return T(0.9189385332046727);
}

// sigmoid and log sigmoid, each branch free of overflow.
template <typename T>
CAPSROUTE_HD T em_sigmoid(T x) {
  return x >= 0 ? T(1) / (T(1) + acc_exp(-x)) : acc_exp(x) / (T(1) + acc_exp(x));
}

template <typename T>
CAPSROUTE_HD T em_log_sigmoid(T x) {
  return x >= 0 ? -acc_log1p(acc_exp(-x)) : x - acc_log1p(acc_exp(x));
}

// The part of the E-step's log-posterior ln a_j + ln p_ij of output capsule j that does not depend
// on the vote: ln sigmoid(logit_j) - sum_h (ln(var_jh) / 2 + ln(2 pi) / 2).
template <typename T>
CAPSROUTE_HD T em_log_prior(T logit, const T* var, int64_t H) {
  T norm = em_log_sigmoid(logit);
  for (int64_t h = 0; h < H; ++h) norm -= T(0.5) * acc_log(var[h]) + em_half_log_2pi<T>();
  return norm;
}

// The activation logit of an output capsule after its M-step: lam (beta_a - cost) with
// cost = sum_h (beta_u + ln(var_h) / 2) mass.
template <typename acc_t>
CAPSROUTE_HD acc_t em_activation_logit(acc_t lam, acc_t beta_u, acc_t beta_a, acc_t mass,
                                       const acc_t* var, int64_t H) {
  acc_t cost = 0;
  for (int64_t h = 0; h < H; ++h) cost += (beta_u + acc_t(0.5) * acc_log(var[h])) * mass;
  return lam * (beta_a - cost);
}

// The M-step's backward for one output capsule (docs/ops.md, em_routing; M = mass + eps,
// var0 = var - eps): from the gradients of its H means and variances (g_mu, g_var, updated in
// place) and of its logit, adds its betas' gradients and writes g_mu_M = g_mu / M and
// g_var_M = g_var / M. Returns g_mass; an input row i with r_i = R_i a_i then has
// g_r_i = g_mass + sum_h g_mu_M (V_h - mu_h) + g_var_M ((V_h - mu_h)^2 - var0_h) and
// g_V_ih += r_i (g_mu_M_h + 2 g_var_M_h (V_h - mu_h)).
template <typename acc_t>
CAPSROUTE_HD acc_t em_m_step_backward(int64_t H, acc_t lam, acc_t eps, acc_t beta_u, acc_t mass,
                                      const acc_t* mu, const acc_t* var, acc_t g_logit, acc_t* g_mu,
                                      acc_t* g_var, acc_t* g_mu_M, acc_t* g_var_M, acc_t& g_beta_u,
                                      acc_t& g_beta_a) {
  const acc_t g_cost = -lam * g_logit;  // the same for every h
  g_beta_a += lam * g_logit;
  g_beta_u += g_cost * static_cast<acc_t>(H) * mass;
  acc_t g_mass = 0;
  for (int64_t h = 0; h < H; ++h) {
    g_var[h] += g_cost * acc_t(0.5) * mass / var[h];
    g_mass += g_cost * (beta_u + acc_t(0.5) * acc_log(var[h]));
  }
  // var0 = var - eps also depends on mu through sum_i r (V - mu) = eps mu: fold that into g_mu.
  const acc_t M = mass + eps;
  for (int64_t h = 0; h < H; ++h) g_mu[h] -= g_var[h] * 2 * eps * mu[h] / M;
  // The loops over input rows take g_mu / M and g_var / M, divided once here.
  const acc_t inv_M = 1 / M;
  for (int64_t h = 0; h < H; ++h) {
    g_mu_M[h] = g_mu[h] * inv_M;
    g_var_M[h] = g_var[h] * inv_M;
  }
  return g_mass;
}

// Inverse temperature of iteration t (0-based): lam_t = final_lambda * (1 - 0.95^(t + 1)), in
// double whatever the accumulation type (callers cast it, as the CPU does). The power is a
// product of t + 1 factors, not pow(): IEEE multiplications round the same on the host and the
// GPU (both backends get the bitwise same schedule), and a device pow() is an out-of-line call
// that made the EM kernels spill registers around it.
CAPSROUTE_HD double em_lambda(double final_lambda, int64_t t) {
  double decay = 1.0;
  for (int64_t k = 0; k <= t; ++k) decay *= 0.95;
  return final_lambda * (1.0 - decay);
}

}  // namespace capsroute
