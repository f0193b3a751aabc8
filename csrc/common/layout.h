// The input layouts the kernels read in place (docs/ops.md, "Layouts"): any strides over the
// batch, input-capsule and output-capsule dimensions, so long as each capsule's values (D, Din
// or the 16 pose values) are contiguous. Host side, shared by both backends.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>

#include "../cpu/output_cache.h"
#include "dims.h"

namespace capsroute {

// Whether each of t's capsules, the values of its last `capsule_dims` dimensions, is one
// contiguous run (the kernels take the strides of the dimensions before).
inline bool has_contiguous_capsules(const at::Tensor& t, int64_t capsule_dims) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= t.dim() - capsule_dims; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// t itself where its capsules are contiguous runs, else a contiguous copy.
inline at::Tensor with_contiguous_capsules(const at::Tensor& t, int64_t capsule_dims = 1) {
  return has_contiguous_capsules(t, capsule_dims) ? t : t.contiguous();
}

// The strides of t's batch, input-capsule and (where outer_dims is 3) output-capsule dimensions.
inline CapsuleStrides capsule_strides(const at::Tensor& t, int64_t outer_dims) {
  return {t.stride(0), t.stride(1), outer_dims > 2 ? t.stride(2) : 0};
}

// The gradient of a capsule input t, in t's layout where that layout is dense (empty_like keeps
// it), else contiguous: autograd then hands it to a leaf of that layout, or back through the
// einsum or permute that made t, without a copy.
// On the CPU it comes from the output cache (cpu/output_cache.h).
inline at::Tensor empty_capsule_gradient(const at::Tensor& t, int64_t capsule_dims) {
  if (t.is_cpu()) {
    const at::Tensor like = at::empty_like(t, t.options().device(at::kMeta));  // the layout alone
    return has_contiguous_capsules(like, capsule_dims)
               ? cpu::empty_output_strided(like.sizes(), like.strides(), t.options())
               : cpu::empty_output(t.sizes(), t.options());
  }
  at::Tensor like = at::empty_like(t);
  // (empty_like of a layout with gaps may guess a channels-last one)
  return has_contiguous_capsules(like, capsule_dims) ? like : at::empty(t.sizes(), t.options());
}

// Stores row (b, i)'s J capsules of D values, adjacent in `row`, into out at the capsule strides s.
template <typename scalar_t, typename acc_t>
void store_capsule_row(const acc_t* row, int64_t J, int64_t D, const CapsuleStrides& s, int64_t b,
                       int64_t i, scalar_t* out) {
  for (int64_t j = 0; j < J; ++j)
    std::copy(row + j * D, row + (j + 1) * D, out + s.offset(b, i, j));
}

}  // namespace capsroute
