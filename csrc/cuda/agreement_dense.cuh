// Host side of the dense routings on CUDA, dense_capsules and the dense attention routings: a
// chunk of the batch at a time, its votes as one batched GEMM into an L2-sized workspace
// (kDenseChunkBytes; never the whole batch's votes), the agreement routing's block kernels under
// the op's rule (agreement_rules.h) over those stored votes (MemoryVotes), and the backward's
// contractions as batched GEMMs over the chunk's written vote gradient. The GEMMs follow torch's
// float32 matmul precision (TF32 only if the user allows it,
// torch.backends.cuda.matmul.allow_tf32). Recomputing every vote from the weight inside the
// routing kernels instead, in every pass, was about 10x slower on an H100 at B = 512 and 2048
// (docs/kernels.md, "CUDA, measured"). The ops check their arguments (common/checks.h) first.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "../common/checks.h"
#include "../common/forced_count.h"
#include "../common/kernel_path.h"
#include "agreement_launch.cuh"
#include "agreement_routing.cuh"
#include "host_checks.cuh"
#include "kernel_options.h"
#include "vote_sources.cuh"

namespace capsroute {
namespace cuda {

// The vote workspace of a chunk, in the accumulation dtype: sized so that the votes the GEMM
// writes are still in L2 (50 MB on an H100, 40 MB on an A100) when the routing iterations read
// them, as the CPU backend keeps a tile's votes in its L2. 32 MiB is 45 MNIST elements
// (I = 1152, J = 10, D = 16, float32), which the row-range split spreads over 405 blocks.
constexpr int64_t kDenseChunkBytes = int64_t(32) << 20;

// Elements per chunk (CAPSROUTE_DENSE_CHUNK=N forces N, for the tests).
inline int64_t dense_chunk(const RoutingDims& dims, int64_t acc_bytes) {
  if (const std::optional<int64_t> forced = forced_count("CAPSROUTE_DENSE_CHUNK")) return *forced;
  const int64_t per_element = std::max<int64_t>(1, dims.I * dims.J * dims.D * acc_bytes);
  return std::max<int64_t>(1, kDenseChunkBytes / per_element);
}

// u itself where the batched GEMMs below read it in place, else a contiguous copy (once per call:
// at::bmm would copy each chunk's). cuBLAS takes the chunk's u, input capsule i a (Bc, Din) matrix,
// at any batch stride (u.stride(1)) and row stride (the leading dimension u.stride(0)) >= Din,
// with each u_bi's Din values adjacent.
inline at::Tensor gemm_readable(const at::Tensor& u) {
  const bool in_place = u.stride(2) == 1 && u.stride(0) >= std::max<int64_t>(1, u.size(2));
  return in_place ? u : u.contiguous();
}

// votes (Bc, I, J, D) = weight_ij @ u_bi for the chunk's u (Bc, I, Din): one GEMM per input
// capsule, (Bc, Din) x (Din, J*D), written through a transposed view (cuBLAS takes the strides).
inline void dense_votes_into(const at::Tensor& u_chunk, const at::Tensor& weight,
                             at::Tensor& votes) {
  const int64_t I = weight.size(0), JD = weight.size(1) * weight.size(2), Din = weight.size(3);
  at::Tensor votes_by_row = votes.view({u_chunk.size(0), I, JD}).transpose(0, 1);
  at::bmm_out(votes_by_row, u_chunk.transpose(0, 1), weight.view({I, JD, Din}).transpose(1, 2));
}

// Both directions: for each chunk [b0, b0 + Bc) of the batch, its votes computed into one
// workspace that every chunk reuses (stream order), then body(b0, chunk_dims, u_chunk, votes).
// u_acc and weight_acc in the accumulation dtype.
template <typename Body>
void for_each_chunk_of_votes(const at::Tensor& u_acc, const at::Tensor& weight_acc,
                             const RoutingDims& dims, Body&& body) {
  const int64_t chunk = std::min(dims.B, dense_chunk(dims, u_acc.element_size()));
  at::Tensor votes_ws = at::empty({chunk, dims.I, dims.J, dims.D}, u_acc.options());
  RoutingDims chunk_dims = dims;
  for (int64_t b0 = 0; b0 < dims.B; b0 += chunk) {
    chunk_dims.B = std::min(chunk, dims.B - b0);
    at::Tensor votes = votes_ws.narrow(0, 0, chunk_dims.B);
    const at::Tensor u_chunk = u_acc.narrow(0, b0, chunk_dims.B);
    dense_votes_into(u_chunk, weight_acc, votes);
    body(b0, chunk_dims, u_chunk, votes);
  }
}

// The forward of op: u (B, I, Din), weight (I, J, D, Din), bias (J, D) or undefined, routed for
// `iters` passes under rule. Returns (v (B, J, D), final coupling c (B, I, J) (without `couplings`:
// empty, not computed), s_hist (B, iters, J, D) in the accumulation dtype).
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> route_dense(
    const char* op, const at::Tensor& u_in, const at::Tensor& weight_in, const at::Tensor& bias_in,
    const RuleTensors& rule_tensors, int64_t iters, bool leaky, double eps, bool couplings) {
  check_cuda(u_in, "u");
  const c10::cuda::CUDAGuard guard(u_in.device());
  const at::Tensor u = gemm_readable(u_in);
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const RoutingDims dims{u.size(0), weight.size(0), weight.size(1), weight.size(2), iters, leaky};
  at::Tensor v = at::empty({dims.B, dims.J, dims.D}, u.options());
  at::Tensor c =
      couplings ? at::empty({dims.B, dims.I, dims.J}, u.options()) : at::empty({0}, u.options());
  at::Tensor s_hist =
      at::empty({dims.B, iters, dims.J, dims.D}, u.options().dtype(acc_dtype(u.scalar_type())));
  if (dims.B == 0) return {v, c, s_hist};
  const at::ScalarType acc = s_hist.scalar_type();
  const AccParameters params(rule_tensors, acc);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, u.scalar_type(), "dense_routing", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* bias_ptr = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
    const RoutingRule<acc_t> rule = params.rule<acc_t>();
    std::string routing_paths;
    for_each_chunk_of_votes(
        u.to(acc), weight.to(acc), dims,
        [&](int64_t b0, const RoutingDims& chunk_dims, const at::Tensor&, const at::Tensor& votes) {
          const int64_t Bc = chunk_dims.B;
          at::Tensor s_chunk = s_hist.narrow(0, b0, Bc), v_chunk = v.narrow(0, b0, Bc),
                     c_chunk = couplings ? c.narrow(0, b0, Bc) : at::Tensor();
          const MemoryVotes<acc_t, acc_t> chunk_votes{votes.const_data_ptr<acc_t>(),
                                                      packed_rows(dims.I, dims.J * dims.D)};
          add_distinct_path(routing_paths,
                            launch_routing_forward(chunk_votes, bias_ptr, chunk_dims, eps, s_chunk,
                                                   v_chunk, c_chunk, rule));
        });
    record_kernel_path(op, Direction::forward, "dense-v2-gemm+" + routing_paths);
  });
  return {v, c, s_hist};
}

// The backward's results: grad_u and grad_weight in u's dtype, and the bias's and the rule's
// parameters' gradients in u's dtype (RoutingGrads, votes undefined).
struct DenseGrads {
  at::Tensor u, weight;
  RoutingGrads parameters;
};

// The backward of route_dense at grad_v (B, J, D), from its s_hist.
inline DenseGrads route_dense_backward(const char* op, const at::Tensor& grad_v_in,
                                       const at::Tensor& u_in, const at::Tensor& weight_in,
                                       const at::Tensor& s_hist_in, const RuleTensors& rule_tensors,
                                       bool leaky, bool detach, double eps) {
  const int64_t B = u_in.size(0), Din = u_in.size(2);
  check_cuda(u_in, "u");
  check_same_device(grad_v_in, u_in, "grad_v", "u");
  const c10::cuda::CUDAGuard guard(u_in.device());
  const RoutingDims dims{
      B, weight_in.size(0), weight_in.size(1), weight_in.size(2), s_hist_in.size(1), leaky};
  const at::Tensor u = gemm_readable(u_in);
  const at::Tensor weight = weight_in.contiguous();
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  // The incoming gradient stays in the accumulation dtype (float32 for float16/bfloat16 storage).
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  DenseGrads grads;
  grads.u = at::empty(u.sizes(), u.options());  // contiguous, whatever u's layout
  // With B == 0 the sums over the batch are empty: zero gradients.
  grads.weight = B == 0 ? at::zeros_like(weight) : at::empty_like(weight);
  ParameterGradItems items(rule_tensors, dims, /*norm_rows=*/dims.J, u.options().dtype(acc));

  if (B > 0) {
    const AccParameters params(rule_tensors, acc);
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, u.scalar_type(), "route_dense_backward", [&] {
          using acc_t = at::opmath_type<scalar_t>;
          const int64_t I = dims.I, JD = dims.J * dims.D;
          const RoutingRule<acc_t> rule = params.rule<acc_t>();
          const at::Tensor weight_acc = weight.to(acc);
          at::Tensor grad_u_acc = at::empty({B, I, Din}, u.options().dtype(acc));
          at::Tensor grad_weight_acc = at::zeros({I, JD, Din}, u.options().dtype(acc));
          const StreamLaunch launch{c10::cuda::getCurrentCUDAStream()};
          std::string routing_paths;
          // The chunk's workspace holds its votes while the routing kernels read them, then (stream
          // order) their gradient, written from the saved state.
          for_each_chunk_of_votes(
              u.to(acc), weight_acc, dims,
              [&](int64_t b0, const RoutingDims& chunk_dims, const at::Tensor& u_chunk,
                  const at::Tensor& votes) {
                const int64_t Bc = chunk_dims.B;
                at::Tensor grad_bias_chunk =
                    items.bias.defined() ? items.bias.narrow(0, b0, Bc) : at::Tensor();
                // (The cluster backward writes the gradient over the votes itself: each block reads
                // its rows' votes into shared memory before it writes their gradient.)
                const CapsuleStrides rows = packed_rows(I, JD);
                const BackwardBuffers<acc_t> buf = launch_routing_backward(
                    MemoryVotes<acc_t, acc_t>{votes.const_data_ptr<acc_t>(), rows},
                    grad_v.const_data_ptr<acc_t>() + b0 * JD, s_hist.narrow(0, b0, Bc), chunk_dims,
                    detach, eps, grad_bias_chunk, rows, votes.mutable_data_ptr<acc_t>(), rule,
                    rule_item_data<acc_t>(items, b0));
                add_distinct_path(routing_paths, buf.path);
                if (votes.numel() > 0 && !buf.vote_grad_written)
                  launch(write_vote_grad_rows_kernel<acc_t, acc_t>, vote_grad_rows_blocks(Bc, I),
                         buf.state, Bc, rows, votes.mutable_data_ptr<acc_t>());
                // (I, Bc, J*D) vote gradients: grad_u_i = g_i @ weight_i and grad_weight_i += g_i^T
                // @ u_i.
                const at::Tensor grad_votes = votes.view({Bc, I, JD}).transpose(0, 1);
                at::Tensor grad_u_by_row = grad_u_acc.narrow(0, b0, Bc).transpose(0, 1);
                at::bmm_out(grad_u_by_row, grad_votes, weight_acc.view({I, JD, Din}));
                grad_weight_acc.baddbmm_(grad_votes.transpose(1, 2), u_chunk.transpose(0, 1));
              });
          record_kernel_path(op, Direction::backward, "dense-v2-gemm+" + routing_paths);
          grads.u.copy_(grad_u_acc);
          grads.weight.copy_(grad_weight_acc.view_as(weight));
        });
  }
  items.sum_into(rule_tensors, grads.parameters, u.scalar_type());
  return grads;
}

}  // namespace cuda
}  // namespace capsroute
