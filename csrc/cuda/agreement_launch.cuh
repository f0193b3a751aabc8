// Host side of the routing kernels: how an element's rows are split (routing_row_split), the
// workspaces, and the launch sequences of agreement_sequence.cuh on the current stream.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "../common/kernel_path.h"
#include "agreement_block_kernels.cuh"
#include "agreement_sequence.cuh"
#include "host_checks.cuh"
#include "kernel_options.h"
#include "stream_launcher.cuh"

namespace capsroute {
namespace cuda {

// Row ranges per element for a batch of B: 1 (the fused kernels, or with the warp-rows kernels
// one range of 8 warp parts) when B blocks fill the GPU, else enough ranges for about
// kBlocksPerSm blocks per SM (the block kernels) or one wave of the warp kernels' resident blocks,
// each at least kMinSplitTiles tiles long. CAPSROUTE_ROUTING_SPLITS=N forces N (tests run both
// paths on small shapes).
constexpr int64_t kMinSplitTiles = 4;

inline int64_t routing_splits(const RoutingDims& dims, bool warp_rows, int64_t warp_blocks_per_sm) {
  if (const std::optional<int64_t> forced = forced_count("CAPSROUTE_ROUTING_SPLITS"))
    return *forced;
  const int64_t min_rows = kMinSplitTiles * kRoutingTile;
  return warp_rows ? row_ranges_in_one_wave(dims.B, dims.I, min_rows, warp_blocks_per_sm)
                   : row_ranges_to_fill_device(dims.B, dims.I, min_rows);
}

// The warp-rows kernels where the rule is dynamic routing's and the capsules fit them
// (agreement_warp_rows_kernels.cuh), else the block kernels (agreement_block_kernels.cuh).
template <typename Source>
RowSplit routing_row_split(const RoutingDims& dims,
                           const RoutingRule<typename Source::acc_type>& rule) {
  const bool warp_rows = is_dynamic_routing_rule(rule) && warp_rows_fit(dims);
  return {routing_splits(dims, warp_rows, warp_rows_min_blocks<typename Source::acc_type>()),
          warp_rows};
}

// Whether the warp rows' forward or backward should run an element per cluster of
// cluster_blocks blocks instead (the cluster `kernel`, agreement_cluster_kernels.cuh;
// routing_cluster_mode): the kernel loaded as code built for sm_90 or later (elsewhere its body
// traps), its blocks' shared memory within the device's, clusters of that size schedulable (16
// blocks is beyond the portable 8: a GPU that refuses says so through the occupancy query), and,
// unless forced, at least half as many elements as clusters fit on the GPU at once (with fewer,
// the warp rows' row ranges keep more of it busy).
template <typename Kernel>
bool use_clusters(Kernel kernel, const RoutingDims& dims, int cluster_blocks,
                  int64_t shared_bytes) {
  const ClusterMode mode = routing_cluster_mode();
  if (mode == ClusterMode::off) return false;
  const auto cannot = [&](const char* why) {
    TORCH_CHECK(mode != ClusterMode::force, "capsroute: CAPSROUTE_ROUTING_CLUSTER=force, but ",
                why);
    return false;
  };
  const void* function = reinterpret_cast<const void*>(kernel);
  const ClusterKernelSetup setup = cluster_kernel_setup(function);
  if (setup.ptx_version < 90) return cannot("the loaded kernels were not built for sm_90 or later");
  if (shared_bytes > setup.max_dynamic_shared_bytes)
    return cannot("a cluster block's shared memory exceeds the device's");
  const int resident = resident_clusters(function, cluster_blocks, shared_bytes);
  if (resident == 0) return cannot("the device cannot schedule these clusters");
  return mode == ClusterMode::force || 2 * dims.B >= resident;
}

// The routing path a split runs, as capsroute.last_kernel_path() names it: an element per
// cluster, warp rows, or the block kernels (capsules the warp rows do not fit). `cluster`: the
// direction's cluster flag.
inline std::string routing_path_name(const RowSplit& split, bool cluster) {
  if (cluster) return "v2-cluster";
  if (split.warp_rows) return "v2-warp-rows";
  return "v2-block";
}

// A workspace of the given sizes where `needed`, else an undefined tensor; and its data or nullptr.
inline at::Tensor optional_workspace(bool needed, at::IntArrayRef sizes,
                                     const at::TensorOptions& options) {
  return needed ? at::empty(sizes, options) : at::Tensor();
}
template <typename acc_t>
acc_t* data_or_null(at::Tensor& t) {
  return t.defined() ? t.mutable_data_ptr<acc_t>() : nullptr;
}

// Allocates the workspaces and launches the forward under `rule` on the current stream (B > 0);
// c undefined: the couplings are not written. Returns the routing path it ran (routing_path_name).
template <typename Source, typename scalar_t>
std::string launch_routing_forward(const Source& src, const scalar_t* bias, const RoutingDims& dims,
                                   double eps, at::Tensor& s_hist, at::Tensor& v,
                                   const at::Tensor& c,
                                   const RoutingRule<typename Source::acc_type>& rule = {}) {
  using acc_t = typename Source::acc_type;
  const auto acc_options = s_hist.options();
  RowSplit split = routing_row_split<Source>(dims, rule);
  if (split.warp_rows)
    split.cluster_forward =
        use_clusters(routing_forward_cluster_kernel<Source, scalar_t, kWarpRowMaxD>, dims,
                     kClusterBlocks, cluster_forward_shared_bytes(dims, sizeof(acc_t)));
  // (The warp kernels keep a row's couplings in registers; the cluster kernel keeps everything on
  // chip.)
  at::Tensor logits =
      optional_workspace(!split.cluster_forward, {dims.B, dims.I, dims.J}, acc_options);
  at::Tensor coupling = optional_workspace(!split.warp_rows, {dims.B, dims.I, dims.J}, acc_options);
  at::Tensor v_ws =
      optional_workspace(!split.cluster_forward, {dims.B, dims.J, dims.D}, acc_options);
  const ForwardWorkspace<acc_t> ws{data_or_null<acc_t>(logits), data_or_null<acc_t>(coupling),
                                   data_or_null<acc_t>(v_ws)};
  at::Tensor partial = optional_workspace(!split.fused() && !split.cluster_forward,
                                          {dims.B, split.parts(), dims.J, dims.D}, acc_options);
  run_routing_forward(StreamLaunch{c10::cuda::getCurrentCUDAStream()}, src, bias, dims,
                      static_cast<acc_t>(eps), split, ws, data_or_null<acc_t>(partial),
                      s_hist.mutable_data_ptr<acc_t>(), v.mutable_data_ptr<scalar_t>(),
                      c.defined() ? c.mutable_data_ptr<scalar_t>() : nullptr, rule);
  // The workspaces go back to the caching allocator on this stream: later work on the stream
  // runs after the kernels, so reusing them is safe.
  return routing_path_name(split, split.cluster_forward);
}

// Owns the backward buffers (they must outlive every kernel that reads the state; stream
// order makes freeing them afterwards safe). vote_grad_written: the backward wrote the vote
// gradient itself (the cluster backward), and the state is empty. path: the routing path it ran.
template <typename acc_t>
struct BackwardBuffers {
  at::Tensor v_hist, gs_hist, coupling, g_logits;
  BackwardState<acc_t> state;
  bool vote_grad_written;
  std::string path;
};

// Allocates the state, launches the backward kernels under `rule` on the current stream (B > 0)
// and returns the state for the op-specific vote-gradient kernels, or, where the cluster backward
// runs (sm_90), writes the vote gradient to grad_votes (B, I, J, D, rows at grad_rows) itself.
// grad_v (B, J, D) is in the accumulation dtype; grad_bias_items (B, J, D) of sum_r gs^r, or
// undefined where not wanted; grads: the rule's parameter gradient items (zeroed buffers).
template <typename Source, typename grad_t>
BackwardBuffers<typename Source::acc_type> launch_routing_backward(
    const Source& src, const typename Source::acc_type* grad_v, const at::Tensor& s_hist,
    const RoutingDims& dims, bool detach, double eps, at::Tensor& grad_bias_items,
    const CapsuleStrides& grad_rows, grad_t* grad_votes,
    const RoutingRule<typename Source::acc_type>& rule = {},
    const RuleGradItems<typename Source::acc_type>& grads = {}) {
  using acc_t = typename Source::acc_type;
  const int64_t B = dims.B, I = dims.I, J = dims.J, D = dims.D, R = dims.iters;
  const int64_t first_r = detach ? R - 1 : 0, nkeep = R - first_r;
  const auto acc_options = s_hist.options();
  RowSplit split = routing_row_split<Source>(dims, rule);
  if (split.warp_rows)
    split.cluster_backward = use_clusters(
        routing_backward_cluster_kernel<Source, grad_t, kWarpRowMaxD>, dims, kBackwardClusterBlocks,
        cluster_backward_shared_bytes(dims, nkeep, sizeof(acc_t)));
  // (The cluster backward keeps its state on chip; the warp kernels keep a row's logits in
  // registers.)
  const bool state = !split.cluster_backward;
  at::Tensor v_hist = optional_workspace(state, {B, R, J, D}, acc_options);
  at::Tensor gs_hist = optional_workspace(state, {B, nkeep, J, D}, acc_options);
  at::Tensor coupling = optional_workspace(state, {B, nkeep, I, J}, acc_options);
  at::Tensor g_logits = optional_workspace(state, {B, nkeep, I, J}, acc_options);
  const BackwardState<acc_t> st{data_or_null<acc_t>(v_hist),
                                data_or_null<acc_t>(gs_hist),
                                data_or_null<acc_t>(coupling),
                                data_or_null<acc_t>(g_logits),
                                I,
                                J,
                                D,
                                R,
                                first_r,
                                nkeep,
                                grads};
  at::Tensor logits = optional_workspace(state && !split.warp_rows, {B, I, J}, acc_options);
  at::Tensor gv = optional_workspace(state, {B, J, D}, acc_options);
  const BackwardWorkspace<acc_t> ws{data_or_null<acc_t>(logits), data_or_null<acc_t>(gv)};
  at::Tensor partial = optional_workspace(state && !split.fused() && R - 1 > first_r,
                                          {B, split.parts(), J, D}, acc_options);
  run_routing_backward(StreamLaunch{c10::cuda::getCurrentCUDAStream()}, src, grad_v,
                       s_hist.const_data_ptr<acc_t>(), dims, static_cast<acc_t>(eps), split, st, ws,
                       data_or_null<acc_t>(partial), data_or_null<acc_t>(grad_bias_items),
                       grad_rows, grad_votes, rule);
  return BackwardBuffers<acc_t>{v_hist,
                                gs_hist,
                                coupling,
                                g_logits,
                                st,
                                split.cluster_backward,
                                routing_path_name(split, split.cluster_backward)};
}

}  // namespace cuda
}  // namespace capsroute
