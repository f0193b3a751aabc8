// conv_em_routing on CUDA: the kernels of conv_em_kernels.cuh, launched on the current stream by
// conv_em_sequence.cuh. Same checks, results and saved statistics as
// csrc/cpu/conv_em_routing_cpu.cpp (either backend's backward reads the other's stats). Workspaces
// (accumulation dtype): the E-steps' rows and log-normalisers, O(windows iters C_out 33 +
// children iters) values; the backward adds the M-steps' rows, the children's sums and the weight
// gradient's chunks. No votes, assignments or unfolded poses are stored.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <tuple>
#include <utility>

#include "../common/checks.h"
#include "../common/conv_em_math.h"
#include "../common/kernel_path.h"
#include "conv_em_kernels.cuh"
#include "conv_em_sequence.cuh"
#include "host_checks.cuh"
#include "stream_launcher.cuh"

namespace capsroute {
namespace cuda {
namespace {

// The path, as capsroute.last_kernel_path() names it: a parent (window, type) per thread for the
// M-steps, a child per thread for the E-steps and gradients.
constexpr const char* kConvEmPath = "conv-em-parent-child";

void check_devices(const at::Tensor& pose,
                   std::initializer_list<std::pair<const at::Tensor*, const char*>> others) {
  check_cuda(pose, "pose");
  for (const auto& [t, name] : others) check_same_device(*t, pose, name, "pose");
}

// The forward's workspaces, owned.
struct ConvEmBuffers {
  at::Tensor e_rows, log_norm;
  ConvEmBuffers(const ConvEmDims& d, const at::TensorOptions& acc)
      : e_rows(at::empty({d.B * d.Ho() * d.Wo(), d.iters - 1, d.C_out, kStatsRow}, acc)),
        log_norm(at::empty({d.iters - 1, d.B, d.H, d.W, d.C_in}, acc)) {}
  template <typename acc_t>
  ConvEmWorkspace<acc_t> workspace() {
    return {e_rows.mutable_data_ptr<acc_t>(), log_norm.mutable_data_ptr<acc_t>()};
  }
};

// Chunks of windows for the weight gradient: enough (weight matrices x chunks) threads for about
// kBlocksPerSm blocks an SM, at most one chunk per window.
int64_t conv_em_weight_chunks(int64_t matrices, int64_t windows) {
  const int64_t wanted = kBlocksPerSm * device_sms() * kBlockThreads;
  return std::clamp<int64_t>(ceil_div<int64_t>(wanted, std::max<int64_t>(matrices, 1)), 1,
                             std::max<int64_t>(windows, 1));
}

// The kernels' view of the contiguous inputs (beta_a null where it is not read).
template <typename scalar_t>
ConvEmInputs<scalar_t, at::opmath_type<scalar_t>> kernel_inputs(
    const ConvEmDims& d, const at::Tensor& pose, const at::Tensor& a_in, const at::Tensor& weight,
    const at::Tensor& beta_u, const scalar_t* beta_a, double eps) {
  return {d,
          pose.const_data_ptr<scalar_t>(),
          a_in.const_data_ptr<scalar_t>(),
          weight.const_data_ptr<scalar_t>(),
          beta_u.const_data_ptr<scalar_t>(),
          beta_a,
          static_cast<at::opmath_type<scalar_t>>(eps)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_em_routing_cuda(
    const at::Tensor& pose_in, const at::Tensor& a_in_in, const at::Tensor& weight_in,
    const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, int64_t iters, int64_t stride,
    int64_t padding, double final_lambda, double eps) {
  check_conv_em_routing_inputs(pose_in, a_in_in, weight_in, beta_u_in, beta_a_in, iters, stride,
                               padding, final_lambda, eps);
  check_devices(
      pose_in,
      {{&a_in_in, "a_in"}, {&weight_in, "weight"}, {&beta_u_in, "beta_u"}, {&beta_a_in, "beta_a"}});
  const c10::cuda::CUDAGuard guard(pose_in.device());
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous(),
                   weight = weight_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const ConvEmDims d = conv_em_dims(pose, weight, iters, stride, padding, final_lambda);
  const at::TensorOptions acc = pose.options().dtype(acc_dtype(pose.scalar_type()));
  at::Tensor stats = at::empty({d.B, d.Ho(), d.Wo(), iters, d.C_out, kStatsRow}, acc);
  at::Tensor pose_out = at::empty({d.B, d.Ho(), d.Wo(), d.C_out, kPoseSize}, pose.options());
  at::Tensor a_out = at::empty({d.B, d.Ho(), d.Wo(), d.C_out}, pose.options());
  if (d.B == 0) return {pose_out, a_out, stats};
  // Freed on return: later work on the stream runs after the kernels, so reusing them is safe.
  ConvEmBuffers buf(d, acc);

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        run_conv_em_forward(
            StreamLaunch{c10::cuda::getCurrentCUDAStream()},
            kernel_inputs(d, pose, a_in, weight, beta_u, beta_a.const_data_ptr<scalar_t>(), eps),
            buf.workspace<acc_t>(), stats.mutable_data_ptr<acc_t>(),
            pose_out.mutable_data_ptr<scalar_t>(), a_out.mutable_data_ptr<scalar_t>());
      });
  record_kernel_path("conv_em_routing", Direction::forward, kConvEmPath);
  return {pose_out, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
conv_em_routing_backward_cuda(const at::Tensor& grad_pose_out_in, const at::Tensor& grad_a_out_in,
                              const at::Tensor& pose_in, const at::Tensor& a_in_in,
                              const at::Tensor& weight_in, const at::Tensor& beta_u_in,
                              const at::Tensor& beta_a_in, const at::Tensor& stats_in,
                              int64_t stride, int64_t padding, double final_lambda, double eps) {
  check_conv_em_routing_backward_inputs(grad_pose_out_in, grad_a_out_in, pose_in, a_in_in,
                                        weight_in, beta_u_in, beta_a_in, stats_in, stride, padding,
                                        final_lambda, eps);
  const int64_t iters = stats_in.size(3);
  const ConvEmDims d = conv_em_dims(pose_in, weight_in, iters, stride, padding, final_lambda);
  const int64_t J = d.C_out, windows = d.B * d.Ho() * d.Wo();
  check_devices(pose_in, {{&grad_pose_out_in, "grad_pose_out"},
                          {&grad_a_out_in, "grad_a_out"},
                          {&a_in_in, "a_in"},
                          {&weight_in, "weight"},
                          {&beta_u_in, "beta_u"},
                          {&beta_a_in, "beta_a"},
                          {&stats_in, "stats"}});
  const c10::cuda::CUDAGuard guard(pose_in.device());
  const at::ScalarType acc_type = acc_dtype(pose_in.scalar_type());
  const at::TensorOptions acc = pose_in.options().dtype(acc_type);
  const at::Tensor pose = pose_in.contiguous(), a_in = a_in_in.contiguous(),
                   weight = weight_in.contiguous(), beta_u = beta_u_in.contiguous();
  const at::Tensor grad_pose_out = grad_pose_out_in.to(acc_type).contiguous(),
                   grad_a_out = grad_a_out_in.to(acc_type).contiguous(),
                   stats = stats_in.to(acc_type).contiguous();
  at::Tensor grad_pose = at::empty_like(pose), grad_a_in = at::empty_like(a_in);
  // With B == 0 every sum over the windows is empty: zero weight and beta gradients.
  at::Tensor g_weight = at::zeros(weight.sizes(), acc);
  at::Tensor g_beta = at::zeros({windows, 2, J}, acc);
  if (d.B > 0) {
    ConvEmBuffers buf(d, acc);
    const int64_t matrices = d.K * d.K * d.C_in * J;
    const int64_t chunks = conv_em_weight_chunks(matrices, windows);
    at::Tensor m_rows = at::empty({windows, iters, J, kStatsRow}, acc);
    at::Tensor child_sums = at::empty({iters - 1, d.B, d.H, d.W, d.C_in}, acc);
    at::Tensor g_weight_parts = at::empty({chunks, matrices, kPoseSize}, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, pose.scalar_type(), "conv_em_routing_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          // beta_a: the forward's alone.
          const ConvEmInputs<scalar_t, acc_t> in =
              kernel_inputs<scalar_t>(d, pose, a_in, weight, beta_u, nullptr, eps);
          const ConvEmSaved<acc_t> saved{stats.const_data_ptr<acc_t>(),
                                         grad_pose_out.const_data_ptr<acc_t>(),
                                         grad_a_out.const_data_ptr<acc_t>()};
          const ConvEmBackwardWorkspace<acc_t> bws{
              m_rows.mutable_data_ptr<acc_t>(), child_sums.mutable_data_ptr<acc_t>(),
              g_beta.mutable_data_ptr<acc_t>(), g_weight_parts.mutable_data_ptr<acc_t>()};
          run_conv_em_backward(
              StreamLaunch{c10::cuda::getCurrentCUDAStream()}, in, saved, buf.workspace<acc_t>(),
              bws, chunks, grad_pose.mutable_data_ptr<scalar_t>(),
              grad_a_in.mutable_data_ptr<scalar_t>(), g_weight.mutable_data_ptr<acc_t>());
        });
    record_kernel_path("conv_em_routing", Direction::backward, kConvEmPath);
  }
  // The per-window beta gradients summed over the windows by one fixed reduction; two tensors of
  // their own, not two rows of one: the schema's outputs must not alias (opcheck).
  const at::Tensor grad_betas = g_beta.sum(0).to(pose.scalar_type());
  return {grad_pose, grad_a_in, g_weight.to(pose.scalar_type()), grad_betas[0].clone(),
          grad_betas[1].clone()};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("conv_em_routing", &cuda::conv_em_routing_cuda);
  m.impl("_conv_em_routing_backward", &cuda::conv_em_routing_backward_cuda);
}

}  // namespace capsroute
