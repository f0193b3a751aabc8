// The input layouts the kernels read in place (docs/ops.md, "Layouts"): any strides over the
// batch, input-capsule and output-capsule dimensions, so long as each capsule's values (D, Din
// or the 16 pose values) are contiguous. Host side, shared by both backends.
#pragma once

#include <ATen/ATen.h>

#include "dims.h"

namespace capsroute {

// t itself where each of its capsules, the values of its last `capsule_dims` dimensions, is one
// contiguous run (the kernels take the strides of the dimensions before), else a contiguous copy.
inline at::Tensor with_contiguous_capsules(const at::Tensor& t, int64_t capsule_dims = 1) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= t.dim() - capsule_dims; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return t.contiguous();
    expected *= t.size(d);
  }
  return t;
}

// The strides of t's batch, input-capsule and (where outer_dims is 3) output-capsule dimensions.
inline CapsuleStrides capsule_strides(const at::Tensor& t, int64_t outer_dims) {
  return {t.stride(0), t.stride(1), outer_dims > 2 ? t.stride(2) : 0};
}

}  // namespace capsroute
