// Capsule inputs laid out as torch.einsum leaves them, for the kernels to read in place
// (docs/ops.md, "Layouts"): the rows (b, i) of n values of a contiguous (B, I, n) array (n = J * D
// votes, or a pose's 16 values) stored input-capsule-major, each row `gap` values after the end of
// the previous one, after `offset` values of storage (RowLayout). The gaps hold NaN, so a kernel
// that reads past a row or ignores a stride shows; gathered() reads the rows back, and a kernel
// that writes into a gap shows in gaps_written().
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../../csrc/common/dims.h"

struct RowLayout {
  int64_t gap, offset;
};

template <typename T>
struct StridedRows {
  std::vector<T> storage;
  int64_t offset, B, I, n;
  capsroute::CapsuleStrides rows;
  T* data() { return storage.data() + offset; }
  const T* data() const { return storage.data() + offset; }
  // The rows, contiguous (B, I, n) again.
  std::vector<T> gathered() const {
    std::vector<T> out(B * I * n);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < n; ++k) out[(b * I + i) * n + k] = data()[rows.offset(b, i) + k];
    return out;
  }
  // Values outside the rows that are no longer NaN.
  int64_t gaps_written() const {
    std::vector<bool> in_row(storage.size(), false);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < n; ++k) in_row[offset + rows.offset(b, i) + k] = true;
    int64_t set = 0;
    for (size_t k = 0; k < storage.size(); ++k)
      set += !in_row[k] && !std::isnan(static_cast<double>(storage[k]));
    return set;
  }
};

// NaN everywhere but the rows, which hold `packed` (B, I, n) when it is given.
template <typename T>
StridedRows<T> strided_rows(int64_t B, int64_t I, int64_t n, RowLayout layout,
                            const std::vector<T>* packed = nullptr) {
  const int64_t row = n + layout.gap;
  StridedRows<T> out{
      std::vector<T>(layout.offset + I * B * row, std::numeric_limits<T>::quiet_NaN()),
      layout.offset,
      B,
      I,
      n,
      {row, B * row, 0}};
  if (packed != nullptr)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t k = 0; k < n; ++k)
          out.data()[out.rows.offset(b, i) + k] = (*packed)[(b * I + i) * n + k];
  return out;
}
