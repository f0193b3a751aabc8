// dense_capsules on CUDA: agreement_dense.cuh under dynamic routing's rule (RuleTensors{}).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "agreement_dense.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kOp = "dense_capsules";

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_cuda(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t iters, bool leaky, bool /*detach: backward only*/, double eps, bool couplings) {
  check_dense_capsules_inputs(u, weight, bias, iters, eps);
  return route_dense(kOp, u, weight, bias.value_or(at::Tensor()), RuleTensors{}, iters, leaky, eps,
                     couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_backward_cuda(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const at::Tensor& s_hist, bool leaky, bool detach, double eps) {
  check_dense_capsules_backward_inputs(grad_v, u, weight, s_hist, eps);
  const DenseGrads grads =
      route_dense_backward(kOp, grad_v, u, weight, s_hist, RuleTensors{}, leaky, detach, eps);
  return {grads.u, grads.weight, grads.parameters.bias};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("dense_capsules", &cuda::dense_capsules_cuda);
  m.impl("_dense_capsules_backward", &cuda::dense_capsules_backward_cuda);
}

}  // namespace capsroute
