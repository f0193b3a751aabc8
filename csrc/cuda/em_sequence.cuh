// The launch sequences of EM routing through a `launch(kernel, blocks, args...)` callable, as in
// agreement_sequence.cuh: em_launch.cuh and em_routing_pose_cuda.cu pass the CUDA stream one,
// tests/emulator the host one. No CUDA runtime or ATen here.
#pragma once

#include <algorithm>
#include <cstdint>

#include "em_kernels.cuh"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {

// The forward of B > 0 elements, each in `splits` >= 1 row ranges (em_kernels.cuh) whose sums
// ws.partial holds, their rows covered by `lanes` (column only where em_column_lanes_fit(H)):
// stats (B, iters, J, 2H + 1), pose (B, J, H), a_out (B, J).
template <typename Launch, typename Source, typename scalar_t>
void run_em_forward(const Launch& launch, const Source& src, const scalar_t* a_in,
                    const scalar_t* beta_u, const scalar_t* beta_a, const EmDims& dims,
                    typename Source::acc_type eps, int64_t splits, EmLanes lanes,
                    const EmForwardWorkspace<typename Source::acc_type>& ws,
                    typename Source::acc_type* stats, scalar_t* pose, scalar_t* a_out) {
  using acc_t = typename Source::acc_type;
  const unsigned rows_blocks = blocks_for_items(dims.B * splits),
                 element_blocks = blocks_for_items(dims.B);
  for (int64_t t = 0; t < dims.iters; ++t) {
    launch(em_mean_rows_kernel<Source, scalar_t>, rows_blocks, src, a_in, dims, splits, lanes, t,
           static_cast<const acc_t*>(stats), ws);
    launch(em_mean_reduce_kernel<acc_t>, element_blocks, dims, splits, t, eps, ws, stats);
    launch(em_var_rows_kernel<Source, scalar_t>, rows_blocks, src, a_in, dims, splits, t,
           static_cast<const acc_t*>(stats), ws);
    launch(em_var_reduce_kernel<scalar_t, acc_t>, element_blocks, beta_u, beta_a, dims, splits, t,
           eps, ws, stats, pose, a_out);
  }
}

// The backward of dims.B > 0 elements whose inputs and outputs start at the given pointers (a
// chunk of a larger batch: pointers offset to its first element and a source whose element 0 is
// that element). ws holds at least dims.B elements (and their ranges' partial sums).
template <typename Launch, typename Source, typename scalar_t>
void run_em_backward(const Launch& launch, const Source& src, const scalar_t* a_in,
                     const scalar_t* beta_u, const typename Source::acc_type* stats,
                     const typename Source::acc_type* grad_pose,
                     const typename Source::acc_type* grad_a_out, const EmDims& dims,
                     typename Source::acc_type eps, int64_t splits, EmLanes lanes,
                     const EmBackwardWorkspace<typename Source::acc_type>& ws,
                     const EmGrads<typename Source::acc_type>& out) {
  using acc_t = typename Source::acc_type;
  const unsigned rows_blocks = blocks_for_items(dims.B * splits),
                 element_blocks = blocks_for_items(dims.B);
  launch(em_backward_start_kernel<acc_t>, element_blocks, stats, grad_pose, grad_a_out, dims, ws,
         out);
  launch(em_backward_rows_start_kernel<Source, scalar_t>, rows_blocks, src, a_in, stats, dims,
         splits, lanes, ws, out);
  for (int64_t t = dims.iters - 1; t >= 0; --t) {
    launch(em_backward_capsule_kernel<scalar_t, acc_t>, element_blocks, beta_u, stats, dims, splits,
           t, eps, ws, out);
    launch(em_backward_rows_kernel<Source, scalar_t>, rows_blocks, src, a_in, stats, dims, splits,
           lanes, t, eps, ws, out);
  }
}

// em_routing_pose's backward over dims.B > 0 elements, `chunk` at a time through one workspace
// (ws and g_V, chunk x I x J x H, reused by every chunk in stream order): the EM backward of the
// chunk, then its vote gradient contracted into grad_pose (B, I, 4, 4) and, accumulated over the
// chunks in order, g_W (I, J, 4, 4). g_a (B, I) and g_beta (B, 2, J) per element. pose at
// pose_strides and grad_pose at grad_strides (PoseVotes); stats, grad_pose_out and grad_a_out in
// the accumulation dtype.
template <typename Launch, typename scalar_t, typename acc_t>
void run_pose_backward(const Launch& launch, const scalar_t* pose,
                       const CapsuleStrides& pose_strides, const scalar_t* weight,
                       const scalar_t* a_in, const scalar_t* beta_u, const acc_t* stats,
                       const acc_t* grad_pose_out, const acc_t* grad_a_out, const EmDims& dims,
                       acc_t eps, int64_t splits, EmLanes lanes, int64_t chunk,
                       const EmBackwardWorkspace<acc_t>& ws, acc_t* g_V,
                       const CapsuleStrides& grad_strides, scalar_t* grad_pose, acc_t* g_a,
                       acc_t* g_W, acc_t* g_beta) {
  const int64_t B = dims.B, I = dims.I, J = dims.J;
  EmDims chunk_dims = dims;
  for (int64_t b0 = 0; b0 < B; b0 += chunk) {
    chunk_dims.B = std::min(chunk, B - b0);
    const int64_t nb = chunk_dims.B;
    const scalar_t* pose_b0 = pose + pose_strides.offset(b0, 0);
    run_em_backward(
        launch, PoseVotes<scalar_t, acc_t>{pose_b0, pose_strides, weight, J}, a_in + b0 * I, beta_u,
        stats + b0 * dims.iters * dims.stats_block(), grad_pose_out + b0 * J * kPoseSize,
        grad_a_out + b0 * J, chunk_dims, eps, splits, lanes, ws,
        EmGrads<acc_t>{g_V, packed_rows(I, J * kPoseSize), g_a + b0 * I, g_beta + b0 * 2 * J});
    const int64_t n_pose = nb * I * kPoseSize, n_weight = I * J * kPoseSize;
    if (n_pose > 0)
      launch(pose_grad_pose_kernel<scalar_t, acc_t>, blocks_for(n_pose),
             static_cast<const acc_t*>(g_V), weight, nb, I, J, grad_strides,
             grad_pose + grad_strides.offset(b0, 0));
    if (n_weight > 0)
      launch(pose_grad_weight_kernel<scalar_t, acc_t>, blocks_for(n_weight),
             static_cast<const acc_t*>(g_V), pose_b0, pose_strides, nb, I, J,
             /*accumulate=*/b0 > 0, g_W);
  }
}

}  // namespace cuda
}  // namespace capsroute
