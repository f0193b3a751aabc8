// Host-side setup shared by the EM routing CUDA ops (em_routing_cuda.cu and
// em_routing_pose_cuda.cu): the forward's outputs, the backward's device checks and conversions
// to the accumulation dtype, its accumulation buffers and the batch sum of the beta gradients.
// The callers hold a c10::cuda::CUDAGuard on the device of `ref` while these run.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <utility>

#include "../common/checks.h"
#include "em_kernels.cuh"
#include "utils.cuh"

namespace capsroute {
namespace cuda {

// pose (B, J, H) and a_out (B, J) in ref's dtype; stats (B, iters, J, 2H + 1) in the
// accumulation dtype, the layout the CPU writes (the backwards of both backends read either).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> em_forward_outputs(const at::Tensor& ref,
                                                                         const EmKernelDims& dims) {
  return {at::empty({dims.B, dims.J, dims.H}, ref.options()), at::empty({dims.B, dims.J}, ref.options()),
          at::empty({dims.B, dims.iters, dims.J, 2 * dims.H + 1}, ref.options().dtype(acc_dtype(ref.scalar_type())))};
}

// What every EM backward needs besides its op's own inputs, on ref's device.
struct EmBackwardArgs {
  at::Tensor grad_pose, grad_a_out, stats;  // accumulation dtype, contiguous
  at::Tensor grad_beta_items;               // (B, 2, J) per element [beta_u | beta_a], accumulation dtype

  // The beta gradients: the per-element rows summed over the batch (a reduction in a fixed
  // order: deterministic), in the given dtype.
  std::pair<at::Tensor, at::Tensor> beta_grads(at::ScalarType dtype) const {
    const at::Tensor sums = grad_beta_items.sum(0).to(dtype);
    return {sums[0], sums[1]};
  }
};

// The shapes must have been checked (check_em_backward_inputs); this checks devices and
// converts. ref is the op's main input (votes or pose), already checked to be a CUDA tensor.
inline EmBackwardArgs prepare_em_backward(const at::Tensor& grad_pose, const at::Tensor& grad_a_out,
                                          const at::Tensor& stats, const at::Tensor& ref, const char* ref_name,
                                          int64_t B, int64_t J) {
  check_same_device(grad_pose, ref, "grad_pose", ref_name);
  check_same_device(grad_a_out, ref, "grad_a_out", ref_name);
  check_same_device(stats, ref, "stats", ref_name);
  const at::ScalarType acc = acc_dtype(ref.scalar_type());
  return {grad_pose.to(acc).contiguous(), grad_a_out.to(acc).contiguous(), stats.to(acc).contiguous(),
          at::empty({B, 2, J}, ref.options().dtype(acc))};
}

// The kernels accumulate gradients in the accumulation dtype: into the output itself when it
// has that dtype, else into a buffer of its shape that copy_from_acc_buffer converts afterwards.
inline at::Tensor acc_buffer_for(const at::Tensor& out) {
  const at::ScalarType acc = acc_dtype(out.scalar_type());
  return out.scalar_type() == acc ? out : at::empty(out.sizes(), out.options().dtype(acc));
}

inline void copy_from_acc_buffer(at::Tensor& out, const at::Tensor& buffer) {
  if (!buffer.is_same(out)) out.copy_(buffer);
}

}  // namespace cuda
}  // namespace capsroute
