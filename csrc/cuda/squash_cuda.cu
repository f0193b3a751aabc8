// squash over the last dim on CUDA: one warp per row (any row length), accumulation in
// at::opmath_type (float, or double for double).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "host_checks.cuh"
#include "squash_kernels.cuh"
#include "stream_launcher.cuh"

namespace capsroute {
namespace cuda {
namespace {

template <bool kBackward>
at::Tensor squash_rows_cuda(const at::Tensor& s_in, const at::Tensor* grad_in, double eps) {
  if (kBackward)
    check_squash_backward_inputs(*grad_in, s_in, eps);
  else
    check_squash_inputs(s_in, eps);
  check_cuda(s_in, "s");
  const c10::cuda::CUDAGuard guard(s_in.device());
  const at::Tensor s = s_in.contiguous();
  const at::Tensor grad = kBackward ? grad_in->to(s.scalar_type()).contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(s);
  const int64_t D = s.size(-1);
  const int64_t rows = D == 0 ? 0 : s.numel() / D;
  if (rows == 0) return out;
  record_kernel_path("squash", kBackward ? Direction::backward : Direction::forward, "cuda");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "squash_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    StreamLaunch{c10::cuda::getCurrentCUDAStream()}(
        squash_rows_kernel<kBackward, scalar_t, acc_t>, blocks_for_warps(rows),
        s.const_data_ptr<scalar_t>(), kBackward ? grad.const_data_ptr<scalar_t>() : nullptr,
        out.mutable_data_ptr<scalar_t>(), rows, D, static_cast<acc_t>(eps));
  });
  return out;
}

at::Tensor squash_cuda(const at::Tensor& s, double eps) {
  return squash_rows_cuda<false>(s, nullptr, eps);
}

at::Tensor squash_backward_cuda(const at::Tensor& grad_v, const at::Tensor& s, double eps) {
  TORCH_CHECK(grad_v.sizes() == s.sizes(), "capsroute: grad_v must have the shape of s ", s.sizes(),
              ", got ", grad_v.sizes());
  return squash_rows_cuda<true>(s, &grad_v, eps);
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("squash", &cuda::squash_cuda);
  m.impl("_squash_backward", &cuda::squash_backward_cuda);
}

}  // namespace capsroute
