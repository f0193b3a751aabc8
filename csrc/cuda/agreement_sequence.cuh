// The launch sequences of the routing forward and backward over given workspaces, through a
// `launch(kernel, blocks, args...)` callable that runs `kernel` on `blocks` blocks of kBlockThreads
// threads: agreement_launch.cuh passes one that launches on the current CUDA stream, and
// tests/emulator one that runs the kernels on the host, so the emulator checks this very code.
// No CUDA runtime or ATen here: kernels and host arithmetic only.
#pragma once

#include <cstdint>

#include "agreement_block_kernels.cuh"
#include "agreement_cluster_kernels.cuh"
#include "agreement_warp_rows_kernels.cuh"

namespace capsroute {
namespace cuda {

// How an element's rows are routed: in `splits` ranges of a block each (the block kernels;
// splits = 1 is the fused kernel), or with warp_rows, each range cut again among its block's
// warps (agreement_warp_rows_kernels.cuh, where warp_rows_fit). Either way the rows kernels leave
// parts() partial sums per element for the reduce kernels. With cluster_forward (and warp_rows)
// the forward is instead one launch of an element per cluster (agreement_cluster_kernels.cuh,
// sm_90, use_clusters), and with cluster_backward the backward, vote gradient included.
struct RowSplit {
  int64_t splits;
  bool warp_rows;
  bool cluster_forward = false;
  bool cluster_backward = false;
  int64_t parts() const { return warp_rows ? splits * kWarpsPerBlock : splits; }
  bool fused() const { return !warp_rows && splits == 1; }
};

// Bytes of dynamic shared memory of routing_forward_cluster_kernel's and
// routing_backward_cluster_kernel's blocks.
inline int64_t cluster_forward_shared_bytes(const RoutingDims& dims, int64_t acc_bytes) {
  return ClusterForwardLayout(dims).size() * acc_bytes;
}
inline int64_t cluster_backward_shared_bytes(const RoutingDims& dims, int64_t nkeep,
                                             int64_t acc_bytes) {
  return ClusterBackwardLayout(dims, nkeep).size() * acc_bytes;
}

// Whether a rule is dynamic routing's, the only one the warp-rows and cluster kernels run (every
// rule runs on the block kernels).
template <typename acc_t>
bool is_dynamic_routing_rule(const RoutingRule<acc_t>& rule) {
  return rule.logits == LogitRule::accumulate && rule.nonlinearity == Nonlinearity::squash &&
         rule.coupling_bias == nullptr && rule.norm_weight == nullptr && rule.norm_bias == nullptr;
}

// The forward of B > 0 elements under `rule` (the warp rows and clusters: dynamic routing's).
// partial holds B * split.parts() * J * D values unless fused; c nullptr: no couplings written.
template <typename Launch, typename Source, typename scalar_t>
void run_routing_forward(const Launch& launch, const Source& src, const scalar_t* bias,
                         const RoutingDims& dims, typename Source::acc_type eps,
                         const RowSplit& split,
                         const ForwardWorkspace<typename Source::acc_type>& ws,
                         typename Source::acc_type* partial, typename Source::acc_type* s_hist,
                         scalar_t* v, scalar_t* c,
                         const RoutingRule<typename Source::acc_type>& rule = {}) {
  using acc_t = typename Source::acc_type;
  const int64_t B = dims.B, parts = split.parts();
  if (split.fused()) {
    launch(routing_forward_kernel<Source, scalar_t>, blocks_for_items(B), src, bias, dims, eps,
           rule, ws, s_hist, v, c);
    return;
  }
  // Per iteration r: launch_rows(r) leaves each part's sums in partial, then s^r and v^r.
  const auto iterate = [&](const auto& launch_rows) {
    for (int64_t r = 0; r < dims.iters; ++r) {
      launch_rows(r);
      launch(routing_forward_reduce_kernel<scalar_t, acc_t>, blocks_for_items(B),
             static_cast<const acc_t*>(partial), parts, bias, dims, r, eps, rule, ws.v, s_hist, v);
    }
  };
  if (split.cluster_forward) {
    launch.cluster(routing_forward_cluster_kernel<Source, scalar_t, kWarpRowMaxD>,
                   blocks_for_items(B), kClusterBlocks,
                   cluster_forward_shared_bytes(dims, sizeof(acc_t)), src, bias, dims, eps, s_hist,
                   v, c);
    return;
  }
  if (split.warp_rows)
    return iterate([&](int64_t r) {
      launch(routing_forward_warp_rows_kernel<Source, scalar_t, kWarpRowMaxD>,
             blocks_for_warps(B * parts), src, dims, parts, r, ws, c, partial);
    });
  iterate([&](int64_t r) {
    launch(routing_forward_rows_kernel<Source, scalar_t>, blocks_for_items(B * parts), src, dims,
           parts, r, rule, ws, c, partial);
  });
}

// The backward of B > 0 elements under `rule`: fills the state st (with the rule's parameter
// gradient items, st.grads) and grad_bias (B, J, D; may be null), from which the op writes its
// vote gradient; with split.cluster_backward instead writes grad_votes (B, I, J, D, rows at
// grad_rows) and grad_bias, and leaves st alone (only st.first_r is read; its buffers and ws may
// be null). grad_v and s_hist in the accumulation dtype; partial as for the forward unless fused,
// when a step is walked back.
template <typename Launch, typename Source, typename grad_t>
void run_routing_backward(const Launch& launch, const Source& src,
                          const typename Source::acc_type* grad_v,
                          const typename Source::acc_type* s_hist, const RoutingDims& dims,
                          typename Source::acc_type eps, const RowSplit& split,
                          const BackwardState<typename Source::acc_type>& st,
                          const BackwardWorkspace<typename Source::acc_type>& ws,
                          typename Source::acc_type* partial, typename Source::acc_type* grad_bias,
                          const CapsuleStrides& grad_rows, grad_t* grad_votes,
                          const RoutingRule<typename Source::acc_type>& rule = {}) {
  using acc_t = typename Source::acc_type;
  const int64_t B = dims.B, R = dims.iters, parts = split.parts();
  if (split.cluster_backward) {
    launch.cluster(routing_backward_cluster_kernel<Source, grad_t, kWarpRowMaxD>,
                   blocks_for_items(B), kBackwardClusterBlocks,
                   cluster_backward_shared_bytes(dims, st.nkeep, sizeof(acc_t)), src, grad_v,
                   s_hist, dims, eps, st.first_r, grad_bias, grad_rows, grad_votes);
    return;
  }
  if (split.fused()) {
    launch(routing_backward_kernel<Source>, blocks_for_items(B), src, grad_v, s_hist, dims, eps,
           rule, st, ws, grad_bias);
    return;
  }
  // launch_coupling_rows() recomputes the kept couplings (and with coupling_walks_back takes the
  // first step back too); per step r walked back, launch_step_rows(r) leaves each part's share of
  // gv^{r-1} in partial, then gs^{r-1}.
  const auto walk_back = [&](bool coupling_walks_back, const auto& launch_coupling_rows,
                             const auto& launch_step_rows) {
    launch(routing_backward_start_kernel<acc_t>, blocks_for_items(B), grad_v, s_hist, dims, eps,
           rule, st, ws.gv);
    launch_coupling_rows();
    if (R - 1 == st.first_r)
      launch(routing_sum_gs_kernel<acc_t>, blocks_for_items(B), dims, st, grad_bias);
    for (int64_t r = R - 1; r > st.first_r; --r) {
      if (r < R - 1 || !coupling_walks_back) launch_step_rows(r);
      launch(routing_backward_reduce_kernel<acc_t>, blocks_for_items(B),
             static_cast<const acc_t*>(partial), parts, s_hist, dims, r, eps, rule, st, ws.gv,
             grad_bias);
    }
  };
  if (split.warp_rows)
    return walk_back(
        true,
        [&] {
          launch(routing_coupling_warp_rows_kernel<Source, kWarpRowMaxD>,
                 blocks_for_warps(B * parts), src, dims, parts, st, partial);
        },
        [&](int64_t r) {
          launch(routing_backward_warp_rows_kernel<Source, kWarpRowMaxD>,
                 blocks_for_warps(B * parts), src, dims, parts, r, st, partial);
        });
  walk_back(
      false,
      [&] {
        launch(routing_coupling_rows_kernel<Source>, blocks_for_items(B * parts), src, dims, parts,
               rule, st, ws.logits);
      },
      [&](int64_t r) {
        launch(routing_backward_rows_kernel<Source>, blocks_for_items(B * parts), src, dims, parts,
               r, rule, st, partial);
      });
}

}  // namespace cuda
}  // namespace capsroute
