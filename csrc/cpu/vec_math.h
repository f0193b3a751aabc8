// Vector loops shared by the CPU routing code (agreement_element.h, em_element.h), written with
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
#include <utility>
#include <vector>

#include "../common/dims.h"

namespace capsroute {
namespace cpu {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// Calls f(std::integral_constant<int, n>) when n is one of kSizes, else
// f(std::integral_constant<int, 0>) (any n): the loops over n values then get a constant trip count
// (unrolled, their operands kept in registers).
template <int... kSizes, typename F>
void dispatch_size(int64_t n, F&& f) {
  const bool fixed =
      ((n == kSizes ? (f(std::integral_constant<int, kSizes>{}), true) : false) || ...);
  if (!fixed) f(std::integral_constant<int, 0>{});
}

// The routing loops over input capsules i take a tile of W = Vec<acc_t>::size() of them at a time,
// capsule i0 + k in lane k of a vector: softmaxes over the outputs j run lane-wise on whole vectors
// (softmax_lanes) and the tile's per-(i, j) sums over a capsule's values are reduced together
// (lane_sums) instead of one horizontal sum each. Values per (i, j) are then stored by tile,
// (I / W, J, W) with I padded to a whole tile: (i, j) at i0 J + j W + k.
template <typename acc_t>
constexpr int64_t kTileRows = Vec<acc_t>::size();

template <typename acc_t>
inline int64_t padded_rows(int64_t I) {
  return (I + kTileRows<acc_t> - 1) / kTileRows<acc_t> * kTileRows<acc_t>;
}

// Where (i, j) is in a tiled (I / W, J, W) array.
template <typename acc_t>
inline int64_t tiled_index(int64_t i, int64_t j, int64_t J) {
  return (i / kTileRows<acc_t> * J + j) * kTileRows<acc_t> + i % kTileRows<acc_t>;
}

// Vec<T>::loadu(p, n) and x.store(p, n) for n <= Vec<T>::size() values. Where n fills a 128- or
// 256-bit register (D = 8 or 4 floats with AVX-512, 4 with AVX2) they are one plain access of that
// width: at::vec's masked ones (and loads that follow masked stores) made such a D 2.4-2.8x slower.
template <typename T>
C10_ALWAYS_INLINE Vec<T> load_part(const T* p, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (bytes == 32) return _mm512_zextps256_ps512(_mm256_loadu_ps(p));
    if (bytes == 16) return _mm512_zextps128_ps512(_mm_loadu_ps(p));
  } else if constexpr (std::is_same_v<T, double>) {
    if (bytes == 32) return _mm512_zextpd256_pd512(_mm256_loadu_pd(p));
    if (bytes == 16) return _mm512_zextpd128_pd512(_mm_loadu_pd(p));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (bytes == 16) return _mm256_zextps128_ps256(_mm_loadu_ps(p));
  } else if constexpr (std::is_same_v<T, double>) {
    if (bytes == 16) return _mm256_zextpd128_pd256(_mm_loadu_pd(p));
  }
#endif
  return Vec<T>::loadu(p, n);
}

template <typename T>
C10_ALWAYS_INLINE void store_part(const Vec<T>& x, T* p, int64_t n) {
  const int64_t bytes = n * static_cast<int64_t>(sizeof(T));
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (bytes == 32) return _mm256_storeu_ps(p, _mm512_castps512_ps256(x));
    if (bytes == 16) return _mm_storeu_ps(p, _mm512_castps512_ps128(x));
  } else if constexpr (std::is_same_v<T, double>) {
    if (bytes == 32) return _mm256_storeu_pd(p, _mm512_castpd512_pd256(x));
    if (bytes == 16) return _mm_storeu_pd(p, _mm512_castpd512_pd128(x));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (bytes == 16) return _mm_storeu_ps(p, _mm256_castps256_ps128(x));
  } else if constexpr (std::is_same_v<T, double>) {
    if (bytes == 16) return _mm_storeu_pd(p, _mm256_castpd256_pd128(x));
  }
#endif
  x.store(p, n);
}

// Values p[0, n) (n <= Vec<acc_t>::size()) as a Vec<acc_t>, the lanes past n zero.
template <typename acc_t, typename T>
inline Vec<acc_t> load_acc(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t>) {
    return load_part(p, n);
  } else {
    alignas(64) acc_t values[Vec<acc_t>::size()] = {};
    for (int64_t k = 0; k < n; ++k) values[k] = static_cast<acc_t>(p[k]);
    return load_part(values, n);
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
      for (k = W; k + W <= n; k += W)
        acc = at::vec::fmadd(Vec<acc_t>::loadu(a + k), Vec<acc_t>::loadu(b + k), acc);
      sum = reduce_sum(acc);
    }
  }
  for (; k < n; ++k) sum += static_cast<acc_t>(a[k]) * static_cast<acc_t>(b[k]);
  return sum;
}

// A vector whose lanes sum to sum_k a[k] b[k], k < n: a dot product before its horizontal sum,
// so that lane_sums can reduce several at once.
template <typename acc_t, typename T, typename U>
C10_ALWAYS_INLINE Vec<acc_t> dot_lanes(const T* a, const U* b, int64_t n) {
  constexpr int64_t W = Vec<acc_t>::size();
  Vec<acc_t> acc(acc_t(0));
  for (int64_t k = 0; k < n; k += W) {
    const int64_t m = std::min(W, n - k);
    acc = at::vec::fmadd(load_acc<acc_t>(a + k, m), load_acc<acc_t>(b + k, m), acc);
  }
  return acc;
}

// Lane k: the sum of x[k]'s lanes, for the Vec<T>::size() vectors x[0..].
template <typename T>
inline Vec<T> lane_sums(const Vec<T>* x) {
  alignas(64) T sums[Vec<T>::size()];
  for (int64_t k = 0; k < Vec<T>::size(); ++k) sums[k] = reduce_sum(x[k]);
  return Vec<T>::loadu(sums);
}

#if defined(CPU_CAPABILITY_AVX2)
// Eight horizontal sums as a transpose-and-add tree: 9 instructions instead of 8 x 5.
template <>
inline Vec<float> lane_sums(const Vec<float>* x) {
  // hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7]
  const __m256 x01 = _mm256_hadd_ps(x[0], x[1]), x23 = _mm256_hadd_ps(x[2], x[3]);
  const __m256 x45 = _mm256_hadd_ps(x[4], x[5]), x67 = _mm256_hadd_ps(x[6], x[7]);
  // [x0..x3's sums of lanes 0-3 | x0..x3's sums of lanes 4-7], and the same for x4..x7
  const __m256 x0123 = _mm256_hadd_ps(x01, x23), x4567 = _mm256_hadd_ps(x45, x67);
  return _mm256_add_ps(_mm256_permute2f128_ps(x0123, x4567, 0x20),
                       _mm256_permute2f128_ps(x0123, x4567, 0x31));
}
#elif defined(CPU_CAPABILITY_AVX512)
// Sixteen horizontal sums as a transpose-and-add tree: 45 instructions instead of 16 x 8.
template <>
inline Vec<float> lane_sums(const Vec<float>* x) {
  // Within each 128-bit lane: pairs (a, b) -> [a0+a2, b0+b2, a1+a3, b1+b3], then quads
  // (x[4g..4g+3]) -> t[g] = [the four vectors' sums over this 128-bit lane].
  __m512 pairs[8];
  for (int p = 0; p < 8; ++p)
    pairs[p] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * p], x[2 * p + 1]),
                             _mm512_unpackhi_ps(x[2 * p], x[2 * p + 1]));
  __m512 t[4];
  for (int g = 0; g < 4; ++g)
    t[g] =
        _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * g], pairs[2 * g + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(pairs[2 * g], pairs[2 * g + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Across the four 128-bit lanes: 128-bit lane g of the result is t[g] summed over its lanes.
  const __m512 t01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
  const __m512 t23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0x88), _mm512_shuffle_f32x4(t[2], t[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
}

// Two 8 x 8 float transposes side by side, one in each 256-bit half of r[0..8): AVX2's register
// transpose (at::vec's for AVX2), whose in-lane steps serve both halves; its last step, across
// 128-bit lanes, is a two-source permute per row here.
C10_ALWAYS_INLINE void transpose_8x8_halves(__m512* r) {
  __m512 t[8];
  for (int k = 0; k < 8; k += 2) {
    t[k] = _mm512_unpacklo_ps(r[k], r[k + 1]);
    t[k + 1] = _mm512_unpackhi_ps(r[k], r[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    r[k] = _mm512_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 1] = _mm512_shuffle_ps(t[k], t[k + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[k + 2] = _mm512_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[k + 3] = _mm512_shuffle_ps(t[k + 1], t[k + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // Now, for m < 4, r[m] holds rows 0-3 and r[m + 4] rows 4-7, of column m in 128-bit lanes 0
  // and 2 (one per half) and of column m + 4 in lanes 1 and 3.
  const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  const __m512i high =
      _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_permutex2var_ps(r[m], low, r[m + 4]);
    t[m + 4] = _mm512_permutex2var_ps(r[m], high, r[m + 4]);
  }
  for (int m = 0; m < 8; ++m) r[m] = t[m];
}
#endif

// dst (N, M) = src (M, N) transposed, rows ld_src and ld_dst apart: at::vec's transpose_mxn, except
// for the float blocks of AVX-512 (16 x 8 and 8 x 16) done here. at::vec has a fast 8 x 8 for AVX2,
// but for AVX-512 one out-of-line 16 x 16 transpose with masked loads and stores whatever the
// block, which made the weight transposes 38% of dense_capsules' time.
template <typename T, int M, int N>
C10_ALWAYS_INLINE void transpose(const T* src, int64_t ld_src, T* dst, int64_t ld_dst) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float> && M == 16 && N == 8) {
    __m512 r[8];  // r[k]: rows k and k + 8
    for (int k = 0; k < 8; ++k)
      r[k] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(src + k * ld_src)),
                                _mm256_loadu_ps(src + (k + 8) * ld_src), 1);
    transpose_8x8_halves(r);
    for (int m = 0; m < 8; ++m) _mm512_storeu_ps(dst + m * ld_dst, r[m]);
    return;
  } else if constexpr (std::is_same_v<T, float> && M == 8 && N == 16) {
    __m512 r[8];  // r[k]: row k, columns 0-7 | 8-15
    for (int k = 0; k < 8; ++k) r[k] = _mm512_loadu_ps(src + k * ld_src);
    transpose_8x8_halves(r);
    for (int m = 0; m < 8; ++m) {
      _mm256_storeu_ps(dst + m * ld_dst, _mm512_castps512_ps256(r[m]));
      _mm256_storeu_ps(dst + (m + 8) * ld_dst, _mm512_extractf32x8_ps(r[m], 1));
    }
    return;
  }
#endif
  at::vec::transpose_mxn<T, M, N>(src, ld_src, dst, ld_dst);
}

// The votes of one element, a row of capsules per input capsule: capsule (i, j) at
// data + i * row_stride + j * capsule_stride, its values contiguous. Strides, not a packed
// layout, so that the layouts einsum, matmul, permute and slicing give are read in place.
template <typename vote_t>
struct VoteRows {
  const vote_t* data;
  int64_t row_stride, capsule_stride;
  // (A constructor, not an aggregate: a stride left out does not compile.)
  VoteRows(const vote_t* data, int64_t row_stride, int64_t capsule_stride)
      : data(data), row_stride(row_stride), capsule_stride(capsule_stride) {}
  const vote_t* capsule(int64_t i, int64_t j) const {
    return data + i * row_stride + j * capsule_stride;
  }
};

// The votes of element n of a (B, I, J, D) tensor at data with the given strides.
template <typename vote_t>
VoteRows<vote_t> element_votes(const vote_t* data, const CapsuleStrides& strides, int64_t n) {
  return {data + strides.offset(n, 0), strides.row, strides.capsule};
}

// The same votes, gathered into `slab` (I x J x D, adjacent) where their rows lie a multiple of
// 4 KB apart (the einsum layout at B = 32, 128, ...) or a row's capsules are apart: the routing
// passes over an element's rows many times, and such rows share a few L2 sets and evict each
// other; one gather keeps the passes in L2. Rows at other strides are read in place (the gather
// costs more than it saves there).
template <typename vote_t>
VoteRows<vote_t> staged_element_votes(const vote_t* data, const CapsuleStrides& strides, int64_t n,
                                      int64_t I, int64_t J, int64_t D, std::vector<vote_t>& slab) {
  const VoteRows<vote_t> votes = element_votes(data, strides, n);
  const bool page_strided = strides.row * int64_t(sizeof(vote_t)) % 4096 == 0;
  if (strides.capsule == D && (strides.row == J * D || !page_strided)) return votes;
  slab.resize(I * J * D);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t j = 0; j < J; ++j)
      std::copy(votes.capsule(i, j), votes.capsule(i, j) + D, slab.data() + (i * J + j) * D);
  return {slab.data(), J * D, D};
}

// Lane k: the sum of the lanes of row_sum(k) (a Vec<acc_t>) for the n rows of a tile (lanes past
// n: 0), the tile's horizontal sums done together. (Always inlined, here and below: the caller's
// compile-time sizes then reach the loops.)
template <typename acc_t, typename RowSum>
C10_ALWAYS_INLINE Vec<acc_t> tile_sums(int64_t n, RowSum&& row_sum) {
  Vec<acc_t> partial[kTileRows<acc_t>];
  for (int64_t k = 0; k < kTileRows<acc_t>; ++k)
    partial[k] = k < n ? row_sum(k) : Vec<acc_t>(acc_t(0));
  return lane_sums(partial);
}

// Lane k: the dot of x (D values) with capsule j of row i0 + k, for the n rows of the tile at i0
// (lanes past n: 0).
template <typename acc_t, typename vote_t>
C10_ALWAYS_INLINE Vec<acc_t> tile_dots(VoteRows<vote_t> u, int64_t i0, int64_t n, int64_t j,
                                       const acc_t* x, int64_t D) {
  // tile_sums spelled out: through its lambda, dynamic routing's forward ran 2-4% slower (GCC 12).
  Vec<acc_t> partial[kTileRows<acc_t>];
  for (int64_t k = 0; k < kTileRows<acc_t>; ++k)
    partial[k] = k < n ? dot_lanes<acc_t>(u.capsule(i0 + k, j), x, D) : Vec<acc_t>(acc_t(0));
  return lane_sums(partial);
}

// y (D values) += coef[k] times capsule j of row i0 + k, k < n in order.
template <typename acc_t, typename vote_t>
C10_ALWAYS_INLINE void tile_axpy(const acc_t* coef, VoteRows<vote_t> u, int64_t i0, int64_t n,
                                 int64_t j, acc_t* y, int64_t D) {
  constexpr int64_t W = Vec<acc_t>::size();
  for (int64_t d0 = 0; d0 < D; d0 += W) {
    const int64_t m = std::min(W, D - d0);
    Vec<acc_t> sum = load_part(y + d0, m);
    for (int64_t k = 0; k < n; ++k)
      sum = at::vec::fmadd(Vec<acc_t>(coef[k]), load_acc<acc_t>(u.capsule(i0 + k, j) + d0, m), sum);
    store_part(sum, y + d0, m);
  }
}

// The softmax over n logits of Vec<T>::size() rows at once, row k in lane k: logits and out are n
// vectors (n, W); with an extra zero logit when extra_zero_logit (its share is dropped: the leaky
// softmax of dynamic routing). No horizontal max or sum, and n exps for W rows. out may alias
// logits.
template <typename T>
inline void softmax_lanes(const T* logits, int64_t n, bool extra_zero_logit, T* out) {
  constexpr int64_t W = Vec<T>::size();
  Vec<T> max_logit = extra_zero_logit ? Vec<T>(T(0)) : Vec<T>::loadu(logits);
  for (int64_t k = 0; k < n; ++k)
    max_logit = at::vec::maximum(max_logit, Vec<T>::loadu(logits + k * W));
  Vec<T> denom = extra_zero_logit ? (Vec<T>(T(0)) - max_logit).exp() : Vec<T>(T(0));
  for (int64_t k = 0; k < n; ++k) {
    const Vec<T> e = (Vec<T>::loadu(logits + k * W) - max_logit).exp();
    e.store(out + k * W);
    denom = denom + e;
  }
  const Vec<T> inv_denom = Vec<T>(T(1)) / denom;
  for (int64_t k = 0; k < n; ++k) (Vec<T>::loadu(out + k * W) * inv_denom).store(out + k * W);
}

}  // namespace cpu
}  // namespace capsroute
