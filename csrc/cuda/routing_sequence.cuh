// The launch sequences of the routing forward and backward over given workspaces, through a
// `launch(kernel, blocks, args...)` callable that runs `kernel` on `blocks` blocks of kBlockThreads
// threads: routing_launch.cuh passes one that launches on the current CUDA stream, and
// tests/emulator one that runs the kernels on the host, so the emulator checks this very code.
// No CUDA runtime or ATen here: kernels and host arithmetic only.
#pragma once

#include <cstdint>

#include "routing_kernels.cuh"

namespace capsroute {
namespace cuda {

// The forward of B > 0 elements in `splits` row ranges each (1: the fused kernel). partial
// holds B * splits * J * D values when splits > 1.
template <typename Launch, typename Source, typename scalar_t>
void run_routing_forward(const Launch& launch, const Source& src, const scalar_t* bias, const RoutingDims& dims,
                         typename Source::acc_type eps, int64_t splits,
                         const ForwardWorkspace<typename Source::acc_type>& ws, typename Source::acc_type* partial,
                         typename Source::acc_type* s_hist, scalar_t* v, scalar_t* c) {
  using acc_t = typename Source::acc_type;
  if (splits == 1) {
    launch(routing_forward_kernel<Source, scalar_t>, blocks_for_items(dims.B), src, bias, dims, eps, ws, s_hist, v, c);
    return;
  }
  for (int64_t r = 0; r < dims.iters; ++r) {
    launch(routing_forward_rows_kernel<Source, scalar_t>, blocks_for_items(dims.B * splits), src, dims, splits, r, ws,
           c, partial);
    launch(routing_forward_reduce_kernel<scalar_t, acc_t>, blocks_for_items(dims.B), static_cast<const acc_t*>(partial),
           splits, bias, dims, r, eps, ws.v, s_hist, v);
  }
}

// The backward of B > 0 elements: fills the state st and grad_bias (B, J, D). grad_v and s_hist
// in the accumulation dtype; partial as for the forward when splits > 1 and a step is walked back.
template <typename Launch, typename Source>
void run_routing_backward(const Launch& launch, const Source& src, const typename Source::acc_type* grad_v,
                          const typename Source::acc_type* s_hist, const RoutingDims& dims,
                          typename Source::acc_type eps, int64_t splits,
                          const BackwardState<typename Source::acc_type>& st,
                          const BackwardWorkspace<typename Source::acc_type>& ws, typename Source::acc_type* partial,
                          typename Source::acc_type* grad_bias) {
  using acc_t = typename Source::acc_type;
  const int64_t B = dims.B, R = dims.iters;
  if (splits == 1) {
    launch(routing_backward_kernel<Source>, blocks_for_items(B), src, grad_v, s_hist, dims, eps, st, ws, grad_bias);
    return;
  }
  launch(routing_backward_start_kernel<acc_t>, blocks_for_items(B), grad_v, s_hist, dims, eps, st, ws.gv);
  launch(routing_coupling_rows_kernel<Source>, blocks_for_items(B * splits), src, dims, splits, st, ws.logits);
  if (R - 1 == st.first_r) launch(routing_sum_gs_kernel<acc_t>, blocks_for_items(B), dims, st, grad_bias);
  for (int64_t r = R - 1; r > st.first_r; --r) {
    launch(routing_backward_rows_kernel<Source>, blocks_for_items(B * splits), src, dims, splits, r, st, partial);
    launch(routing_backward_reduce_kernel<acc_t>, blocks_for_items(B), static_cast<const acc_t*>(partial), splits,
           s_hist, dims, r, eps, st, ws.gv, grad_bias);
  }
}

}  // namespace cuda
}  // namespace capsroute
