// squash over the last dim on CUDA: one warp per row (any row length), accumulation in
// at::opmath_type (float, or double for double).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/math.h"
#include "utils.cuh"

namespace capsroute {
namespace cuda {
namespace {

// out = squash(s) (forward) or squash_vjp(s, grad) (backward), rows of length D.
// Warp per row; the row loop is uniform per warp, so the reductions see all 32 lanes.
template <bool kBackward, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kBlockThreads)
    squash_rows_kernel(const scalar_t* s, const scalar_t* grad, scalar_t* out, int64_t rows, int64_t D, acc_t eps) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t warps_per_block = blockDim.x / kWarpSize;
  const int64_t first_row = static_cast<int64_t>(blockIdx.x) * warps_per_block + threadIdx.x / kWarpSize;
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * warps_per_block;
  for (int64_t row = first_row; row < rows; row += row_stride) {
    const scalar_t* x = s + row * D;
    const scalar_t* g = kBackward ? grad + row * D : nullptr;
    scalar_t* o = out + row * D;
    acc_t q = 0, sg = 0;
    for (int64_t d = lane; d < D; d += kWarpSize) {
      const acc_t xd = static_cast<acc_t>(x[d]);
      q += xd * xd;
      if (kBackward) sg += xd * static_cast<acc_t>(g[d]);
    }
    q = warp_sum(q);
    if (kBackward) {
      sg = warp_sum(sg);
      const SquashVjp<acc_t> k = squash_vjp_coeffs(q, eps);
      for (int64_t d = lane; d < D; d += kWarpSize)
        o[d] = static_cast<scalar_t>(k.scale * static_cast<acc_t>(g[d]) + k.radial * sg * static_cast<acc_t>(x[d]));
    } else {
      const acc_t scale = squash_scale(q, eps);
      for (int64_t d = lane; d < D; d += kWarpSize) o[d] = static_cast<scalar_t>(scale * static_cast<acc_t>(x[d]));
    }
  }
}

template <bool kBackward>
at::Tensor squash_rows_cuda(const at::Tensor& s_in, const at::Tensor* grad_in, double eps) {
  check_float_dtype(s_in, "s");
  TORCH_CHECK(s_in.dim() >= 1, "capsroute: s must have at least 1 dim (the capsule dim last), got a scalar");
  check_eps(eps);
  check_cuda(s_in, "s");
  if (kBackward) check_same_device(*grad_in, s_in, "grad_v", "s");
  const c10::cuda::CUDAGuard guard(s_in.device());
  const at::Tensor s = s_in.contiguous();
  const at::Tensor grad = kBackward ? grad_in->to(s.scalar_type()).contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(s);
  const int64_t D = s.size(-1);
  const int64_t rows = D == 0 ? 0 : s.numel() / D;
  if (rows == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "squash_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    squash_rows_kernel<kBackward, scalar_t, acc_t><<<blocks_for_warps(rows), kBlockThreads, 0, stream>>>(
        s.const_data_ptr<scalar_t>(), kBackward ? grad.const_data_ptr<scalar_t>() : nullptr,
        out.mutable_data_ptr<scalar_t>(), rows, D, static_cast<acc_t>(eps));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor squash_cuda(const at::Tensor& s, double eps) { return squash_rows_cuda<false>(s, nullptr, eps); }

at::Tensor squash_backward_cuda(const at::Tensor& grad_v, const at::Tensor& s, double eps) {
  TORCH_CHECK(grad_v.sizes() == s.sizes(), "capsroute: grad_v must have the shape of s ", s.sizes(), ", got ",
              grad_v.sizes());
  return squash_rows_cuda<true>(s, &grad_v, eps);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("squash", &cuda::squash_cuda);
  m.impl("_squash_backward", &cuda::squash_backward_cuda);
}

}  // namespace capsroute
