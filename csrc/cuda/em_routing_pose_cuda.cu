// em_routing_pose on CUDA: the EM kernels of em_kernels.cuh over votes V_ij = P_i @ W_ij (4x4)
// computed on the fly by the PoseVotes source. Same checks, results and saved statistics as
// csrc/cpu/em_routing_pose_cpu.cpp (either backend's backward reads the other's stats).
//
// Forward: the EM kernels over PoseVotes, in row ranges (em_sequence.cuh); votes are never stored.
//
// Backward, and how its memory is bounded: the EM backward kernels over PoseVotes yield the vote
// gradient g_V (I, J, 16) of each element, which is contracted into
//   g_pose: g_P_i = sum_j g_V_ij W_ij^T          (pose_grad_pose_kernel, per element)
//   g_weight: g_W_ij = sum_b P_i^T g_V_ij        (pose_grad_weight_kernel, over the batch).
// The batch is processed in chunks of consecutive elements, one after another on the stream:
// each chunk runs the EM backward into a chunk-sized g_V buffer (with chunk-sized EM
// workspaces), then both contractions. A chunk holds as many elements as fit in
// kPoseBackwardChunkBytes (256 MiB) of g_V and EM workspaces, (16 + iters + 1) I J values per
// element plus the row ranges' partial sums, and at least one; the buffers are reused by every
// chunk. So the backward's extra memory is O(min(B, chunk) * I * J * (16 + iters)), never
// O(B * I * J * 16).
//
// Determinism: no atomics and fixed summation orders. The weight gradient is one running sum
// per (i, j, k, c) in the accumulation dtype that each chunk extends element by element in
// batch order, so it is bitwise the same for every chunk size; everything else is per element
// (the beta gradients per element, summed over the batch by one fixed reduction at the end).
// The chunk size depends only on the shapes and dtype, never on the device; the environment
// variable CAPSROUTE_EM_POSE_BACKWARD_CHUNK=n overrides it (for tests of that invariance). The
// row ranges are chosen once for the whole batch, so every chunk uses the same (they depend on
// the device's SM count: on another GPU the sums over i may round differently).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "../common/checks.h"
#include "../common/layout.h"
#include "em_kernels.cuh"
#include "em_launch.cuh"
#include "host_checks.cuh"
#include "kernel_options.h"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {
namespace {

constexpr int64_t kPoseBackwardChunkBytes = int64_t(256) << 20;

// Batch elements per chunk of the backward (>= 1; see the top of the file), with `splits` row
// ranges.
int64_t pose_backward_chunk(const EmDims& dims, int64_t splits, int64_t acc_bytes) {
  if (const std::optional<int64_t> forced = forced_count("CAPSROUTE_EM_POSE_BACKWARD_CHUNK"))
    return *forced;
  // Per element: g_V (16 I J), R_hist and g_R ((iters + 1) I J), the (J)- and (J, H)-sized rest,
  // and the row ranges' partial sums.
  const int64_t values = dims.I * dims.J * (kPoseSize + dims.iters + 1) +
                         dims.J * (dims.iters + 2 * kPoseSize + 3) +
                         splits * dims.J * (2 * kPoseSize + 1 + dims.iters);
  return std::max<int64_t>(1, kPoseBackwardChunkBytes / std::max<int64_t>(1, values * acc_bytes));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_pose_cuda(
    const at::Tensor& pose_in, const at::Tensor& weight_in, const at::Tensor& a_in_in,
    const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, int64_t iters, double final_lambda,
    double eps) {
  check_em_routing_pose_inputs(pose_in, weight_in, a_in_in, beta_u_in, beta_a_in, iters,
                               final_lambda, eps);
  check_cuda(pose_in, "pose");
  const c10::cuda::CUDAGuard guard(pose_in.device());
  const at::Tensor pose = with_contiguous_capsules(pose_in, 2), weight = weight_in.contiguous(),
                   a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const EmDims dims{pose.size(0), pose.size(1), weight.size(1), kPoseSize, iters, final_lambda};
  at::Tensor pose_out, a_out,
      stats;  // (not structured bindings: the dispatch lambda captures them)
  std::tie(pose_out, a_out, stats) = em_forward_outputs(pose, dims);
  if (dims.B == 0) return {pose_out, a_out, stats};

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "em_routing_pose_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const PoseVotes<scalar_t, acc_t> src{pose.const_data_ptr<scalar_t>(),
                                             capsule_strides(pose, 2),
                                             weight.const_data_ptr<scalar_t>(), dims.J};
        record_kernel_path(
            "em_routing_pose", Direction::forward,
            launch_em_forward(src, a_in.const_data_ptr<scalar_t>(),
                              beta_u.const_data_ptr<scalar_t>(), beta_a.const_data_ptr<scalar_t>(),
                              dims, eps, stats, pose_out, a_out));
      });
  return {pose_out, a_out, stats};
}

// The chunked backward (B > 0): pose at pose_strides; grad_pose (B, I, 4, 4) in the storage
// dtype at grad_strides; g_a (B, I), g_W (I, J, 4, 4) and args.grad_beta_items (B, 2, J) in the
// accumulation dtype. Returns the path it ran (em_path).
template <typename scalar_t, typename acc_t>
const char* launch_pose_backward(const scalar_t* pose, const CapsuleStrides& pose_strides,
                                 const scalar_t* weight, const scalar_t* a_in,
                                 const scalar_t* beta_u, const EmBackwardArgs& args,
                                 const EmDims& dims, double eps, const CapsuleStrides& grad_strides,
                                 scalar_t* grad_pose, acc_t* g_a, acc_t* g_W) {
  const int64_t splits = em_splits(dims);  // for every chunk: the same sums whatever the chunking
  const EmLanes lanes = em_lanes(dims);
  const int64_t chunk = std::min(dims.B, pose_backward_chunk(dims, splits, sizeof(acc_t)));
  const auto acc_options = args.stats.options();
  EmDims chunk_dims = dims;
  chunk_dims.B = chunk;
  // Reused by every chunk: stream order runs each chunk's kernels after the previous chunk's.
  const EmBackwardBuffers<acc_t> buf =
      make_em_backward_buffers<acc_t>(chunk_dims, splits, acc_options);
  at::Tensor g_V_buffer = at::empty({chunk, dims.I, dims.J, kPoseSize}, acc_options);
  run_pose_backward(StreamLaunch{c10::cuda::getCurrentCUDAStream()}, pose, pose_strides, weight,
                    a_in, beta_u, args.stats.const_data_ptr<acc_t>(),
                    args.grad_pose.const_data_ptr<acc_t>(), args.grad_a_out.const_data_ptr<acc_t>(),
                    dims, static_cast<acc_t>(eps), splits, lanes, chunk, buf.ws,
                    g_V_buffer.mutable_data_ptr<acc_t>(), grad_strides, grad_pose, g_a, g_W,
                    args.grad_beta_items.mutable_data_ptr<acc_t>());
  return em_path(lanes);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
em_routing_pose_backward_cuda(const at::Tensor& grad_pose_out_in, const at::Tensor& grad_a_out_in,
                              const at::Tensor& pose_in, const at::Tensor& weight_in,
                              const at::Tensor& a_in_in, const at::Tensor& beta_u_in,
                              const at::Tensor& beta_a_in, const at::Tensor& stats_in,
                              double final_lambda, double eps) {
  check_em_routing_pose_backward_inputs(grad_pose_out_in, grad_a_out_in, pose_in, weight_in,
                                        a_in_in, beta_u_in, beta_a_in, stats_in, final_lambda, eps);
  const int64_t iters = stats_in.size(1);
  const int64_t B = pose_in.size(0), I = pose_in.size(1), J = weight_in.size(1);
  check_cuda(pose_in, "pose");
  const c10::cuda::CUDAGuard guard(pose_in.device());
  const EmDims dims{B, I, J, kPoseSize, iters, final_lambda};
  const EmBackwardArgs args =
      prepare_em_backward(grad_pose_out_in, grad_a_out_in, stats_in, pose_in, "pose", B, J);
  const at::Tensor pose = with_contiguous_capsules(pose_in, 2), weight = weight_in.contiguous(),
                   a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous();
  at::Tensor grad_pose = empty_capsule_gradient(pose, 2);
  at::Tensor grad_a_in = at::empty_like(a_in);
  // With B == 0 the sum over the batch is empty: a zero weight gradient.
  at::Tensor grad_weight = B == 0 ? at::zeros_like(weight) : at::empty_like(weight);

  if (B > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, pose.scalar_type(), "em_routing_pose_backward_cuda", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          at::Tensor g_a = acc_buffer_for(grad_a_in), g_W = acc_buffer_for(grad_weight);
          record_kernel_path(
              "em_routing_pose", Direction::backward,
              launch_pose_backward<scalar_t, acc_t>(
                  pose.const_data_ptr<scalar_t>(), capsule_strides(pose, 2),
                  weight.const_data_ptr<scalar_t>(), a_in.const_data_ptr<scalar_t>(),
                  beta_u.const_data_ptr<scalar_t>(), args, dims, eps, capsule_strides(grad_pose, 2),
                  grad_pose.mutable_data_ptr<scalar_t>(), g_a.mutable_data_ptr<acc_t>(),
                  g_W.mutable_data_ptr<acc_t>()));
          copy_from_acc_buffer(grad_a_in, g_a);
          copy_from_acc_buffer(grad_weight, g_W);
        });
  }
  const auto [grad_beta_u, grad_beta_a] = args.beta_grads(pose.scalar_type());
  return {grad_pose, grad_weight, grad_a_in, grad_beta_u, grad_beta_a};
}

}  // namespace
}  // namespace cuda

TORCH_LIBRARY_IMPL(capsroute, CUDA, m) {
  m.impl("em_routing_pose", &cuda::em_routing_pose_cuda);
  m.impl("_em_routing_pose_backward", &cuda::em_routing_pose_backward_cuda);
}

}  // namespace capsroute
