// dense_capsules on CUDA: the shared routing kernels over votes_ij = weight_ij @ u_i, computed
// on the fly (DenseVotes); neither the votes nor their gradient is ever stored. The backward
// contracts the vote gradient of the saved state with weight (grad_u) and with u (grad_weight,
// a deterministic loop over the batch, no atomics).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "routing_launch.cuh"
#include "host_checks.cuh"

namespace capsroute {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_cuda(const at::Tensor& u_in, const at::Tensor& weight_in,
                                                                   const std::optional<at::Tensor>& bias_in,
                                                                   int64_t iters, bool leaky,
                                                                   bool /*detach: backward only*/, double eps) {
  check_dense_capsules_inputs(u_in, weight_in, bias_in, iters, eps);
  check_cuda(u_in, "u");
  const c10::cuda::CUDAGuard guard(u_in.device());
  const at::Tensor u = u_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t Din = u.size(2);
  const RoutingDims dims{u.size(0), weight.size(0), weight.size(1), weight.size(2), iters, leaky};
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, u.options());
  at::Tensor c = at::empty({dims.B, dims.I, dims.J}, u.options());
  at::Tensor s_hist = at::empty({dims.B, iters, dims.J, dims.D}, u.options().dtype(acc_dtype(u.scalar_type())));
  if (dims.B == 0) return {v, c, s_hist};

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "dense_capsules_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const DenseVotes<scalar_t, acc_t> src{u.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), dims.I,
                                          dims.J * dims.D, Din};
    launch_routing_forward(src, bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr, dims, eps, s_hist, v, c);
  });
  return {v, c, s_hist};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_backward_cuda(const at::Tensor& grad_v_in,
                                                                            const at::Tensor& u_in,
                                                                            const at::Tensor& weight_in,
                                                                            const at::Tensor& s_hist_in, bool leaky,
                                                                            bool detach, double eps) {
  check_dense_capsules_backward_inputs(grad_v_in, u_in, weight_in, s_hist_in, eps);
  const int64_t B = u_in.size(0), Din = u_in.size(2);
  check_cuda(u_in, "u");
  check_same_device(grad_v_in, u_in, "grad_v", "u");
  const c10::cuda::CUDAGuard guard(u_in.device());
  const RoutingDims dims{B, weight_in.size(0), weight_in.size(1), weight_in.size(2), s_hist_in.size(1), leaky};
  const at::Tensor u = u_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  // The incoming gradient stays in the accumulation dtype (float32 for float16/bfloat16 storage).
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  at::Tensor grad_u = at::empty_like(u);
  // With B == 0 the sums over the batch are empty: zero gradients.
  at::Tensor grad_weight = B == 0 ? at::zeros_like(weight) : at::empty_like(weight);
  // Per-item bias gradients, summed afterwards in a fixed order so results are deterministic.
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, u.options().dtype(acc));

  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "dense_capsules_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const DenseVotes<scalar_t, acc_t> src{u.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(), dims.I,
                                            dims.J * dims.D, Din};
      const BackwardBuffers<acc_t> buf =
          launch_routing_backward(src, grad_v.const_data_ptr<acc_t>(), s_hist, dims, detach, eps, grad_bias_items);
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
      const int64_t n_u = grad_u.numel();
      if (n_u > 0) {
        dense_grad_u_kernel<scalar_t, acc_t><<<blocks_for(n_u), kBlockThreads, 0, stream>>>(
            buf.state, weight.const_data_ptr<scalar_t>(), B, Din, grad_u.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      const int64_t n_w = grad_weight.numel();
      if (n_w > 0) {
        dense_grad_weight_kernel<scalar_t, acc_t><<<blocks_for(n_w), kBlockThreads, 0, stream>>>(
            buf.state, u.const_data_ptr<scalar_t>(), B, Din, grad_weight.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  }
  return {grad_u, grad_weight, grad_bias_items.sum(0).to(u.scalar_type())};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("dense_capsules", &cuda::dense_capsules_cuda);
  m.impl("_dense_capsules_backward", &cuda::dense_capsules_backward_cuda);
}

}  // namespace capsroute
