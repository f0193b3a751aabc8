// The agreement routing of one batch element on the CPU under a RoutingRule (agreement_rules.h):
// dynamic_routing (votes given), dense_capsules and conv_dynamic_routing (votes computed a tile of
// elements at a time) under the default rule, the attention routings under theirs. An element's
// votes are I rows of J x D values (VoteRows); all arithmetic is in acc_t. The loops over a
// capsule's values are vector loops (vec_math.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/acc_math.h"
#include "../common/agreement_rules.h"
#include "../common/dims.h"
#include "vec_math.h"

namespace capsroute {
namespace cpu {

// Calls f(std::integral_constant<int, D>) for the common capsule sizes, else with 0 (any D).
template <typename F>
void dispatch_capsule_dim(int64_t D, F&& f) {
  dispatch_size<4, 8, 16, 32>(D, std::forward<F>(f));
}

// The capsule size: the compile-time kD when there is one.
template <int kD>
inline int64_t capsule_dim(const RoutingDims& d) {
  return kD > 0 ? kD : d.D;
}

// The mean and inverse standard deviation of a capsule's D values (two passes: the variance of the
// differences from the mean, which a large mean does not swamp).
template <typename acc_t>
struct CapsuleMoments {
  acc_t mean, inv_std;
};

template <typename acc_t>
inline CapsuleMoments<acc_t> capsule_moments(const acc_t* s, int64_t D, acc_t eps) {
  acc_t sum = 0;
  for (int64_t d = 0; d < D; ++d) sum += s[d];
  const acc_t mean = sum / D;
  acc_t squares = 0;
  for (int64_t d = 0; d < D; ++d) squares += (s[d] - mean) * (s[d] - mean);
  return {mean, layer_norm_inv_std(squares / D, eps)};
}

// v = f(s) for the J capsules of a pass: s, v (J, D).
template <typename acc_t>
inline void pass_output(const RoutingRule<acc_t>& rule, Nonlinearity f, const acc_t* s, int64_t J,
                        int64_t D, acc_t eps, acc_t* v) {
  for (int64_t j = 0; j < J; ++j) {
    const acc_t* sj = s + j * D;
    acc_t* vj = v + j * D;
    if (f == Nonlinearity::layer_norm) {
      const CapsuleMoments<acc_t> m = capsule_moments(sj, D, eps);
      for (int64_t d = 0; d < D; ++d) {
        const acc_t x = (sj[d] - m.mean) * m.inv_std;
        vj[d] = x * (rule.norm_weight ? rule.norm_weight[d] : acc_t(1)) +
                (rule.norm_bias ? rule.norm_bias[d] : acc_t(0));
      }
    } else {
      const acc_t scale = radial_scale(f, dot<acc_t, acc_t, acc_t>(sj, sj, D), eps);
      for (int64_t d = 0; d < D; ++d) vj[d] = scale * sj[d];
    }
  }
}

// The logits of the pass after r, of the tile at i0, from its agreements <u_ij, v_j>: logits (J,
// W), v (J, D). Always inlined, so that the caller's compile-time D reaches tile_dots.
template <typename vote_t, typename acc_t>
C10_ALWAYS_INLINE void next_tile_logits(const RoutingRule<acc_t>& rule, VoteRows<vote_t> u,
                                        int64_t i0, int64_t n, const acc_t* v, int64_t J, int64_t D,
                                        acc_t* logits) {
  constexpr int64_t W = kTileRows<acc_t>;
  const bool accumulate = rule.logits == LogitRule::accumulate;
  const Vec<acc_t> scale(rule.logit_scale);
  for (int64_t j = 0; j < J; ++j) {
    const Vec<acc_t> agreement = tile_dots(u, i0, n, j, v + j * D, D);
    (accumulate ? Vec<acc_t>::loadu(logits + j * W) + agreement : scale * agreement)
        .store(logits + j * W);
  }
}

// Lane k: coupling_bias (I, J) at (i0 + k, j) for the n rows of the tile at i0 (lanes past n: 0,
// never read past I).
template <typename acc_t>
inline Vec<acc_t> tile_coupling_bias(const acc_t* coupling_bias, int64_t i0, int64_t n, int64_t j,
                                     int64_t J) {
  alignas(64) acc_t lanes[kTileRows<acc_t>] = {};
  for (int64_t k = 0; k < n; ++k) lanes[k] = coupling_bias[(i0 + k) * J + j];
  return Vec<acc_t>::loadu(lanes);
}

// c (J, W) of the tile at i0 += the coupling bias: the couplings of a pass r > 0 under a rule
// with one.
template <typename acc_t>
inline void add_tile_coupling_bias(const acc_t* coupling_bias, int64_t i0, int64_t n, int64_t J,
                                   acc_t* c) {
  constexpr int64_t W = kTileRows<acc_t>;
  for (int64_t j = 0; j < J; ++j)
    (Vec<acc_t>::loadu(c + j * W) + tile_coupling_bias(coupling_bias, i0, n, j, J))
        .store(c + j * W);
}

// A sum over the input capsules, a block of kSumBlockRows rows at a time: the tiles add into the
// block's own sum, which joins the total when the block ends. An FMA chain over all I rows rounds
// like I terms; this like kSumBlockRows + I / kSumBlockRows (at I = 16384 self-attention's
// gradients otherwise lose a digit to float32 eager's pairwise sums).
constexpr int64_t kSumBlockRows = 128;

template <typename acc_t>
class BlockedRowSum {
  static_assert(kSumBlockRows % kTileRows<acc_t> == 0, "a block is whole tiles");

 public:
  explicit BlockedRowSum(int64_t size) : block_(size, acc_t(0)) {}
  acc_t* block() { return block_.data(); }  // where the tiles of the current block add
  // After the tile that ends at row `end` of I: the block joins `total` if it is complete.
  void end_tile(int64_t end, int64_t I, acc_t* total) {
    if (end % kSumBlockRows != 0 && end != I) return;
    for (size_t k = 0; k < block_.size(); ++k) {
      total[k] += block_[k];
      block_[k] = acc_t(0);
    }
  }

 private:
  std::vector<acc_t> block_;
};

// Per-thread scratch of route_forward.
template <typename acc_t>
struct ForwardScratch {
  std::vector<acc_t> logits, coupling, v;
  BlockedRowSum<acc_t> s_block;
  explicit ForwardScratch(const RoutingDims& d)
      : logits(padded_rows<acc_t>(d.I) * d.J),
        coupling(kTileRows<acc_t> * d.J),
        v(d.jd()),
        s_block(d.jd()) {}
};

// Forward of one element under `rule`. Each pass over the votes fuses the logit update of
// iteration r-1 with the softmax and weighted sum of iteration r, so `iters` passes in all. Rows go
// a tile at a time (vec_math.h): the softmax over J on J whole vectors, the tile's J agreement dots
// reduced together; logits are kept by tile, (I / W, J, W), and the padding lanes (zero votes)
// contribute nothing. bias (J, D), if any, is added to every s.
// Writes s_hist (iters, J, D), v_out (J, D) and the final coupling c_out (I, J) unless nullptr.
template <int kD, typename vote_t, typename bias_t, typename out_t, typename acc_t>
void route_forward(VoteRows<vote_t> u, const bias_t* bias, const RoutingRule<acc_t>& rule,
                   const RoutingDims& d, acc_t eps, ForwardScratch<acc_t>& scratch, acc_t* s_hist,
                   out_t* v_out, out_t* c_out) {
  constexpr int64_t W = kTileRows<acc_t>;
  const int64_t I = d.I, J = d.J, D = capsule_dim<kD>(d), JD = J * D;
  acc_t* c = scratch.coupling.data();
  acc_t* v = scratch.v.data();
  std::fill(scratch.logits.begin(), scratch.logits.end(), acc_t(0));
  for (int64_t r = 0; r < d.iters; ++r) {
    acc_t* s = s_hist + r * JD;
    for (int64_t k = 0; k < JD; ++k) s[k] = bias ? static_cast<acc_t>(bias[k]) : acc_t(0);
    for (int64_t i0 = 0; i0 < I; i0 += W) {
      const int64_t n = std::min(W, I - i0);
      acc_t* logits = scratch.logits.data() + i0 * J;  // this tile's (J, W)
      if (r > 0) next_tile_logits(rule, u, i0, n, v, J, D, logits);
      softmax_lanes(logits, J, d.leaky, c);
      if (r > 0 && rule.coupling_bias) add_tile_coupling_bias(rule.coupling_bias, i0, n, J, c);
      for (int64_t j = 0; j < J; ++j)
        tile_axpy(c + j * W, u, i0, n, j, scratch.s_block.block() + j * D, D);
      scratch.s_block.end_tile(i0 + n, I, s);
      if (c_out && r == d.iters - 1) {
        for (int64_t k = 0; k < n; ++k)
          for (int64_t j = 0; j < J; ++j)
            c_out[(i0 + k) * J + j] = static_cast<out_t>(c[j * W + k]);
      }
    }
    pass_output(rule, rule.pass_nonlinearity(r, d.iters), s, J, D, eps, v);
  }
  for (int64_t k = 0; k < JD; ++k) v_out[k] = static_cast<out_t>(v[k]);
}

// Backward of one element (the algorithm: docs/ops.md, dynamic_routing). run() walks the iterations
// backwards and records, per iteration r, the coupling c^r, G^r = dL/db^{r+1}, gs^r = dL/ds^r
// and v^r in a BackwardState; the vote gradient is then the small sum
//   g_u_ij = sum_r c^r_ij gs^r_j + G^r_ij v^r_j,
// evaluated per input capsule by vote_grad_row() so callers can contract it without storing it.
template <typename acc_t>
struct BackwardState {
  // Elements of one state: v_hist and gs_hist (iters, J, D), coupling and g_logits (iters, I, J)
  // stored by tile (iters, padded I / W, J, W).
  static int64_t numel(const RoutingDims& d) {
    return 2 * d.iters * (d.jd() + padded_rows<acc_t>(d.I) * d.J);
  }

  BackwardState(acc_t* storage, const RoutingDims& d)
      : v_hist(storage),
        gs_hist(v_hist + d.iters * d.jd()),
        coupling(gs_hist + d.iters * d.jd()),
        g_logits(coupling + d.iters * padded_rows<acc_t>(d.I) * d.J) {}

  acc_t *v_hist, *gs_hist, *coupling, *g_logits;
};

// Where the backward of one element adds the gradients of its parameters, each null where not
// wanted: the bias (J, D), and the rule's coupling_bias (I, J), norm_weight and norm_bias (D,).
template <typename acc_t>
struct ParameterGrads {
  acc_t* bias = nullptr;
  acc_t* coupling_bias = nullptr;
  acc_t* norm_weight = nullptr;
  acc_t* norm_bias = nullptr;

  // Those of element n, where each is an item per element, (B, ...).
  ParameterGrads element(int64_t n, const RoutingDims& d) const {
    const auto at = [n](acc_t* items, int64_t size) { return items ? items + n * size : nullptr; };
    return {at(bias, d.jd()), at(coupling_bias, d.I * d.J), at(norm_weight, d.D),
            at(norm_bias, d.D)};
  }
};

template <int kD, typename acc_t>
class RoutingBackward {
 public:
  RoutingBackward(const RoutingDims& d, const RoutingRule<acc_t>& rule, acc_t eps, bool detach)
      : d_(d),
        rule_(rule),
        eps_(eps),
        detach_(detach),
        first_r_(detach ? d.iters - 1 : 0),
        tiled_ij_(padded_rows<acc_t>(d.I) * d.J),
        gv_(d.jd()),
        gv_next_(d.jd()),
        tile_(kTileRows<acc_t> * d.J),
        softmax_tile_(rule.coupling_bias ? kTileRows<acc_t> * d.J : 0),
        gv_block_(d.jd()) {}

  // u: the votes, g_v: (J, D), s_hist: (iters, J, D). Fills st; adds the parameters' gradients
  // into grads. Where there is a step back, the couplings are recomputed in the same pass over the
  // votes as the first one, a tile at a time while its votes are in L1: one pass over the votes
  // fewer than a pass of their own (left only for iters = 1 or detach).
  template <typename vote_t, typename grad_t>
  void run(VoteRows<vote_t> u, const grad_t* g_v, const acc_t* s_hist,
           const ParameterGrads<acc_t>& grads, const BackwardState<acc_t>& st) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t I = d_.I, J = d_.J, D = capsule_dim<kD>(d_), JD = J * D, R = d_.iters,
                  IJ = tiled_ij_;
    for (int64_t r = 0; r < R; ++r)
      pass_output(rule_, rule_.pass_nonlinearity(r, R), s_hist + r * JD, J, D, eps_,
                  st.v_hist + r * JD);
    const bool steps_back =
        R > 1 && !detach_;  // else no pass over the votes for the couplings to join
    if (!steps_back)
      for (int64_t i0 = 0; i0 < I; i0 += W) recompute_tile_coupling(u, i0, std::min(W, I - i0), st);
    for (int64_t k = 0; k < JD; ++k) gv_[k] = static_cast<acc_t>(g_v[k]);
    std::fill(st.g_logits + (R - 1) * IJ, st.g_logits + R * IJ, acc_t(0));
    for (int64_t r = R - 1; r >= first_r_; --r) {
      acc_t* gs = st.gs_hist + r * JD;
      pass_vjp(rule_.pass_nonlinearity(r, R), s_hist + r * JD, gv_.data(), gs, grads);
      if (grads.bias)
        for (int64_t k = 0; k < JD; ++k) grads.bias[k] += gs[k];
      if (!steps_back || r == 0) break;  // b^0 = 0 is a constant; detach stops at the last s
      // dL/db^r = softmax VJP of gc = <gs^r, u> (times the logit scale, or plus dL/db^{r+1} where
      // the logits accumulate); then gv^{r-1} = sum_i dL/db^r_ij u_ij.
      std::fill(gv_next_.begin(), gv_next_.end(), acc_t(0));
      acc_t* gc = tile_.data();  // this tile's (J, W) <gs^r_j, u_ij>
      const bool accumulate = rule_.carries_logit_gradient();
      const Vec<acc_t> scale(rule_.logit_scale);
      for (int64_t i0 = 0; i0 < I; i0 += W) {
        const int64_t n = std::min(W, I - i0);
        if (r == R - 1) recompute_tile_coupling(u, i0, n, st);
        const acc_t* c = st.coupling + r * IJ + i0 * J;
        const acc_t* p = rule_.coupling_bias ? tile_softmax(c, i0, n) : c;
        const acc_t* g_next = st.g_logits + r * IJ + i0 * J;
        acc_t* g_here = st.g_logits + (r - 1) * IJ + i0 * J;
        Vec<acc_t> weighted(acc_t(0));
        for (int64_t j = 0; j < J; ++j) {
          const Vec<acc_t> dots = tile_dots(u, i0, n, j, gs + j * D, D);
          dots.store(gc + j * W);
          weighted = at::vec::fmadd(Vec<acc_t>::loadu(p + j * W), dots, weighted);
        }
        if (grads.coupling_bias)  // dL/dcoupling_bias_ij = gc_ij
          for (int64_t k = 0; k < n; ++k)
            for (int64_t j = 0; j < J; ++j) grads.coupling_bias[(i0 + k) * J + j] += gc[j * W + k];
        for (int64_t j = 0; j < J; ++j) {
          const Vec<acc_t> pj = Vec<acc_t>::loadu(p + j * W);
          const Vec<acc_t> centred = Vec<acc_t>::loadu(gc + j * W) - weighted;
          (accumulate ? at::vec::fmadd(pj, centred, Vec<acc_t>::loadu(g_next + j * W))
                      : scale * (pj * centred))
              .store(g_here + j * W);
        }
        for (int64_t j = 0; j < J; ++j)
          tile_axpy(g_here + j * W, u, i0, n, j, gv_block_.block() + j * D, D);
        gv_block_.end_tile(i0 + n, I, gv_next_.data());
      }
      std::swap(gv_, gv_next_);
    }
  }

  // The vote gradient of input capsule i, g_u_i (J * D values), into out. The iterations' terms are
  // added into out one r at a time, in order, so the steps of different j are independent; a sum
  // over r kept in a register made each j a chain of 2 * iters dependent FMAs, whose latency set
  // the pace (the backward of dense_capsules 4-5% slower at MNIST's shape).
  void vote_grad_row(const BackwardState<acc_t>& st, int64_t i, acc_t* out) const {
    constexpr int64_t W = Vec<acc_t>::size();
    const int64_t J = d_.J, D = capsule_dim<kD>(d_), JD = J * D;
    for (int64_t r = first_r_; r < d_.iters;
         ++r) {  // g_logits is 0 at r = iters - 1, the only r with detach
      for (int64_t j = 0; j < J; ++j) {
        const int64_t ij = r * tiled_ij_ + tiled_index<acc_t>(i, j, J);
        const Vec<acc_t> c_ij(st.coupling[ij]), g_ij(st.g_logits[ij]);
        for (int64_t d0 = 0; d0 < D; d0 += W) {
          const int64_t n = std::min(W, D - d0), k = j * D + d0;
          Vec<acc_t> sum = r == first_r_ ? Vec<acc_t>(acc_t(0)) : load_part(out + k, n);
          sum = at::vec::fmadd(c_ij, load_part(st.gs_hist + r * JD + k, n), sum);
          sum = at::vec::fmadd(g_ij, load_part(st.v_hist + r * JD + k, n), sum);
          store_part(sum, out + k, n);
        }
      }
    }
  }

 private:
  // c^r for every r >= first_r_ of the tile of n input capsules at i0, from the logits of the
  // rule (b^{r+1} = b^r + <u, v^r> for dynamic routing); tile_ holds the logits (and is free again
  // afterwards).
  template <typename vote_t>
  C10_ALWAYS_INLINE void recompute_tile_coupling(VoteRows<vote_t> u, int64_t i0, int64_t n,
                                                 const BackwardState<acc_t>& st) {
    const int64_t J = d_.J, D = capsule_dim<kD>(d_), JD = J * D;
    acc_t* logits = tile_.data();  // this tile's (J, W)
    std::fill(tile_.begin(), tile_.end(), acc_t(0));
    for (int64_t r = 0; r < d_.iters; ++r) {
      if (r > 0) next_tile_logits(rule_, u, i0, n, st.v_hist + (r - 1) * JD, J, D, logits);
      if (r < first_r_) continue;
      acc_t* c = st.coupling + r * tiled_ij_ + i0 * J;
      softmax_lanes(logits, J, d_.leaky, c);
      if (r > 0 && rule_.coupling_bias) add_tile_coupling_bias(rule_.coupling_bias, i0, n, J, c);
    }
  }

  // The softmax part p = c - coupling_bias of the tile's couplings c (J, W), whose VJP the
  // backward takes, in softmax_tile_.
  const acc_t* tile_softmax(const acc_t* c, int64_t i0, int64_t n) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t J = d_.J;
    for (int64_t j = 0; j < J; ++j)
      (Vec<acc_t>::loadu(c + j * W) - tile_coupling_bias(rule_.coupling_bias, i0, n, j, J))
          .store(softmax_tile_.data() + j * W);
    return softmax_tile_.data();
  }

  // g_s = the VJP of v = f(s) at g_v, per capsule (radial: SquashVjp form; layer_norm: the
  // formula of agreement_rules.h, whose affine parameters' gradients go into grads).
  void pass_vjp(Nonlinearity f, const acc_t* s, const acc_t* g_v, acc_t* g_s,
                const ParameterGrads<acc_t>& grads) const {
    const int64_t J = d_.J, D = capsule_dim<kD>(d_);
    for (int64_t j = 0; j < J; ++j) {
      const acc_t* sj = s + j * D;
      const acc_t* gj = g_v + j * D;
      if (f == Nonlinearity::layer_norm) {
        layer_norm_vjp(sj, gj, g_s + j * D, grads);
        continue;
      }
      const SquashVjp<acc_t> k = radial_vjp_coeffs(f, dot<acc_t, acc_t, acc_t>(sj, sj, D), eps_);
      const acc_t radial = k.radial * dot<acc_t, acc_t, acc_t>(sj, gj, D);
      for (int64_t e = 0; e < D; ++e) g_s[j * D + e] = k.scale * gj[e] + radial * sj[e];
    }
  }

  void layer_norm_vjp(const acc_t* s, const acc_t* g_v, acc_t* g_s,
                      const ParameterGrads<acc_t>& grads) const {
    const int64_t D = capsule_dim<kD>(d_);
    const CapsuleMoments<acc_t> m = capsule_moments(s, D, eps_);
    acc_t sum_gx = 0, sum_gx_xhat = 0;
    for (int64_t d = 0; d < D; ++d) {
      const acc_t xhat = (s[d] - m.mean) * m.inv_std;
      const acc_t gx = rule_.norm_weight ? rule_.norm_weight[d] * g_v[d] : g_v[d];
      sum_gx += gx;
      sum_gx_xhat += gx * xhat;
      if (grads.norm_weight) grads.norm_weight[d] += g_v[d] * xhat;
      if (grads.norm_bias) grads.norm_bias[d] += g_v[d];
    }
    const acc_t mean_gx = sum_gx / D, mean_gx_xhat = sum_gx_xhat / D;
    for (int64_t d = 0; d < D; ++d) {
      const acc_t xhat = (s[d] - m.mean) * m.inv_std;
      const acc_t gx = rule_.norm_weight ? rule_.norm_weight[d] * g_v[d] : g_v[d];
      g_s[d] = m.inv_std * (gx - mean_gx - xhat * mean_gx_xhat);
    }
  }

  RoutingDims d_;
  RoutingRule<acc_t> rule_;
  acc_t eps_;
  bool detach_;
  int64_t first_r_;
  int64_t tiled_ij_;  // padded I times J: the size of one iteration's coupling or g_logits
  std::vector<acc_t> gv_, gv_next_, tile_, softmax_tile_;  // per-thread scratch
  BlockedRowSum<acc_t> gv_block_;
};

}  // namespace cpu
}  // namespace capsroute
