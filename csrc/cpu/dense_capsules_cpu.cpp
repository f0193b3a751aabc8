// dense_capsules on the CPU. The votes weight_ij @ u_i are computed a tile of batch elements at
// a time, as I small matmuls (T, Din) x (Din, J*D) in one BLAS bmm (4x faster than loops over
// the short Din rows), into a slab (I, T, J*D) of the thread's own; each element is routed on
// its rows of the slab. The backward recomputes the slabs instead of keeping votes from the
// forward, then contracts the vote gradients with u and the weight, again as bmm.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/checks.h"
#include "routing_element.h"

namespace capsroute {
namespace {

// Bytes of a thread's vote slab: routing passes over an element's votes three times, so its
// slab should stay in a core's L2 (1.5 MB: 2 elements at MNIST's shape; with 4 MB, 5 elements,
// the passes ran 1.3x slower on a Xeon with 2 MB of L2 per core).
constexpr int64_t kVoteSlabBytes = 3 << 19;
// Bytes of the vote gradients that the backward contracts at a time.
constexpr int64_t kContractionBytes = 4 << 20;

// The operands of the vote transform in the accumulation type, input capsule first, so that
// the votes of elements [n0, n0 + T) are u_by_input[:, n0:n0+T] @ weight_t.
struct VoteOperands {
  at::Tensor u_by_input;  // (I, B, Din)
  at::Tensor weight_t;    // (I, Din, J*D)

  VoteOperands(const at::Tensor& u, const at::Tensor& weight, at::ScalarType acc)
      : u_by_input(u.to(acc).transpose(0, 1).contiguous()),
        weight_t(weight.to(acc).permute({0, 3, 1, 2}).reshape({weight.size(0), weight.size(3), -1}).contiguous()) {}
};

// The votes of a tile of T elements, (I, T, J*D): the rows of its elements interleave.
template <typename acc_t>
struct VoteTile {
  const acc_t* data;
  int64_t T, JD;
  cpu::VoteRows<acc_t> element(int64_t t) const { return {data + t * JD, T * JD}; }
};

// Calls route(n0, tile) for consecutive tiles of elements [n0, n0 + tile.T), in parallel, after
// computing the tile's votes.
template <typename acc_t, typename F>
void for_each_vote_tile(const VoteOperands& ops, const RoutingDims& d, F&& route) {
  const int64_t B = ops.u_by_input.size(1), JD = d.jd();
  const int64_t slab_bytes = std::max<int64_t>(d.I * JD * static_cast<int64_t>(sizeof(acc_t)), 1);
  const int64_t per_thread = (B + at::get_num_threads() - 1) / at::get_num_threads();
  const int64_t tile = std::max<int64_t>(std::min(kVoteSlabBytes / slab_bytes, per_thread), 1);
  at::parallel_for(0, (B + tile - 1) / tile, 1, [&](int64_t begin, int64_t end) {
    at::Tensor slab = at::empty({d.I * tile * JD}, ops.weight_t.options());
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, T = std::min(tile, B - n0);
      at::Tensor votes = slab.narrow(0, 0, d.I * T * JD).view({d.I, T, JD});
      at::bmm_out(votes, ops.u_by_input.narrow(1, n0, T), ops.weight_t);  // in a parallel region: BLAS on this thread
      route(n0, VoteTile<acc_t>{votes.const_data_ptr<acc_t>(), T, JD});
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_cpu(const at::Tensor& u_in, const at::Tensor& weight_in,
                                                                  const std::optional<at::Tensor>& bias_in, int64_t iters,
                                                                  bool leaky, bool /*detach: backward only*/, double eps) {
  check_dense_capsules_inputs(u_in, weight_in, bias_in, iters, eps);
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const int64_t B = u_in.size(0);
  const RoutingDims dims{B, weight_in.size(0), weight_in.size(1), weight_in.size(2), iters, leaky};
  const at::ScalarType acc = acc_dtype(u_in.scalar_type());
  const VoteOperands ops(u_in, weight_in, acc);
  at::Tensor v = at::empty({B, dims.J, dims.D}, u_in.options());
  at::Tensor c = at::empty({B, dims.I, dims.J}, u_in.options());
  at::Tensor s_hist = at::empty({B, iters, dims.J, dims.D}, u_in.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u_in.scalar_type(), "dense_capsules_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
      for_each_vote_tile<acc_t>(ops, dims, [&](int64_t n0, VoteTile<acc_t> tile) {
        cpu::ForwardScratch<acc_t> scratch(dims);
        for (int64_t n = n0; n < n0 + tile.T; ++n) {
          cpu::route_forward<decltype(capsule_dim)::value>(
              tile.element(n - n0), b, dims, static_cast<acc_t>(eps), scratch, s_hist.mutable_data_ptr<acc_t>() + n * iters * dims.jd(), v.mutable_data_ptr<scalar_t>() + n * dims.jd(),
              c.mutable_data_ptr<scalar_t>() + n * dims.I * dims.J);
        }
      });
    });
  });
  return {v, c, s_hist};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_backward_cpu(const at::Tensor& grad_v_in, const at::Tensor& u_in,
                                                                           const at::Tensor& weight_in, const at::Tensor& s_hist_in,
                                                                           bool leaky, bool detach, double eps) {
  check_dense_capsules_backward_inputs(grad_v_in, u_in, weight_in, s_hist_in, eps);
  const int64_t B = u_in.size(0), Din = u_in.size(2);
  const RoutingDims dims{B, weight_in.size(0), weight_in.size(1), weight_in.size(2), s_hist_in.size(1), leaky};
  const int64_t JD = dims.jd();
  const at::ScalarType acc = acc_dtype(u_in.scalar_type());
  const at::Tensor weight_acc = weight_in.to(acc).contiguous();
  const VoteOperands ops(u_in, weight_acc, acc);
  const at::Tensor grad_v = grad_v_in.to(u_in.scalar_type()).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  at::Tensor grad_u_by_input = at::empty({dims.I, B, Din}, u_in.options().dtype(acc));
  at::Tensor grad_bias_items = at::zeros({B, dims.J, dims.D}, u_in.options().dtype(acc));
  at::Tensor grad_weight = at::empty(weight_in.sizes(), u_in.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u_in.scalar_type(), "dense_capsules_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using State = cpu::BackwardState<acc_t>;
    const scalar_t* g_v = grad_v.const_data_ptr<scalar_t>();
    // The backward state of every element (about a third of the votes' size at iters = 3).
    at::Tensor states = at::empty({B, State::numel(dims)}, u_in.options().dtype(acc));
    acc_t* states_p = states.mutable_data_ptr<acc_t>();
    cpu::dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
      using Backward = cpu::RoutingBackward<decltype(capsule_dim)::value, acc_t>;
      // 1. Routing backward per element, on the votes recomputed a tile at a time.
      for_each_vote_tile<acc_t>(ops, dims, [&](int64_t n0, VoteTile<acc_t> tile) {
        Backward backward(dims, static_cast<acc_t>(eps), detach);
        for (int64_t n = n0; n < n0 + tile.T; ++n) {
          backward.run(tile.element(n - n0), g_v + n * JD,
                       s_hist.const_data_ptr<acc_t>() + n * dims.iters * JD, grad_bias_items.mutable_data_ptr<acc_t>() + n * JD,
                       State(states_p + n * State::numel(dims), dims));
        }
      });
      // 2. Contract the vote gradients with u and the weight as bmm over input capsules, a chunk
      //    of input capsules at a time so the vote gradients held stay near kContractionBytes:
      //    grad_weight[i] = g_u[:, i]^T u[:, i] and grad_u[:, i] = g_u[:, i] weight_i.
      const int64_t row_bytes = std::max<int64_t>(B * JD * static_cast<int64_t>(sizeof(acc_t)), 1);
      const int64_t chunk = std::max<int64_t>(std::min(kContractionBytes / row_bytes, dims.I), 1);
      at::Tensor g_votes = at::empty({chunk, B, JD}, u_in.options().dtype(acc));
      for (int64_t i0 = 0; i0 < dims.I; i0 += chunk) {
        const int64_t C = std::min(chunk, dims.I - i0);
        acc_t* g_p = g_votes.mutable_data_ptr<acc_t>();
        at::parallel_for(0, C * B, 1, [&](int64_t begin, int64_t end) {
          const Backward backward(dims, static_cast<acc_t>(eps), detach);
          for (int64_t row = begin; row < end; ++row) {
            const int64_t i = i0 + row / B, n = row % B;
            backward.vote_grad_row(State(states_p + n * State::numel(dims), dims), i, g_p + row * JD);
          }
        });
        const at::Tensor g = g_votes.narrow(0, 0, C);
        at::Tensor grad_weight_chunk = grad_weight.narrow(0, i0, C).view({C, JD, Din});
        at::Tensor grad_u_chunk = grad_u_by_input.narrow(0, i0, C);
        at::bmm_out(grad_weight_chunk, g.transpose(1, 2), ops.u_by_input.narrow(0, i0, C));
        at::bmm_out(grad_u_chunk, g, weight_acc.narrow(0, i0, C).view({C, JD, Din}));
      }
    });
  });
  const at::ScalarType dtype = u_in.scalar_type();
  at::Tensor grad_u = at::empty({B, dims.I, Din}, u_in.options()).copy_(grad_u_by_input.transpose(0, 1));
  return {grad_u, grad_weight.to(dtype), grad_bias_items.sum(0).to(dtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dense_capsules", &dense_capsules_cpu);
  m.impl("_dense_capsules_backward", &dense_capsules_backward_cpu);
}

}  // namespace capsroute
