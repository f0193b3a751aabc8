// Dynamic routing of one batch element on the CPU, shared by dynamic_routing (votes given)
// and dense_capsules (votes computed a tile of elements at a time). An element's votes are I
// rows of J x D values (VoteRows); all arithmetic is in acc_t. The loops over a capsule's
// values are vector loops (vec_math.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/acc_math.h"
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

template <typename acc_t>
inline void squash_capsules(const acc_t* s, int64_t J, int64_t D, acc_t eps, acc_t* v) {
  for (int64_t j = 0; j < J; ++j) {
    const acc_t scale = squash_scale(dot<acc_t, acc_t, acc_t>(s + j * D, s + j * D, D), eps);
    for (int64_t d = 0; d < D; ++d) v[j * D + d] = scale * s[j * D + d];
  }
}

// The agreement update b_ij += <u_ij, v_j> of the tile at i0: logits (J, W), v (J, D). Always
// inlined, so that the caller's compile-time D reaches tile_dots.
template <typename vote_t, typename acc_t>
C10_ALWAYS_INLINE void add_tile_agreement(VoteRows<vote_t> u, int64_t i0, int64_t n, const acc_t* v,
                                          int64_t J, int64_t D, acc_t* logits) {
  constexpr int64_t W = kTileRows<acc_t>;
  for (int64_t j = 0; j < J; ++j)
    (Vec<acc_t>::loadu(logits + j * W) + tile_dots(u, i0, n, j, v + j * D, D))
        .store(logits + j * W);
}

// Per-thread scratch of route_forward.
template <typename acc_t>
struct ForwardScratch {
  std::vector<acc_t> logits, coupling, v;
  explicit ForwardScratch(const RoutingDims& d)
      : logits(padded_rows<acc_t>(d.I) * d.J), coupling(kTileRows<acc_t> * d.J), v(d.jd()) {}
};

// Forward of one element. Each pass over the votes fuses the agreement update of iteration
// r-1 with the softmax and weighted sum of iteration r, so `iters` passes in all. Rows go a tile
// at a time (vec_math.h): the softmax over J on J whole vectors, the tile's J agreement dots
// reduced together; logits are kept by tile, (I / W, J, W), and the padding lanes (zero votes)
// contribute nothing.
// Writes s_hist (iters, J, D), v_out (J, D) and the final coupling c_out (I, J).
template <int kD, typename vote_t, typename bias_t, typename out_t, typename acc_t>
void route_forward(VoteRows<vote_t> u, const bias_t* bias, const RoutingDims& d, acc_t eps,
                   ForwardScratch<acc_t>& scratch, acc_t* s_hist, out_t* v_out, out_t* c_out) {
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
      if (r > 0) add_tile_agreement(u, i0, n, v, J, D, logits);
      softmax_lanes(logits, J, d.leaky, c);
      for (int64_t j = 0; j < J; ++j) tile_axpy(c + j * W, u, i0, n, j, s + j * D, D);
      if (r == d.iters - 1) {
        for (int64_t k = 0; k < n; ++k)
          for (int64_t j = 0; j < J; ++j)
            c_out[(i0 + k) * J + j] = static_cast<out_t>(c[j * W + k]);
      }
    }
    squash_capsules(s, J, D, eps, v);
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

template <int kD, typename acc_t>
class RoutingBackward {
 public:
  RoutingBackward(const RoutingDims& d, acc_t eps, bool detach)
      : d_(d),
        eps_(eps),
        detach_(detach),
        first_r_(detach ? d.iters - 1 : 0),
        tiled_ij_(padded_rows<acc_t>(d.I) * d.J),
        gv_(d.jd()),
        gv_next_(d.jd()),
        tile_(kTileRows<acc_t> * d.J) {}

  // u: the votes, g_v: (J, D), s_hist: (iters, J, D). Fills st; adds dL/dbias into g_bias (J, D).
  // Where there is a step back, the couplings are recomputed in the same pass over the votes as
  // the first one, a tile at a time while its votes are in L1: one pass over the votes fewer than
  // a pass of their own (left only for iters = 1 or detach).
  template <typename vote_t, typename grad_t>
  void run(VoteRows<vote_t> u, const grad_t* g_v, const acc_t* s_hist, acc_t* g_bias,
           const BackwardState<acc_t>& st) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t I = d_.I, J = d_.J, D = capsule_dim<kD>(d_), JD = J * D, R = d_.iters,
                  IJ = tiled_ij_;
    for (int64_t r = 0; r < R; ++r)
      squash_capsules(s_hist + r * JD, J, D, eps_, st.v_hist + r * JD);
    const bool steps_back =
        R > 1 && !detach_;  // else no pass over the votes for the couplings to join
    if (!steps_back)
      for (int64_t i0 = 0; i0 < I; i0 += W) recompute_tile_coupling(u, i0, std::min(W, I - i0), st);
    for (int64_t k = 0; k < JD; ++k) gv_[k] = static_cast<acc_t>(g_v[k]);
    std::fill(st.g_logits + (R - 1) * IJ, st.g_logits + R * IJ, acc_t(0));
    for (int64_t r = R - 1; r >= first_r_; --r) {
      acc_t* gs = st.gs_hist + r * JD;
      squash_vjp(s_hist + r * JD, gv_.data(), gs);
      for (int64_t k = 0; k < JD; ++k) g_bias[k] += gs[k];
      if (!steps_back || r == 0) break;  // b^0 = 0 is a constant; detach stops at the last s
      // dL/db^r = dL/db^{r+1} + softmax VJP of gc = <gs^r, u>; then gv^{r-1} = sum_i dL/db^r_ij
      // u_ij.
      std::fill(gv_next_.begin(), gv_next_.end(), acc_t(0));
      acc_t* gc = tile_.data();  // this tile's (J, W) <gs^r_j, u_ij>
      for (int64_t i0 = 0; i0 < I; i0 += W) {
        const int64_t n = std::min(W, I - i0);
        if (r == R - 1) recompute_tile_coupling(u, i0, n, st);
        const acc_t* c = st.coupling + r * IJ + i0 * J;
        const acc_t* g_next = st.g_logits + r * IJ + i0 * J;
        acc_t* g_here = st.g_logits + (r - 1) * IJ + i0 * J;
        Vec<acc_t> weighted(acc_t(0));
        for (int64_t j = 0; j < J; ++j) {
          const Vec<acc_t> dots = tile_dots(u, i0, n, j, gs + j * D, D);
          dots.store(gc + j * W);
          weighted = at::vec::fmadd(Vec<acc_t>::loadu(c + j * W), dots, weighted);
        }
        for (int64_t j = 0; j < J; ++j) {
          const Vec<acc_t> cj = Vec<acc_t>::loadu(c + j * W);
          at::vec::fmadd(cj, Vec<acc_t>::loadu(gc + j * W) - weighted,
                         Vec<acc_t>::loadu(g_next + j * W))
              .store(g_here + j * W);
        }
        for (int64_t j = 0; j < J; ++j)
          tile_axpy(g_here + j * W, u, i0, n, j, gv_next_.data() + j * D, D);
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
  // c^r for every r >= first_r_ of the tile of n input capsules at i0, from b^{r+1} = b^r + <u,
  // v^r>; tile_ holds the logits (and is free again afterwards).
  template <typename vote_t>
  C10_ALWAYS_INLINE void recompute_tile_coupling(VoteRows<vote_t> u, int64_t i0, int64_t n,
                                                 const BackwardState<acc_t>& st) {
    const int64_t J = d_.J, D = capsule_dim<kD>(d_), JD = J * D;
    acc_t* logits = tile_.data();  // this tile's (J, W)
    std::fill(tile_.begin(), tile_.end(), acc_t(0));
    for (int64_t r = 0; r < d_.iters; ++r) {
      if (r > 0) add_tile_agreement(u, i0, n, st.v_hist + (r - 1) * JD, J, D, logits);
      if (r >= first_r_) softmax_lanes(logits, J, d_.leaky, st.coupling + r * tiled_ij_ + i0 * J);
    }
  }

  void squash_vjp(const acc_t* s, const acc_t* g_v, acc_t* g_s) const {
    const int64_t J = d_.J, D = capsule_dim<kD>(d_);
    for (int64_t j = 0; j < J; ++j) {
      const acc_t* sj = s + j * D;
      const acc_t* gj = g_v + j * D;
      const SquashVjp<acc_t> k = squash_vjp_coeffs(dot<acc_t, acc_t, acc_t>(sj, sj, D), eps_);
      const acc_t radial = k.radial * dot<acc_t, acc_t, acc_t>(sj, gj, D);
      for (int64_t e = 0; e < D; ++e) g_s[j * D + e] = k.scale * gj[e] + radial * sj[e];
    }
  }

  RoutingDims d_;
  acc_t eps_;
  bool detach_;
  int64_t first_r_;
  int64_t tiled_ij_;  // padded I times J: the size of one iteration's coupling or g_logits
  std::vector<acc_t> gv_, gv_next_, tile_;  // per-thread scratch
};

}  // namespace cpu
}  // namespace capsroute
