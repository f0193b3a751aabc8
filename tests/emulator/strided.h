// Votes (or poses) laid out as torch.einsum and slicing leave them, for the kernels' vote
// sources to read in place (docs/ops.md, "Layouts"): the values of a contiguous (B, I, J, C)
// array (J = 1 for (B, I, C) inputs) copied input-capsule-major, each capsule C values at a
// stride of C + pad, after `offset` values of storage (CapsuleLayout). The gaps hold NaN, so a
// kernel that reads past a capsule or ignores a stride shows.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "../../csrc/common/dims.h"

struct CapsuleLayout {
  int64_t pad, offset;
};

template <typename T>
struct StridedCapsules {
  std::vector<T> storage;
  int64_t offset;
  capsroute::CapsuleStrides strides;
  const T* data() const { return storage.data() + offset; }
};

template <typename T>
StridedCapsules<T> strided_capsules(const std::vector<T>& packed, int64_t B, int64_t I, int64_t J, int64_t C,
                                    CapsuleLayout layout) {
  const int64_t capsule = C + layout.pad, offset = layout.offset;
  StridedCapsules<T> out{std::vector<T>(offset + I * B * J * capsule, std::numeric_limits<T>::quiet_NaN()), offset,
                         {J * capsule, B * J * capsule, capsule}};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < J; ++j)
        for (int64_t c = 0; c < C; ++c)
          out.storage[offset + out.strides.offset(b, i, j) + c] = packed[((b * I + i) * J + j) * C + c];
  return out;
}
