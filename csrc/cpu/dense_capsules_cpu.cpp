// dense_capsules on the CPU, and route_dense (agreement_routing.h) under any rule, which the dense
// attention routings call (dense_attention_routing_cpu.cpp). The votes weight_ij @ u_i are computed
// a group of batch elements at a time into a slab, input capsule by input capsule so that weight_i
// (J*D x Din values, 5 KB at MNIST's shape), transposed once per group, stays in L1 while the
// group's elements use it; each element is then routed on its rows of the slab. The backward
// recomputes the slabs instead of keeping votes from the forward, then rebuilds the elements' vote
// gradient rows from the routing state a block of input capsules at a time and contracts them with
// u_i and weight_i, input capsule by input capsule, while they are in L2.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "agreement_routing.h"
#include "output_cache.h"

namespace capsroute {
namespace cpu {
namespace {

// Bytes of votes in the slab, whatever the thread count (8 elements at MNIST's shape), and at
// least an element per thread. Each group streams and transposes every weight_i once, so larger
// groups read the weight less often (B = 8 on 1 thread: once per pass, where half this size took
// two); a fixed size keeps the slab no larger than the weight gradient at MNIST's shape.
constexpr int64_t kVoteSlabBytes = 6 << 20;
// Input capsules per task of the vote transform.
constexpr int64_t kVoteRowGrain = 16;
// Input capsules per task of the backward's contractions.
constexpr int64_t kContractionGrain = 16;
// Bytes of vote-gradient rows per thread in the backward's contractions: a block of capsules'
// rows for every element, in L2.
constexpr int64_t kVoteGradBlockBytes = 256 << 10;

// The operands of the vote transform in the accumulation type: u (B, I, Din), in place where
// each u_bi is contiguous (u_strides), and weight (I, J*D, Din), so that the votes of element n
// and input capsule i are weight[i] @ u[n, i].
struct VoteOperands {
  at::Tensor u;  // (B, I, Din)
  CapsuleStrides u_strides;
  at::Tensor weight;  // (I, J*D, Din)

  VoteOperands(const at::Tensor& u_in, const at::Tensor& weight_in, at::ScalarType acc)
      : u(with_contiguous_capsules(u_in.to(acc))),
        u_strides(capsule_strides(u, 2)),
        weight(weight_in.to(acc).contiguous().view(
            {weight_in.size(0), weight_in.size(1) * weight_in.size(2), weight_in.size(3)})) {
  }  // I = 0 too

  template <typename acc_t>
  const acc_t* u_capsule(int64_t n, int64_t i) const {
    return u.const_data_ptr<acc_t>() + u_strides.offset(n, i);
  }
};

// weight_i (JD, Din) transposed into w_t (Din, JD), where the vote and input-gradient loops want
// it: blocks of a vector's width x 8 (in registers, cpu::transpose) into a buffer that stays in
// L1, instead of a transposed copy of the whole weight in memory.
template <typename acc_t>
void transpose_weight_rows(const acc_t* w_i, int64_t JD, int64_t Din, acc_t* w_t) {
  constexpr int kRows = Vec<acc_t>::size();
  int64_t c0 = 0;
  for (; c0 + kRows <= JD; c0 += kRows) {
    int64_t k0 = 0;
    for (; k0 + 8 <= Din; k0 += 8)
      transpose<acc_t, kRows, 8>(w_i + c0 * Din + k0, Din, w_t + k0 * JD + c0, JD);
    if (k0 < Din)
      at::vec::transpose_mxn<acc_t>(w_i + c0 * Din + k0, Din, w_t + k0 * JD + c0, JD, kRows,
                                    Din - k0);
  }
  if (c0 < JD) at::vec::transpose_mxn<acc_t>(w_i + c0 * Din, Din, w_t + c0, JD, JD - c0, Din);
}

// The votes of one element and input capsule: votes[c] = sum_k u[k] w[k * JD + c], c < JD.
// kChains vectors of outputs at a time, so that as many FMA chains run side by side: one chain
// (a vector summed over k) leaves the FMA units idle for its latency at every step.
template <typename acc_t>
inline void vote_row(const acc_t* u, const acc_t* w, int64_t Din, int64_t JD, acc_t* votes) {
  constexpr int64_t W = Vec<acc_t>::size(), kChains = 4;
  int64_t c0 = 0;
  for (; c0 + kChains * W <= JD; c0 += kChains * W) {
    Vec<acc_t> sum[kChains];
    for (int64_t b = 0; b < kChains; ++b) sum[b] = Vec<acc_t>(acc_t(0));
    for (int64_t k = 0; k < Din; ++k) {
      const Vec<acc_t> u_k(u[k]);
      for (int64_t b = 0; b < kChains; ++b)
        sum[b] = at::vec::fmadd(u_k, Vec<acc_t>::loadu(w + k * JD + c0 + b * W), sum[b]);
    }
    for (int64_t b = 0; b < kChains; ++b) sum[b].store(votes + c0 + b * W);
  }
  for (; c0 < JD; c0 += W) {
    const int64_t n = std::min(W, JD - c0);
    Vec<acc_t> sum(acc_t(0));
    for (int64_t k = 0; k < Din; ++k)
      sum = at::vec::fmadd(Vec<acc_t>(u[k]), load_part(w + k * JD + c0, n), sum);
    store_part(sum, votes + c0, n);
  }
}

// Calls route(n0, T, votes) for consecutive runs of elements [n0, n0 + T), in parallel, with
// votes (T, I, J*D) their votes. The batch is taken a group of elements at a time into one slab:
// the group's votes are computed with its input capsules split over the threads, so each thread
// transposes and streams its share of the weight once per group (5.9 MB at MNIST's shape, from
// L3), then the group's elements are routed, split over the threads. (With a tile of elements
// per thread, each thread streamed the whole weight per tile: 7% more time at B = 8 on 2 threads.)
template <typename acc_t, typename F>
void for_each_vote_group(const VoteOperands& ops, const RoutingDims& d, F&& route) {
  const int64_t B = d.B, I = d.I, JD = d.jd(), Din = ops.u.size(2);
  const int64_t element_bytes = std::max<int64_t>(I * JD * static_cast<int64_t>(sizeof(acc_t)), 1);
  const int64_t threads = at::get_num_threads();
  const int64_t group = std::min(std::max(kVoteSlabBytes / element_bytes, threads), B);
  const acc_t* w = ops.weight.const_data_ptr<acc_t>();
  // From the output cache (output_cache.h): fresh pages were faulted in on every call (4000
  // faults per forward+backward at B = 8, a third of its time). Every value is written.
  const at::Tensor slab_memory = empty_output(
      {group * I * JD}, ops.weight.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  acc_t* slab = slab_memory.mutable_data_ptr<acc_t>();
  for (int64_t n0 = 0; n0 < B; n0 += group) {
    const int64_t G = std::min(group, B - n0);
    at::parallel_for(0, I, kVoteRowGrain, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> w_t(Din * JD);
      for (int64_t i = begin; i < end; ++i) {
        transpose_weight_rows(w + i * JD * Din, JD, Din, w_t.data());
        for (int64_t e = 0; e < G; ++e)
          vote_row(ops.u_capsule<acc_t>(n0 + e, i), w_t.data(), Din, JD, slab + (e * I + i) * JD);
      }
    });
    at::parallel_for(0, G, 1, [&](int64_t begin, int64_t end) {
      route(n0 + begin, end - begin, static_cast<const acc_t*>(slab + begin * I * JD));
    });
  }
}

// The backward's contractions for input capsule i, from the vote gradient rows G (B, J*D) of
// its elements: grad_weight[i, :, k] = sum_n u[n, i, k] G[n] and grad_u[n, i, k] = <w_t[k], G[n]>
// (w_t: weight_i transposed, (Din, J*D)), for kRows values of k from k0 per call, their sums
// held in registers (a GEMM micro-kernel each). u_i steps by u_stride from one element to the
// next, g_u_i by g_u_stride; grad_weight's row i is (J*D, Din), so the sums are written transposed.
template <int kRows, typename acc_t>
void weight_grad_rows(const acc_t* G, const acc_t* u_i, int64_t B, int64_t u_stride, int64_t Din,
                      int64_t JD, int64_t k0, acc_t* g_w_i) {
  constexpr int64_t W = Vec<acc_t>::size();
  for (int64_t c0 = 0; c0 < JD; c0 += W) {
    const int64_t n = std::min(W, JD - c0);
    Vec<acc_t> sum[kRows];
    for (int r = 0; r < kRows; ++r) sum[r] = Vec<acc_t>(acc_t(0));
    for (int64_t e = 0; e < B; ++e) {
      const Vec<acc_t> g = load_part(G + e * JD + c0, n);
      const acc_t* u = u_i + e * u_stride + k0;
      for (int r = 0; r < kRows; ++r) sum[r] = at::vec::fmadd(Vec<acc_t>(u[r]), g, sum[r]);
    }
    alignas(64) acc_t columns[kRows][W];
    for (int r = 0; r < kRows; ++r) sum[r].store(columns[r]);
    if (n ==
        W)  // a register transpose where there is one (cpu::transpose), not kRows * W scalar stores
      transpose<acc_t, kRows, W>(columns[0], W, g_w_i + c0 * Din + k0, Din);
    else
      at::vec::transpose_mxn<acc_t>(columns[0], W, g_w_i + c0 * Din + k0, Din, kRows, n);
  }
}

template <int kRows, typename acc_t>
void input_grad_rows(const acc_t* G, const acc_t* w_t, int64_t B, int64_t g_u_stride, int64_t JD,
                     int64_t k0, acc_t* g_u_i) {
  constexpr int64_t W = Vec<acc_t>::size();
  for (int64_t e = 0; e < B; ++e) {
    Vec<acc_t> sum[kRows];
    for (int r = 0; r < kRows; ++r) sum[r] = Vec<acc_t>(acc_t(0));
    for (int64_t c0 = 0; c0 < JD; c0 += W) {
      const int64_t n = std::min(W, JD - c0);
      const Vec<acc_t> g = load_part(G + e * JD + c0, n);
      for (int r = 0; r < kRows; ++r)
        sum[r] = at::vec::fmadd(load_part(w_t + (k0 + r) * JD + c0, n), g, sum[r]);
    }
    if constexpr (kRows > 1 &&
                  kRows <= W) {  // the rows' horizontal sums together (lanes past kRows: 0)
      Vec<acc_t> sums[W];
      for (int r = 0; r < W; ++r) sums[r] = r < kRows ? sum[r] : Vec<acc_t>(acc_t(0));
      lane_sums(sums).store(g_u_i + e * g_u_stride + k0, kRows);
    } else {
      for (int r = 0; r < kRows; ++r) g_u_i[e * g_u_stride + k0 + r] = reduce_sum(sum[r]);
    }
  }
}

// Calls f(std::integral_constant<int, rows>, k0) over [0, Din) in blocks of 8 rows, then 1.
template <typename F>
void for_each_row_block(int64_t Din, F&& f) {
  int64_t k0 = 0;
  for (; k0 + 8 <= Din; k0 += 8) f(std::integral_constant<int, 8>{}, k0);
  for (; k0 < Din; ++k0) f(std::integral_constant<int, 1>{}, k0);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_dense(const char* op, const at::Tensor& u_in,
                                                           const at::Tensor& weight_in,
                                                           const at::Tensor& bias_in,
                                                           const RuleTensors& rule, int64_t iters,
                                                           bool leaky, double eps, bool couplings) {
  record_kernel_path(op, Direction::forward, "cpu");
  const at::Tensor bias = bias_in.defined() ? bias_in.contiguous() : at::Tensor();
  const int64_t B = u_in.size(0);
  const RoutingDims dims{B, weight_in.size(0), weight_in.size(1), weight_in.size(2), iters, leaky};
  const at::ScalarType acc = acc_dtype(u_in.scalar_type());
  const VoteOperands ops(u_in, weight_in, acc);
  const AccParameters params(rule, acc);
  at::Tensor v = empty_output({B, dims.J, dims.D}, u_in.options());
  at::Tensor c = empty_couplings(couplings, dims, u_in.options());
  at::Tensor s_hist = empty_output({B, iters, dims.J, dims.D}, u_in.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, u_in.scalar_type(), "route_dense_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* b = bias.defined() ? bias.const_data_ptr<scalar_t>() : nullptr;
        const RoutingRule<acc_t> acc_rule = params.rule<acc_t>();
        dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
          for_each_vote_group<acc_t>(ops, dims, [&](int64_t n0, int64_t T, const acc_t* slab) {
            ForwardScratch<acc_t> scratch(dims);
            for (int64_t n = n0; n < n0 + T; ++n) {
              route_forward<decltype(capsule_dim)::value>(
                  VoteRows<acc_t>{slab + (n - n0) * dims.I * dims.jd(), dims.jd(), dims.D}, b,
                  acc_rule, dims, static_cast<acc_t>(eps), scratch,
                  s_hist.mutable_data_ptr<acc_t>() + n * iters * dims.jd(),
                  v.mutable_data_ptr<scalar_t>() + n * dims.jd(),
                  couplings ? c.mutable_data_ptr<scalar_t>() + n * dims.I * dims.J : nullptr);
            }
          });
        });
      });
  return {v, c, s_hist};
}

namespace {

// Backward step 1: the routing backward of every element, on the votes recomputed a group of
// elements at a time; fills each element's BackwardState and adds its dL/dbias.
template <typename Backward, typename acc_t>
void routing_backward_states(const VoteOperands& ops, const RoutingDims& dims,
                             const RoutingRule<acc_t>& rule, acc_t eps, bool detach,
                             const acc_t* g_v, const acc_t* s_hist,
                             const ParameterGrads<acc_t>& grad_items, acc_t* states) {
  using State = BackwardState<acc_t>;
  const int64_t JD = dims.jd();
  for_each_vote_group<acc_t>(ops, dims, [&](int64_t n0, int64_t T, const acc_t* slab) {
    Backward backward(dims, rule, eps, detach);
    for (int64_t n = n0; n < n0 + T; ++n) {
      backward.run(VoteRows<acc_t>{slab + (n - n0) * dims.I * JD, JD, dims.D}, g_v + n * JD,
                   s_hist + n * dims.iters * JD, grad_items.element(n, dims),
                   State(states + n * State::numel(dims), dims));
    }
  });
}

// The vote gradient rows of capsules [i0, i0 + rows) of every element into G (rows, B, J*D),
// element by element, so that an element's coupling and g_logits (tiled by kTileRows capsules)
// are read once per block while in L1; capsule by capsule over all elements, they fell out of L1
// between capsules.
template <typename Backward, typename acc_t>
void vote_grad_block(const Backward& backward, const RoutingDims& dims, acc_t* states, int64_t i0,
                     int64_t rows, acc_t* G) {
  using State = BackwardState<acc_t>;
  const int64_t B = dims.B, JD = dims.jd();
  for (int64_t n = 0; n < B; ++n) {
    const State state(states + n * State::numel(dims), dims);
    for (int64_t i = i0; i < i0 + rows; ++i)
      backward.vote_grad_row(state, i, G + ((i - i0) * B + n) * JD);
  }
}

// Backward step 2: per input capsule i, the vote gradient rows of all elements (B x J*D values,
// in L2) contracted with u_i into grad_weight_i and with weight_i into grad_u_i. Each task owns
// its capsules' rows of both, so the sum over elements runs in order whatever the thread count.
template <typename Backward, typename acc_t>
void contract_vote_grads(const VoteOperands& ops, const RoutingDims& dims,
                         const RoutingRule<acc_t>& rule, acc_t eps, bool detach, int64_t Din,
                         acc_t* states, acc_t* g_u, acc_t* g_w) {
  const int64_t B = dims.B, JD = dims.jd();
  const acc_t* w = ops.weight.const_data_ptr<acc_t>();
  const int64_t u_stride = ops.u_strides.element, g_u_stride = dims.I * Din;  // grad_u: contiguous
  const int64_t row_bytes = std::max<int64_t>(B * JD * static_cast<int64_t>(sizeof(acc_t)), 1);
  const int64_t block = std::clamp<int64_t>(kVoteGradBlockBytes / row_bytes, 1, kTileRows<acc_t>);
  at::parallel_for(0, dims.I, kContractionGrain, [&](int64_t begin, int64_t end) {
    const Backward backward(dims, rule, eps, detach);
    std::vector<acc_t> G(block * B * JD), w_t(Din * JD);
    for (int64_t i0 = begin; i0 < end; i0 += block) {
      const int64_t rows = std::min(block, end - i0);
      vote_grad_block(backward, dims, states, i0, rows, G.data());
      for (int64_t i = i0; i < i0 + rows; ++i) {
        const acc_t* G_i = G.data() + (i - i0) * B * JD;
        transpose_weight_rows(w + i * JD * Din, JD, Din, w_t.data());
        for_each_row_block(Din, [&](auto k_rows, int64_t k0) {
          constexpr int kRows = decltype(k_rows)::value;
          weight_grad_rows<kRows>(G_i, ops.u_capsule<acc_t>(0, i), B, u_stride, Din, JD, k0,
                                  g_w + i * JD * Din);
          input_grad_rows<kRows>(G_i, w_t.data(), B, g_u_stride, JD, k0, g_u + i * Din);
        });
      }
    }
  });
}

}  // namespace

DenseGrads route_dense_backward(const char* op, const at::Tensor& grad_v_in, const at::Tensor& u_in,
                                const at::Tensor& weight_in, const at::Tensor& s_hist_in,
                                const RuleTensors& rule, bool leaky, bool detach, double eps) {
  record_kernel_path(op, Direction::backward, "cpu");
  const int64_t B = u_in.size(0), Din = u_in.size(2);
  const RoutingDims dims{
      B, weight_in.size(0), weight_in.size(1), weight_in.size(2), s_hist_in.size(1), leaky};
  const at::ScalarType acc = acc_dtype(u_in.scalar_type());
  const VoteOperands ops(u_in, weight_in, acc);
  const AccParameters params(rule, acc);
  // In the accumulation dtype: a float16 storage dtype would turn a gradient above 65504 into inf.
  const at::Tensor grad_v = grad_v_in.to(acc).contiguous();
  const at::Tensor s_hist = s_hist_in.to(acc).contiguous();
  ParameterGradItems items(rule, dims, /*norm_rows=*/1, u_in.options().dtype(acc));
  at::Tensor grad_u, grad_weight;  // allocated once the vote slabs are freed: a lower peak

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, u_in.scalar_type(), "route_dense_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const RoutingRule<acc_t> acc_rule = params.rule<acc_t>();
        // The backward state of every element (about a third of the votes' size at iters = 3).
        at::Tensor states =
            empty_output({B, BackwardState<acc_t>::numel(dims)}, u_in.options().dtype(acc));
        dispatch_capsule_dim(dims.D, [&](auto capsule_dim) {
          using Backward = RoutingBackward<decltype(capsule_dim)::value, acc_t>;
          routing_backward_states<Backward>(ops, dims, acc_rule, static_cast<acc_t>(eps), detach,
                                            grad_v.const_data_ptr<acc_t>(),
                                            s_hist.const_data_ptr<acc_t>(), item_data<acc_t>(items),
                                            states.mutable_data_ptr<acc_t>());
          grad_u = empty_output({B, dims.I, Din}, u_in.options().dtype(acc));
          grad_weight = empty_output(weight_in.sizes(), u_in.options().dtype(acc));
          contract_vote_grads<Backward>(ops, dims, acc_rule, static_cast<acc_t>(eps), detach, Din,
                                        states.mutable_data_ptr<acc_t>(),
                                        grad_u.mutable_data_ptr<acc_t>(),
                                        grad_weight.mutable_data_ptr<acc_t>());
        });
      });
  const at::ScalarType dtype = u_in.scalar_type();
  DenseGrads grads{grad_u.to(dtype), grad_weight.to(dtype)};
  items.sum_into(rule, grads.parameters, dtype);
  return grads;
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_cpu(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    int64_t iters, bool leaky, bool /*detach: backward only*/, double eps, bool couplings) {
  check_dense_capsules_inputs(u, weight, bias, iters, eps);
  return route_dense("dense_capsules", u, weight, bias.value_or(at::Tensor()), RuleTensors{}, iters,
                     leaky, eps, couplings);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dense_capsules_backward_cpu(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const at::Tensor& s_hist, bool leaky, bool detach, double eps) {
  check_dense_capsules_backward_inputs(grad_v, u, weight, s_hist, eps);
  const DenseGrads grads = route_dense_backward("dense_capsules", grad_v, u, weight, s_hist,
                                                RuleTensors{}, leaky, detach, eps);
  return {grads.u, grads.weight, grads.parameters.bias};
}

}  // namespace

}  // namespace cpu

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("dense_capsules", &cpu::dense_capsules_cpu);
  m.impl("_dense_capsules_backward", &cpu::dense_capsules_backward_cpu);
}

}  // namespace capsroute
