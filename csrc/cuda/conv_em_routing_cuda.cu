// conv_em_routing on CUDA tensors. The op has no CUDA kernel yet: until it has one, its CUDA
// implementation runs the CPU kernel on host copies of the inputs and copies the results back
// (exact, slow: a warning says so once), and records the path "cuda-host-copy". Its kernel belongs
// to a GPU session (CUDA discipline: one kernel, emulator-checked, with its performance model).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <initializer_list>
#include <tuple>
#include <utility>

#include "../common/kernel_path.h"
#include "host_checks.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr const char* kHostCopyPath = "cuda-host-copy";

void warn_host_copy() {
  TORCH_WARN_ONCE(
      "capsroute: conv_em_routing has no CUDA kernel yet; it runs the CPU kernel on host copies "
      "of CUDA tensors (correct, slow)");
}

at::Tensor on_host(const at::Tensor& t) { return t.to(at::kCPU); }

// The CPU kernel would accept a mix of devices once everything is copied: refuse it here.
void check_devices(const at::Tensor& pose,
                   std::initializer_list<std::pair<const at::Tensor*, const char*>> others) {
  check_cuda(pose, "pose");
  for (const auto& [t, name] : others) check_same_device(*t, pose, name, "pose");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_em_routing_cuda(
    const at::Tensor& pose, const at::Tensor& a_in, const at::Tensor& weight,
    const at::Tensor& beta_u, const at::Tensor& beta_a, int64_t iters, int64_t stride,
    int64_t padding, double final_lambda, double eps) {
  check_devices(pose,
                {{&a_in, "a_in"}, {&weight, "weight"}, {&beta_u, "beta_u"}, {&beta_a, "beta_a"}});
  warn_host_copy();
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsroute::conv_em_routing", "")
                             .typed<decltype(conv_em_routing_cuda)>();
  auto [pose_out, a_out, stats] =
      op.call(on_host(pose), on_host(a_in), on_host(weight), on_host(beta_u), on_host(beta_a),
              iters, stride, padding, final_lambda, eps);
  record_kernel_path("conv_em_routing", Direction::forward, kHostCopyPath);
  const at::Device device = pose.device();
  return {pose_out.to(device), a_out.to(device), stats.to(device)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_em_routing_backward_cuda(const at::Tensor& grad_pose_out, const at::Tensor& grad_a_out,
                              const at::Tensor& pose, const at::Tensor& a_in,
                              const at::Tensor& weight, const at::Tensor& beta_u,
                              const at::Tensor& beta_a, const at::Tensor& stats, int64_t stride,
                              int64_t padding, double final_lambda, double eps) {
  check_devices(pose, {{&grad_pose_out, "grad_pose_out"},
                       {&grad_a_out, "grad_a_out"},
                       {&a_in, "a_in"},
                       {&weight, "weight"},
                       {&beta_u, "beta_u"},
                       {&beta_a, "beta_a"},
                       {&stats, "stats"}});
  warn_host_copy();
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("capsroute::_conv_em_routing_backward", "")
                             .typed<decltype(conv_em_routing_backward_cuda)>();
  auto [grad_pose, grad_a_in, grad_weight, grad_beta_u, grad_beta_a] = op.call(
      on_host(grad_pose_out), on_host(grad_a_out), on_host(pose), on_host(a_in), on_host(weight),
      on_host(beta_u), on_host(beta_a), on_host(stats), stride, padding, final_lambda, eps);
  record_kernel_path("conv_em_routing", Direction::backward, kHostCopyPath);
  const at::Device device = pose.device();
  return {grad_pose.to(device), grad_a_in.to(device), grad_weight.to(device),
          grad_beta_u.to(device), grad_beta_a.to(device)};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("conv_em_routing", &cuda::conv_em_routing_cuda);
  m.impl("_conv_em_routing_backward", &cuda::conv_em_routing_backward_cuda);
}

}  // namespace capsroute
