// Vector loops shared by the CPU routing code (routing_element.h, em_element.h), written with
// at::vec::Vectorized (AVX2 where the build enables it, see setup.py), so that no loop relies on
// one compiler's auto-vectorisation. A loop over n values takes whole vectors, the last one
// partial: Vectorized's counted loadu fills the lanes past the end with zeros and its counted
// store writes only the lanes in range, so one loop body serves every n.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <type_traits>

namespace capsroute {
namespace cpu {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// Values p[0, n) (n <= Vec<acc_t>::size()) as a Vec<acc_t>, the lanes past n zero.
template <typename acc_t, typename T>
inline Vec<acc_t> load_acc(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return Vec<acc_t>::loadu(p, n);
  } else {
    alignas(64) acc_t values[Vec<acc_t>::size()] = {};
    for (int64_t k = 0; k < n; ++k) values[k] = static_cast<acc_t>(p[k]);
    return Vec<acc_t>::loadu(values, n);
  }
}

template <typename acc_t>
inline acc_t reduce_sum(const Vec<acc_t>& x) {
  return at::vec::vec_reduce_all<acc_t>(std::plus<Vec<acc_t>>(), x);
}

// sum_k a[k] b[k], k < n.
template <typename T, typename U, typename acc_t>
inline acc_t dot(const T* a, const U* b, int64_t n) {
  acc_t sum = 0;
  int64_t k = 0;
  if constexpr (std::is_same_v<T, acc_t> && std::is_same_v<U, acc_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    if (n >= W) {
      Vec<acc_t> acc = Vec<acc_t>::loadu(a) * Vec<acc_t>::loadu(b);
      for (k = W; k + W <= n; k += W) acc = at::vec::fmadd(Vec<acc_t>::loadu(a + k), Vec<acc_t>::loadu(b + k), acc);
      sum = reduce_sum(acc);
    }
  }
  for (; k < n; ++k) sum += static_cast<acc_t>(a[k]) * static_cast<acc_t>(b[k]);
  return sum;
}

// y[k] += alpha x[k], k < n.
template <typename T, typename acc_t>
inline void axpy(acc_t alpha, const T* x, acc_t* y, int64_t n) {
  int64_t k = 0;
  if constexpr (std::is_same_v<T, acc_t>) {
    constexpr int64_t W = Vec<acc_t>::size();
    const Vec<acc_t> a(alpha);
    for (; k + W <= n; k += W) at::vec::fmadd(a, Vec<acc_t>::loadu(x + k), Vec<acc_t>::loadu(y + k)).store(y + k);
  }
  for (; k < n; ++k) y[k] += alpha * static_cast<acc_t>(x[k]);
}

// out = softmax of the n logits, with an extra zero logit when extra_zero_logit (its share is
// dropped: the leaky softmax of dynamic routing). out may alias logits.
template <typename T>
inline void softmax_row(const T* logits, int64_t n, bool extra_zero_logit, T* out) {
  T max_logit = extra_zero_logit ? T(0) : logits[0];
  for (int64_t k = 0; k < n; ++k) max_logit = logits[k] > max_logit ? logits[k] : max_logit;
  const Vec<T> shift(max_logit);
  for (int64_t k = 0; k < n; k += Vec<T>::size()) {
    const int64_t m = std::min<int64_t>(Vec<T>::size(), n - k);
    (Vec<T>::loadu(logits + k, m) - shift).exp().store(out + k, m);
  }
  T denom = extra_zero_logit ? std::exp(-max_logit) : T(0);
  for (int64_t k = 0; k < n; ++k) denom += out[k];
  const T inv_denom = T(1) / denom;
  for (int64_t k = 0; k < n; ++k) out[k] *= inv_denom;
}

}  // namespace cpu
}  // namespace capsroute
