// An agreement routing of a batch of elements, each on its own votes, in parallel over the
// elements: the loops of the CPU kernels of dynamic_routing and the attention routings
// (agreement_routing_cpu.cpp), shared with the ops that make their votes first
// (conv_dynamic_routing routes a chunk of output positions at a time).
#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "../common/dims.h"
#include "../common/layout.h"
#include "agreement_element.h"

namespace capsroute {
namespace cpu {

// Routes elements [0, dims.B) of votes (B, I, J, D) at `strides` (each capsule contiguous) under
// `rule`: v (B, J, D) and c (B, I, J) (nullptr: not written) in out_t, s_hist (B, iters, J, D) in
// the accumulation type.
template <typename vote_t, typename out_t, typename acc_t>
void route_elements(const vote_t* votes, const CapsuleStrides& strides, const vote_t* bias,
                    const RoutingRule<acc_t>& rule, const RoutingDims& dims, acc_t eps,
                    acc_t* s_hist, out_t* v, out_t* c) {
  dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
    at::parallel_for(0, dims.B, 1, [&](int64_t begin, int64_t end) {
      ForwardScratch<acc_t> scratch(dims);
      std::vector<vote_t> slab;
      for (int64_t n = begin; n < end; ++n) {
        route_forward<decltype(capsule_dim)::value>(
            staged_element_votes(votes, strides, n, dims.I, dims.J, dims.D, slab), bias, rule, dims,
            eps, scratch, s_hist + n * dims.iters * dims.jd(), v + n * dims.jd(),
            c ? c + n * dims.I * dims.J : nullptr);
      }
    });
  });
}

// The backward of route_elements: given g_v (B, J, D) and s_hist, writes the vote gradient at
// grad_strides and each element's parameter gradients into the items of grad_items (B, ...), for
// the caller to sum in a fixed order.
template <typename vote_t, typename grad_t, typename acc_t>
void route_elements_backward(const vote_t* votes, const CapsuleStrides& strides, const acc_t* g_v,
                             const acc_t* s_hist, const RoutingRule<acc_t>& rule,
                             const RoutingDims& dims, acc_t eps, bool detach,
                             const ParameterGrads<acc_t>& grad_items, grad_t* grad_votes,
                             const CapsuleStrides& grad_strides) {
  dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
    at::parallel_for(0, dims.B, 1, [&](int64_t begin, int64_t end) {
      RoutingBackward<decltype(capsule_dim)::value, acc_t> backward(dims, rule, eps, detach);
      std::vector<acc_t> state_storage(BackwardState<acc_t>::numel(dims));
      const BackwardState<acc_t> state(state_storage.data(), dims);
      // Rows of the element's vote gradient, adjacent: all of them where the gradient's rows are
      // not (stored afterwards in one pass: rows written apart between the row computations
      // take twice the backward's time), else one at a time.
      const bool adjacent_rows = grad_strides.row == dims.jd() && grad_strides.capsule == dims.D;
      std::vector<acc_t> g_u(adjacent_rows ? dims.jd() : dims.I * dims.jd());
      std::vector<vote_t> slab;
      for (int64_t n = begin; n < end; ++n) {
        backward.run(staged_element_votes(votes, strides, n, dims.I, dims.J, dims.D, slab),
                     g_v + n * dims.jd(), s_hist + n * dims.iters * dims.jd(),
                     grad_items.element(n, dims), state);
        for (int64_t i = 0; i < dims.I; ++i) {
          acc_t* row = adjacent_rows ? g_u.data() : g_u.data() + i * dims.jd();
          backward.vote_grad_row(state, i, row);
          if (adjacent_rows) store_capsule_row(row, dims.J, dims.D, grad_strides, n, i, grad_votes);
        }
        if (!adjacent_rows)
          for (int64_t i = 0; i < dims.I; ++i)
            store_capsule_row(g_u.data() + i * dims.jd(), dims.J, dims.D, grad_strides, n, i,
                              grad_votes);
      }
    });
  });
}

}  // namespace cpu
}  // namespace capsroute
