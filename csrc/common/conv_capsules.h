// conv_dynamic_routing on either device: the votes of a chunk of output positions at a time as
// batched GEMMs over the chunk's windows, routed by the device's dynamic routing kernels, and the
// backward's contractions as batched GEMMs over the chunk's vote gradient. Host code on ATen ops,
// shared by csrc/cpu/conv_dynamic_routing_cpu.cpp and csrc/cuda/conv_dynamic_routing_cuda.cu,
// which bring the routing. Every sum runs in a fixed order: no atomics (docs/ops.md).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>

#include "checks.h"
#include "dims.h"
#include "forced_count.h"
#include "kernel_path.h"

namespace capsroute {

// u (B, H, W, C_in, Din) -> v (B, Ho, Wo, C_out, D); weight (K, K, C_in, C_out, D, Din).
struct ConvCapsuleDims {
  int64_t B, H, W, C_in, Din, K, C_out, D, stride, padding;

  ConvCapsuleDims(const at::Tensor& u, const at::Tensor& weight, int64_t stride, int64_t padding)
      : B(u.size(0)),
        H(u.size(1)),
        W(u.size(2)),
        C_in(u.size(3)),
        Din(u.size(4)),
        K(weight.size(0)),
        C_out(weight.size(3)),
        D(weight.size(4)),
        stride(stride),
        padding(padding) {}
  int64_t Ho() const { return conv_out_size(H, K, stride, padding); }
  int64_t Wo() const { return conv_out_size(W, K, stride, padding); }
  int64_t window() const { return K * K * Din; }  // a child type's values in one window
};

// Output positions [first, first + count) of the (B, Ho, Wo) grid: `images` whole images from
// image b0, or rows [y0, y0 + rows) of image b0 alone.
struct PositionChunk {
  int64_t b0, images, y0, rows, first, count;
};

// The workspace of a chunk, in bytes of the accumulation dtype: its windows and votes, then its
// vote gradient (over the votes) and window gradient (two buffers, the windows freed), and its
// input block and the block's gradient (stride^2 children a position, not counting the rows the
// windows share at a chunk's edge). At most 32 MiB, which stays in an H100's L2 between the GEMM
// and the routing that reads it, and at most half of what the op keeps anyway (s_hist and v), so
// that the workspace does not set the peak memory of a small problem.
constexpr int64_t kConvChunkBytes = int64_t(32) << 20;

// Output positions per chunk of a routing of `iters` iterations (CAPSROUTE_CONV_CHUNK=N forces N,
// for the tests).
inline int64_t conv_chunk_positions(const ConvCapsuleDims& d, int64_t iters, int64_t acc_bytes) {
  if (const std::optional<int64_t> forced = forced_count("CAPSROUTE_CONV_CHUNK")) return *forced;
  const int64_t per_position =
      acc_bytes * d.C_in * (2 * d.window() + 2 * d.C_out * d.D + 2 * d.stride * d.stride * d.Din) +
      acc_bytes * d.C_out * d.D;
  const int64_t kept = acc_bytes * d.B * d.Ho() * d.Wo() * (iters + 1) * d.C_out * d.D;
  return std::max<int64_t>(1, std::min(kConvChunkBytes, kept / 2) / per_position);
}

// Calls body(chunk) for consecutive chunks that cover every output position, in order.
template <typename Body>
void for_each_position_chunk(const ConvCapsuleDims& d, int64_t iters, int64_t acc_bytes,
                             Body&& body) {
  const int64_t positions = conv_chunk_positions(d, iters, acc_bytes);
  const int64_t per_image = d.Ho() * d.Wo();
  if (positions >= per_image) {
    const int64_t images = positions / per_image;
    for (int64_t b0 = 0; b0 < d.B; b0 += images) {
      const int64_t n = std::min(images, d.B - b0);
      body(PositionChunk{b0, n, 0, d.Ho(), b0 * per_image, n * per_image});
    }
    return;
  }
  const int64_t rows = std::max<int64_t>(1, positions / d.Wo());
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t y0 = 0; y0 < d.Ho(); y0 += rows) {
      const int64_t n = std::min(rows, d.Ho() - y0);
      body(PositionChunk{b, 1, y0, n, (b * d.Ho() + y0) * d.Wo(), n * d.Wo()});
    }
}

// Along one spatial dimension, the input indices [start, start + length) a chunk's windows cover
// (start = first output * stride - padding) against the input's [0, size): the `count` indices
// inside it, from input index `input`, at `block` in the covered range (both in range where the
// count is 0: windows on padding alone).
struct BlockOverlap {
  int64_t input, block, count;
};

inline BlockOverlap block_overlap(int64_t start, int64_t length, int64_t size) {
  const int64_t first = std::clamp<int64_t>(start, 0, size);
  const int64_t last = std::clamp<int64_t>(start + length, first, size);
  return {first, std::clamp<int64_t>(first - start, 0, length), last - first};
}

// The operands in the accumulation dtype, laid out for batched GEMMs over the child types c:
// u (B, H, W, C_in, Din) read in place through a type-major view, weight_t (C_in, K*K*Din,
// C_out*D), weight_t[c] holding weight[ky, kx, c, o, d, i] at row (ky, kx, i), column (o, d).
// A chunk's windows are strided views of its input block (the input it covers, zero-padded), and
// its window gradient is summed back onto such a block by col2im: a few large ATen calls a chunk,
// whatever K, for the launches of a GPU.
class ConvVoteOperands {
 public:
  ConvVoteOperands(const at::Tensor& u, const at::Tensor& weight, const ConvCapsuleDims& d,
                   at::ScalarType acc)
      : d_(d),
        u_by_type_(u.to(acc).permute({3, 0, 1, 2, 4})),
        weight_t_(weight.to(acc)
                      .permute({2, 0, 1, 5, 3, 4})
                      .reshape({d.C_in, d.window(), d.C_out * d.D})) {}

  const at::Tensor& weight_t() const { return weight_t_; }

  // The chunk's windows (C_in, count, K*K*Din): position p's K x K children of type c, in (ky, kx,
  // i) order, zero where the window covers padding.
  at::Tensor windows(const PositionChunk& chunk) const {
    const BlockOverlap y = rows_overlap(chunk), x = columns_overlap();
    const auto shape = {d_.C_in, chunk.images, block_rows(chunk), block_columns(), d_.Din};
    const bool inside = y.count == block_rows(chunk) && x.count == block_columns();
    at::Tensor block =
        inside ? at::empty(shape, u_by_type_.options()) : at::zeros(shape, u_by_type_.options());
    block.narrow(2, y.block, y.count)
        .narrow(3, x.block, x.count)
        .copy_(u_by_type_.narrow(1, chunk.b0, chunk.images)
                   .narrow(2, y.input, y.count)
                   .narrow(3, x.input, x.count));
    const int64_t s = d_.stride;
    const auto st = block.strides();
    return block
        .as_strided({d_.C_in, chunk.images, chunk.rows, d_.Wo(), d_.K, d_.K, d_.Din},
                    {st[0], st[1], s * st[2], s * st[3], st[2], st[3], st[4]})
        .contiguous()
        .view({d_.C_in, chunk.count, d_.window()});
  }

  // votes (count, C_in, C_out, D), contiguous, of the chunk's windows: one GEMM per child type,
  // written through a transposed view (the GEMMs take the strides).
  at::Tensor votes(const at::Tensor& windows) const {
    const int64_t count = windows.size(1);
    at::Tensor votes = at::empty({count, d_.C_in, d_.C_out, d_.D}, windows.options());
    at::Tensor votes_by_type = by_type(votes);
    at::bmm_out(votes_by_type, windows, weight_t_);
    return votes;
  }

  // A zero input gradient (B, H, W, C_in, Din) for add_input_gradient.
  at::Tensor zero_input_gradient() const {
    return at::zeros({d_.B, d_.H, d_.W, d_.C_in, d_.Din}, u_by_type_.options());
  }

  // Adds the chunk's input gradient, from its vote gradient (count, C_in, C_out, D), into grad_u
  // (B, H, W, C_in, Din): the window gradient as one GEMM per type, laid out as col2im takes it
  // (one batch, channels (images, C_in, Din), columns the chunk's rows x Wo), summed onto the
  // chunk's block by col2im (each element gathers its windows in a fixed order: no atomics), and
  // the block's part inside the input added.
  void add_input_gradient(const PositionChunk& chunk, const at::Tensor& grad_votes,
                          at::Tensor& grad_u) const {
    const int64_t K = d_.K, s = d_.stride;
    if (d_.C_in * d_.Din == 0) return;  // no input values (col2im refuses zero channels)
    const at::Tensor grad_windows =
        at::bmm(by_type(grad_votes), weight_t_.transpose(1, 2))
            .view({d_.C_in, chunk.images, chunk.rows * d_.Wo(), K, K, d_.Din})
            .permute({1, 0, 5, 3, 4, 2})
            .reshape({1, chunk.images * d_.C_in * d_.Din * K * K, chunk.rows * d_.Wo()});
    // (col2im_out: at::col2im would keep the window gradient's storage for the smaller block)
    at::Tensor block =
        at::empty({1, chunk.images * d_.C_in * d_.Din, block_rows(chunk), block_columns()},
                  grad_windows.options());
    at::col2im_out(block, grad_windows, {block_rows(chunk), block_columns()}, {K, K}, {1, 1},
                   {0, 0}, {s, s});
    block = block.view({chunk.images, d_.C_in, d_.Din, block_rows(chunk), block_columns()});
    const BlockOverlap y = rows_overlap(chunk), x = columns_overlap();
    grad_u.narrow(0, chunk.b0, chunk.images)
        .narrow(1, y.input, y.count)
        .narrow(2, x.input, x.count)
        .add_(
            block.narrow(3, y.block, y.count).narrow(4, x.block, x.count).permute({0, 3, 4, 1, 2}));
  }

  // grad_weight_t += windows^T @ grad_votes, per type.
  void add_weight_gradient(const at::Tensor& windows, const at::Tensor& grad_votes,
                           at::Tensor& grad_weight_t) const {
    grad_weight_t.baddbmm_(windows.transpose(1, 2), by_type(grad_votes));
  }

  // The weight gradient in the layout of the op's weight, from that of weight_t.
  at::Tensor weight_gradient(const at::Tensor& grad_weight_t) const {
    return grad_weight_t.view({d_.C_in, d_.K, d_.K, d_.Din, d_.C_out, d_.D})
        .permute({1, 2, 0, 4, 5, 3});
  }

 private:
  // (count, C_in, C_out, D) votes or vote gradient -> (C_in, count, C_out*D), a view.
  at::Tensor by_type(const at::Tensor& votes) const {
    return votes.view({votes.size(0), d_.C_in, d_.C_out * d_.D}).transpose(0, 1);
  }

  // The chunk's block: the input rows and columns its windows cover, padding included.
  int64_t block_rows(const PositionChunk& chunk) const {
    return (chunk.rows - 1) * d_.stride + d_.K;
  }
  int64_t block_columns() const { return (d_.Wo() - 1) * d_.stride + d_.K; }
  BlockOverlap rows_overlap(const PositionChunk& chunk) const {
    return block_overlap(chunk.y0 * d_.stride - d_.padding, block_rows(chunk), d_.H);
  }
  BlockOverlap columns_overlap() const { return block_overlap(-d_.padding, block_columns(), d_.W); }

  ConvCapsuleDims d_;
  at::Tensor u_by_type_, weight_t_;
};

// The routing of one chunk's votes, on the device's kernels: route(votes (count, C_in, C_out, D),
// bias or undefined, dims, s_hist (count, iters, C_out, D), v (count, C_out, D), c (count, C_in,
// C_out)), every tensor in the accumulation dtype, returns the kernel path it ran.
// route_backward(votes, grad_v, s_hist, dims, grad_bias_items (count, C_out, D), grad_votes) writes
// the vote gradient (count, C_in, C_out, D) into grad_votes, which may be votes itself.
template <typename Route>
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_forward(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t iters, int64_t stride, int64_t padding, bool leaky, const char* device_prefix,
    Route&& route) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const ConvCapsuleDims d(u, weight, stride, padding);
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  const auto acc_options = u.options().dtype(acc);
  at::Tensor v = at::empty({d.B, d.Ho(), d.Wo(), d.C_out, d.D}, acc_options);
  at::Tensor c = at::empty({d.B, d.Ho(), d.Wo(), d.C_in, d.C_out}, acc_options);
  at::Tensor s_hist = at::empty({d.B, d.Ho(), d.Wo(), iters, d.C_out, d.D}, acc_options);
  const at::Tensor bias_acc = bias.has_value() ? bias->to(acc).contiguous() : at::Tensor();
  std::string paths;
  if (v.numel() > 0) {
    const ConvVoteOperands operands(u, weight, d, acc);
    const int64_t positions = d.B * d.Ho() * d.Wo();  // (not -1: C_in may be 0)
    const at::Tensor v_rows = v.view({positions, d.C_out, d.D});
    const at::Tensor c_rows = c.view({positions, d.C_in, d.C_out});
    const at::Tensor s_rows = s_hist.view({positions, iters, d.C_out, d.D});
    for_each_position_chunk(d, iters, at::elementSize(acc), [&](const PositionChunk& chunk) {
      const RoutingDims dims{chunk.count, d.C_in, d.C_out, d.D, iters, leaky};
      add_distinct_path(paths, route(operands.votes(operands.windows(chunk)), bias_acc, dims,
                                     s_rows.narrow(0, chunk.first, chunk.count),
                                     v_rows.narrow(0, chunk.first, chunk.count),
                                     c_rows.narrow(0, chunk.first, chunk.count)));
    });
  }
  record_kernel_path("conv_dynamic_routing", Direction::forward, device_prefix + paths);
  return {v.to(u.scalar_type()), c.to(u.scalar_type()), s_hist};
}

template <typename RouteBackward>
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv_dynamic_routing_backward(
    const at::Tensor& grad_v_in, const at::Tensor& u, const at::Tensor& weight,
    const at::Tensor& s_hist_in, int64_t stride, int64_t padding, bool leaky,
    const char* device_prefix, RouteBackward&& route_backward) {
  // A backward called under autocast (the CPU's autograd runs it on the caller's thread) must not
  // have its float32 GEMMs cast down.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const ConvCapsuleDims d(u, weight, stride, padding);
  const int64_t iters = s_hist_in.size(3);
  const at::ScalarType acc = acc_dtype(u.scalar_type());
  const auto acc_options = u.options().dtype(acc);
  // In the accumulation dtype: a float16 storage dtype would turn a gradient above 65504 into inf.
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous().view({-1, d.C_out, d.D});
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous().view({-1, iters, d.C_out, d.D});
  const ConvVoteOperands operands(u, weight, d, acc);
  at::Tensor grad_u = operands.zero_input_gradient();
  at::Tensor grad_weight_t = at::zeros_like(operands.weight_t());
  at::Tensor grad_bias = at::zeros({d.C_out, d.D}, acc_options);
  std::string paths;
  if (grad_v.size(0) > 0) {
    for_each_position_chunk(d, iters, at::elementSize(acc), [&](const PositionChunk& chunk) {
      const RoutingDims dims{chunk.count, d.C_in, d.C_out, d.D, iters, leaky};
      at::Tensor windows = operands.windows(chunk);
      at::Tensor votes = operands.votes(windows);
      at::Tensor grad_bias_items = at::zeros({chunk.count, d.C_out, d.D}, acc_options);
      // The vote gradient goes over the votes: the routing backward is their last reader.
      add_distinct_path(paths, route_backward(votes, grad_v.narrow(0, chunk.first, chunk.count),
                                              s_hist.narrow(0, chunk.first, chunk.count), dims,
                                              grad_bias_items, votes));
      operands.add_weight_gradient(windows, votes, grad_weight_t);
      windows.reset();  // before the input gradient's two window-sized buffers
      operands.add_input_gradient(chunk, votes, grad_u);
      grad_bias.add_(grad_bias_items.sum(0));
    });
  }
  record_kernel_path("conv_dynamic_routing", Direction::backward, device_prefix + paths);
  return {grad_u.to(u.scalar_type()),
          operands.weight_gradient(grad_weight_t).to(u.scalar_type()).contiguous(),
          grad_bias.to(u.scalar_type())};
}

}  // namespace capsroute
