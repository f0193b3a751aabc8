// Math shared by the CPU and CUDA backends. Everything here is plain arithmetic on the
// accumulation type (float for float/half/bfloat16 storage, double for double).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CAPSROUTE_HD __host__ __device__ __forceinline__
#else
#define CAPSROUTE_HD inline
#endif

namespace capsroute {

CAPSROUTE_HD float acc_sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}
CAPSROUTE_HD double acc_sqrt(double x) {
#if defined(__CUDA_ARCH__)
  return ::sqrt(x);
#else
  return std::sqrt(x);
#endif
}
CAPSROUTE_HD float acc_exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}
CAPSROUTE_HD double acc_exp(double x) {
#if defined(__CUDA_ARCH__)
  return ::exp(x);
#else
  return std::exp(x);
#endif
}
CAPSROUTE_HD float acc_expm1(float x) {
#if defined(__CUDA_ARCH__)
  return expm1f(x);
#else
  return std::expm1(x);
#endif
}
CAPSROUTE_HD double acc_expm1(double x) {
#if defined(__CUDA_ARCH__)
  return ::expm1(x);
#else
  return std::expm1(x);
#endif
}

// squash(s) = scale(q) * s with q = |s|^2 and scale(q) = q / ((1 + q) sqrt(q + eps)).
// q == 0 gives 0 even for eps == 0, where the formula would read 0/0.
template <typename T>
CAPSROUTE_HD T squash_scale(T q, T eps) {
  if (q == T(0)) return T(0);
  return q / ((T(1) + q) * acc_sqrt(q + eps));
}

// Vector-Jacobian product of squash: g_s = scale * g_v + radial * <s, g_v> * s,
// radial = 2 scale'(q), written without a 1/q so that tiny q stays finite.
template <typename T>
struct SquashVjp {
  T scale;
  T radial;
};

template <typename T>
CAPSROUTE_HD SquashVjp<T> squash_vjp_coeffs(T q, T eps) {
  if (q == T(0)) return {T(0), T(0)};
  const T inv_norm = T(1) / acc_sqrt(q + eps);
  const T scale = q * inv_norm / (T(1) + q);
  const T radial = T(2) * (inv_norm - scale) / (T(1) + q) - scale * inv_norm * inv_norm;
  return {scale, radial};
}

}  // namespace capsroute
