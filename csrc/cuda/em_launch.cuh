// Host-side setup shared by the EM routing CUDA ops (em_routing_cuda.cu and
// em_routing_pose_cuda.cu): the launch sequences of em_sequence.cuh on the current stream with
// their workspaces, the forward's outputs, the backward's device checks and conversions to the
// accumulation dtype, its accumulation buffers and the batch sum of the beta gradients.
// The callers hold a c10::cuda::CUDAGuard on the device of `ref` while these run.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "em_kernels.cuh"
#include "em_sequence.cuh"
#include "host_checks.cuh"
#include "kernel_options.h"
#include "stream_launcher.cuh"

namespace capsroute {
namespace cuda {

// The row ranges per element of the EM kernels (em_sequence.cuh): 1 when B blocks fill the GPU,
// else enough for about 4 blocks per SM, each at least kEmMinSplitRows rows (4 per warp).
// CAPSROUTE_EM_SPLITS=N forces N ranges (tests run several on small shapes).
constexpr int64_t kEmMinSplitRows = 32;

inline int64_t em_splits(const EmDims& dims) {
  if (const std::optional<int64_t> forced = forced_count("CAPSROUTE_EM_SPLITS")) return *forced;
  return row_ranges_to_fill_device(dims.B, dims.I, kEmMinSplitRows);
}

// How the rows kernels' warps cover a row (em_kernels.cuh, EmLanes; CAPSROUTE_EM_LANES,
// kernel_options.h): a lane per (j, h) entry where H divides the warp size, else a lane per
// capsule.
inline EmLanes em_lanes(const EmDims& dims) {
  const bool fits = em_column_lanes_fit(dims.H);
  switch (em_lanes_mode()) {
    case EmLanesMode::capsule:
      return EmLanes::capsule;
    case EmLanesMode::column:
      TORCH_CHECK(fits, "capsroute: CAPSROUTE_EM_LANES=column needs a capsule size H that divides ",
                  kWarpSize, ", got H = ", dims.H);
      return EmLanes::column;
    case EmLanesMode::automatic:
      break;
  }
  return fits ? EmLanes::column : EmLanes::capsule;
}

// The EM path, as capsroute.last_kernel_path() names it.
inline const char* em_path(EmLanes lanes) {
  return lanes == EmLanes::column ? "em-column-lanes" : "em-row-ranges";
}

// Allocates the workspaces and launches the forward on the current stream (B > 0); returns the
// path it ran (em_path).
template <typename Source, typename scalar_t>
const char* launch_em_forward(const Source& src, const scalar_t* a_in, const scalar_t* beta_u,
                              const scalar_t* beta_a, const EmDims& dims, double eps,
                              at::Tensor& stats, at::Tensor& pose, at::Tensor& a_out) {
  using acc_t = typename Source::acc_type;
  const auto acc_options = stats.options();
  const int64_t splits = em_splits(dims);
  const EmLanes lanes = em_lanes(dims);
  at::Tensor R = at::empty({dims.B, dims.I, dims.J}, acc_options);
  at::Tensor mass = at::empty({dims.B, dims.J}, acc_options);
  at::Tensor norm = at::empty({dims.B, dims.J}, acc_options);
  at::Tensor partial = at::empty({dims.B, splits, dims.J * (dims.H + 1)}, acc_options);
  const EmForwardWorkspace<acc_t> ws{R.mutable_data_ptr<acc_t>(), mass.mutable_data_ptr<acc_t>(),
                                     norm.mutable_data_ptr<acc_t>(),
                                     partial.mutable_data_ptr<acc_t>()};
  run_em_forward(StreamLaunch{c10::cuda::getCurrentCUDAStream()}, src, a_in, beta_u, beta_a, dims,
                 static_cast<acc_t>(eps), splits, lanes, ws, stats.mutable_data_ptr<acc_t>(),
                 pose.mutable_data_ptr<scalar_t>(), a_out.mutable_data_ptr<scalar_t>());
  // The workspaces go back to the caching allocator on this stream: later work on the stream
  // runs after the kernels, so reusing them is safe.
  return em_path(lanes);
}

// Owns the backward workspaces for B elements (dims.B) in `splits` row ranges each; the kernels
// may run over any contiguous range of at most that many elements, one after another on the stream.
template <typename acc_t>
struct EmBackwardBuffers {
  at::Tensor R_hist, g_R, norm, g_mu, g_var, g_logit, mass, g_mass, partial_cols, partial_mass;
  EmBackwardWorkspace<acc_t> ws;
};

template <typename acc_t>
EmBackwardBuffers<acc_t> make_em_backward_buffers(const EmDims& dims, int64_t splits,
                                                  const at::TensorOptions& acc_options) {
  const int64_t B = dims.B, I = dims.I, J = dims.J, H = dims.H, R = dims.iters;
  EmBackwardBuffers<acc_t> buf;
  buf.R_hist = at::empty({B, R, I, J}, acc_options);
  buf.g_R = at::empty({B, I, J}, acc_options);
  buf.norm = at::empty({B, R, J}, acc_options);
  buf.g_mu = at::empty({B, J, H}, acc_options);
  buf.g_var = at::empty({B, J, H}, acc_options);
  buf.g_logit = at::empty({B, J}, acc_options);
  buf.mass = at::empty({B, J}, acc_options);
  buf.g_mass = at::empty({B, J}, acc_options);
  buf.partial_cols = at::empty({B, splits, J * (2 * H + 1)}, acc_options);
  buf.partial_mass = at::empty({B, splits, R * J}, acc_options);
  buf.ws = EmBackwardWorkspace<acc_t>{buf.R_hist.template mutable_data_ptr<acc_t>(),
                                      buf.g_R.template mutable_data_ptr<acc_t>(),
                                      buf.norm.template mutable_data_ptr<acc_t>(),
                                      buf.g_mu.template mutable_data_ptr<acc_t>(),
                                      buf.g_var.template mutable_data_ptr<acc_t>(),
                                      buf.g_logit.template mutable_data_ptr<acc_t>(),
                                      buf.mass.template mutable_data_ptr<acc_t>(),
                                      buf.g_mass.template mutable_data_ptr<acc_t>(),
                                      buf.partial_cols.template mutable_data_ptr<acc_t>(),
                                      buf.partial_mass.template mutable_data_ptr<acc_t>()};
  return buf;
}

// Allocates the workspaces and launches the backward on the current stream (B > 0). stats,
// grad_pose and grad_a_out in the accumulation dtype; g_V (B, I, J, H, rows at any strides over
// b and i, as MemoryVotes), g_a (B, I) and g_beta (B, 2, J) receive the gradients (accumulation
// dtype; g_a and g_beta contiguous). Returns the path it ran.
template <typename Source, typename scalar_t>
const char* launch_em_backward(const Source& src, const scalar_t* a_in, const scalar_t* beta_u,
                               const at::Tensor& stats, const at::Tensor& grad_pose,
                               const at::Tensor& grad_a_out, const EmDims& dims, double eps,
                               at::Tensor& g_V, at::Tensor& g_a, at::Tensor& g_beta) {
  using acc_t = typename Source::acc_type;
  // Freed on return: later work on the stream runs after the kernel, so reusing them is safe.
  const int64_t splits = em_splits(dims);
  const EmLanes lanes = em_lanes(dims);
  const EmBackwardBuffers<acc_t> buf =
      make_em_backward_buffers<acc_t>(dims, splits, stats.options());
  const EmGrads<acc_t> out{g_V.mutable_data_ptr<acc_t>(), capsule_strides(g_V, 2),
                           g_a.mutable_data_ptr<acc_t>(), g_beta.mutable_data_ptr<acc_t>()};
  run_em_backward(StreamLaunch{c10::cuda::getCurrentCUDAStream()}, src, a_in, beta_u,
                  stats.const_data_ptr<acc_t>(), grad_pose.const_data_ptr<acc_t>(),
                  grad_a_out.const_data_ptr<acc_t>(), dims, static_cast<acc_t>(eps), splits, lanes,
                  buf.ws, out);
  return em_path(lanes);
}

// pose (B, J, H) and a_out (B, J) in ref's dtype; stats (B, iters, J, 2H + 1) in the
// accumulation dtype, the layout the CPU writes (the backwards of both backends read either).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> em_forward_outputs(const at::Tensor& ref,
                                                                         const EmDims& dims) {
  return {at::empty({dims.B, dims.J, dims.H}, ref.options()),
          at::empty({dims.B, dims.J}, ref.options()),
          at::empty({dims.B, dims.iters, dims.J, 2 * dims.H + 1},
                    ref.options().dtype(acc_dtype(ref.scalar_type())))};
}

// What every EM backward needs besides its op's own inputs, on ref's device.
struct EmBackwardArgs {
  at::Tensor grad_pose, grad_a_out, stats;  // accumulation dtype, contiguous
  at::Tensor grad_beta_items;  // (B, 2, J) per element [beta_u | beta_a], accumulation dtype

  // The beta gradients: the per-element rows summed over the batch (a reduction in a fixed
  // order: deterministic), in the given dtype; two tensors of their own, since the schema's
  // outputs must not alias (opcheck).
  std::pair<at::Tensor, at::Tensor> beta_grads(at::ScalarType dtype) const {
    return {grad_beta_items.select(1, 0).sum(0).to(dtype),
            grad_beta_items.select(1, 1).sum(0).to(dtype)};
  }
};

// The shapes must have been checked (check_em_backward_inputs); this checks devices and
// converts. ref is the op's main input (votes or pose), already checked to be a CUDA tensor.
inline EmBackwardArgs prepare_em_backward(const at::Tensor& grad_pose, const at::Tensor& grad_a_out,
                                          const at::Tensor& stats, const at::Tensor& ref,
                                          const char* ref_name, int64_t B, int64_t J) {
  check_same_device(grad_pose, ref, "grad_pose", ref_name);
  check_same_device(grad_a_out, ref, "grad_a_out", ref_name);
  check_same_device(stats, ref, "stats", ref_name);
  const at::ScalarType acc = acc_dtype(ref.scalar_type());
  return {grad_pose.to(acc).contiguous(), grad_a_out.to(acc).contiguous(),
          stats.to(acc).contiguous(), at::empty({B, 2, J}, ref.options().dtype(acc))};
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
