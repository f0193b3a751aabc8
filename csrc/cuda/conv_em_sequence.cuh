// The launch sequences of conv_em_routing through a `launch(kernel, blocks, args...)` callable, as
// in em_sequence.cuh: conv_em_routing_cuda.cu passes the CUDA stream one, tests/emulator the host
// one. No CUDA runtime or ATen here.
#pragma once

#include <cstdint>

#include "conv_em_kernels.cuh"

namespace capsroute {
namespace cuda {

// `kernel` over n > 0 items (a thread each); nothing where n == 0.
template <typename Launch, typename Kernel, typename... Args>
void launch_items(const Launch& launch, Kernel kernel, int64_t n, const Args&... args) {
  if (n > 0) launch(kernel, blocks_for(n), args...);
}

// E-step t's log-normalisers of every child.
template <typename Launch, typename scalar_t, typename acc_t>
void run_conv_em_log_norm(const Launch& launch, const ConvEmInputs<scalar_t, acc_t>& in, int64_t t,
                          const ConvEmWorkspace<acc_t>& ws) {
  launch_items(launch, conv_em_log_norm_kernel<scalar_t, acc_t>, in.children(), in, t, ws);
}

// The forward of B > 0 elements: stats (B, Ho, Wo, iters, C_out, 33), pose_out (B, Ho, Wo, C_out,
// 16) and a_out (B, Ho, Wo, C_out).
template <typename Launch, typename scalar_t, typename acc_t>
void run_conv_em_forward(const Launch& launch, const ConvEmInputs<scalar_t, acc_t>& in,
                         const ConvEmWorkspace<acc_t>& ws, acc_t* stats, scalar_t* pose_out,
                         scalar_t* a_out) {
  for (int64_t t = 0; t < in.d.iters; ++t) {
    launch_items(launch, conv_em_m_step_kernel<scalar_t, acc_t>, in.parents(), in, t, ws, stats,
                 pose_out, a_out);
    if (t < in.d.iters - 1) run_conv_em_log_norm(launch, in, t, ws);
  }
}

// The backward of B > 0 elements: grad_pose (B, H, W, C_in, 16) and grad_a_in (B, H, W, C_in) in
// the storage dtype, g_weight (K, K, C_in, C_out, 16) and bws.g_beta (windows, 2, C_out) in the
// accumulation dtype; the weight's sums in `chunks` ranges of windows (bws.g_weight_parts).
template <typename Launch, typename scalar_t, typename acc_t>
void run_conv_em_backward(const Launch& launch, const ConvEmInputs<scalar_t, acc_t>& in,
                          const ConvEmSaved<acc_t>& saved, const ConvEmWorkspace<acc_t>& ws,
                          const ConvEmBackwardWorkspace<acc_t>& bws, int64_t chunks,
                          scalar_t* grad_pose, scalar_t* grad_a_in, acc_t* g_weight) {
  const int64_t iters = in.d.iters;
  launch_items(launch, conv_em_e_rows_kernel<acc_t>, in.parents() * (iters - 1), in.d, saved.stats,
               ws.e_rows);
  for (int64_t t = 0; t + 1 < iters; ++t) run_conv_em_log_norm(launch, in, t, ws);
  for (int64_t t = iters - 1; t >= 0; --t) {
    launch_items(launch, conv_em_backward_window_kernel<scalar_t, acc_t>, in.parents(), in, t,
                 saved, ws, bws);
    if (t > 0)
      launch_items(launch, conv_em_child_sums_kernel<scalar_t, acc_t>, in.children(), in, t,
                   saved.stats, ws, bws);
  }
  launch_items(launch, conv_em_grad_pose_kernel<scalar_t, acc_t>, in.children(), in, saved.stats,
               ws, bws, grad_pose, grad_a_in);
  const int64_t values = in.weight_matrices() * kPoseSize;
  launch_items(launch, conv_em_grad_weight_kernel<scalar_t, acc_t>, chunks * in.weight_matrices(),
               in, saved.stats, chunks, ws, bws);
  launch_items(launch, conv_em_sum_weight_parts_kernel<acc_t>, values,
               static_cast<const acc_t*>(bws.g_weight_parts), chunks, values, g_weight);
}

}  // namespace cuda
}  // namespace capsroute
