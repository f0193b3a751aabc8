// Math of EM routing (docs/ops.md, em_routing) shared by the CPU and CUDA backends: plain arithmetic on
// the accumulation type (float for float/half/bfloat16 storage, double for double), so that
// both backends compute the same thing.
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
