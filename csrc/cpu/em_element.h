// EM routing (docs/ops.md, em_routing) of one batch element on the CPU: the forward (M-step,
// E-step) and the exact backward, shared by em_routing (votes given) and the fused pose variant.
// The loops over a capsule's H pose values are vector loops (vec_math.h), one chunk of up to a
// vector's width at a time; the input capsules i are taken a tile at a time (vec_math.h: the
// E-step's softmax over J lane-wise, a tile's sums over h reduced together) and the assignments R
// and their gradient are stored by tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../common/dims.h"
#include "../common/em_math.h"
#include "vec_math.h"

namespace capsroute {
namespace cpu {

// Calls f(h, n) for the chunks [h, h + n) of [0, H), n <= Vec<acc_t>::size().
template <typename acc_t, typename F>
inline void for_each_pose_chunk(int64_t H, F&& f) {
  constexpr int64_t W = Vec<acc_t>::size();
  for (int64_t h = 0; h < H; h += W) f(h, std::min(W, H - h));
}

// One element: votes (I, J, H) as VoteRows, a_in (I), betas (J); statistics per iteration in
// `stats` (iters, J, 2H + 1). kH: H when fixed at compile time (dispatch_size), else 0. All scratch
// is per thread.
template <typename vote_t, typename acc_t, int kH>
class EmElement {
 public:
  EmElement(const EmDims& d, double eps)
      : d_(d),
        eps_(eps),
        R_(padded_rows<acc_t>(d.I) * d.J),
        mass_(d.J),
        norm_(d.J),
        inv_2var_(d.J * d.H) {}

  // The M-step of iteration t from the assignments in R_: writes mu, var, logit into st.
  template <typename beta_t>
  void m_step(VoteRows<vote_t> votes, const vote_t* a_in, const beta_t* beta_u,
              const beta_t* beta_a, int64_t t, acc_t* st) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t I = d_.I, J = d_.J, H = kH > 0 ? kH : d_.H, JH = J * H;
    const acc_t eps = static_cast<acc_t>(eps_);
    acc_t* mu = st;
    acc_t* var = st + JH;
    acc_t* logit = st + 2 * JH;
    alignas(64) acc_t r[W];  // R_ij a_i of a tile's rows for one j
    std::fill(mass_.begin(), mass_.end(), acc_t(0));
    std::fill(mu, mu + 2 * JH, acc_t(0));
    for (int64_t i0 = 0; i0 < I; i0 += W) {
      const int64_t n = std::min(W, I - i0);
      const Vec<acc_t> a = load_acc<acc_t>(a_in + i0, n);
      for (int64_t j = 0; j < J; ++j) {
        (Vec<acc_t>::loadu(R_.data() + i0 * J + j * W) * a).store(r);
        for (int64_t k = 0; k < n; ++k) mass_[j] += r[k];
        tile_axpy(r, votes, i0, n, j, mu + j * H, H);
      }
    }
    for (int64_t jh = 0; jh < JH; ++jh) mu[jh] /= mass_[jh / H] + eps;
    // Second pass for the variance: sum r (V - mu)^2 is exact where sum r V^2 - m mu^2 cancels.
    for (int64_t i0 = 0; i0 < I; i0 += W) {
      const int64_t n = std::min(W, I - i0);
      const Vec<acc_t> a = load_acc<acc_t>(a_in + i0, n);
      for (int64_t j = 0; j < J; ++j) {
        (Vec<acc_t>::loadu(R_.data() + i0 * J + j * W) * a).store(r);
        const acc_t* mu_j = mu + j * H;
        acc_t* var_j = var + j * H;
        for_each_pose_chunk<acc_t>(H, [&](int64_t h, int64_t m) {
          const Vec<acc_t> mean = load_part(mu_j + h, m);
          Vec<acc_t> sum = load_part(var_j + h, m);
          for (int64_t k = 0; k < n; ++k) {
            const Vec<acc_t> diff = load_acc<acc_t>(votes.capsule(i0 + k, j) + h, m) - mean;
            sum = at::vec::fmadd(Vec<acc_t>(r[k]) * diff, diff, sum);
          }
          store_part(sum, var_j + h, m);
        });
      }
    }
    const acc_t lam = em_lambda(d_.final_lambda, t);
    for (int64_t j = 0; j < J; ++j) {
      for (int64_t h = 0; h < H; ++h) var[j * H + h] = var[j * H + h] / (mass_[j] + eps) + eps;
      logit[j] = em_activation_logit(lam, static_cast<acc_t>(beta_u[j]),
                                     static_cast<acc_t>(beta_a[j]), mass_[j], var + j * H, H);
    }
  }

  // The E-step after iteration t (statistics st): R_ = softmax_j(log a_j + log p_ij), in the log
  // domain.
  void e_step(VoteRows<vote_t> votes, const acc_t* st) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t I = d_.I, J = d_.J, H = kH > 0 ? kH : d_.H, JH = J * H;
    const acc_t* mu = st;
    const acc_t* var = st + JH;
    const acc_t* logit = st + 2 * JH;
    for (int64_t j = 0; j < J; ++j) norm_[j] = em_log_prior(logit[j], var + j * H, H);
    for (int64_t jh = 0; jh < JH; ++jh)
      inv_2var_[jh] = 1 / (2 * var[jh]);  // no division in the loop over (i, j, h)
    for (int64_t i0 = 0; i0 < I; i0 += W) {
      const int64_t n = std::min(W, I - i0);
      acc_t* R = R_.data() + i0 * J;  // this tile's (J, W)
      for (int64_t j = 0; j < J; ++j) {
        const acc_t* mu_j = mu + j * H;
        const acc_t* inv_2var_j = inv_2var_.data() + j * H;
        const Vec<acc_t> distance =
            tile_sums<acc_t>(n, [&](int64_t k) {  // sum_h (V - mu)^2 / (2 var)
              const vote_t* v = votes.capsule(i0 + k, j);
              Vec<acc_t> sum(acc_t(0));
              for_each_pose_chunk<acc_t>(H, [&](int64_t h, int64_t m) {
                const Vec<acc_t> diff = load_acc<acc_t>(v + h, m) - load_part(mu_j + h, m);
                sum = at::vec::fmadd(diff * diff, load_part(inv_2var_j + h, m), sum);
              });
              return sum;
            });
        (Vec<acc_t>(norm_[j]) - distance).store(R + j * W);  // log p_ij
      }
      softmax_lanes(R, J, false, R);
    }
  }

  // The whole forward of one element: statistics of every iteration into st (iters, J, 2H + 1),
  // the last means into pose_out (J, H) and the activations into a_out (J).
  template <typename beta_t, typename out_t>
  void forward(VoteRows<vote_t> votes, const vote_t* a_in, const beta_t* beta_u,
               const beta_t* beta_a, acc_t* st, out_t* pose_out, out_t* a_out) {
    const int64_t JH = d_.J * d_.H, row = d_.J * d_.stats_row();
    reset_assignments();
    for (int64_t t = 0; t < d_.iters; ++t) {
      m_step(votes, a_in, beta_u, beta_a, t, st + t * row);
      if (t < d_.iters - 1) e_step(votes, st + t * row);
    }
    const acc_t* last = st + (d_.iters - 1) * row;
    for (int64_t jh = 0; jh < JH; ++jh) pose_out[jh] = static_cast<out_t>(last[jh]);
    for (int64_t j = 0; j < d_.J; ++j) a_out[j] = static_cast<out_t>(em_sigmoid(last[2 * JH + j]));
  }

  void reset_assignments() { std::fill(R_.begin(), R_.end(), acc_t(1) / acc_t(d_.J)); }
  // Assignments the caller computes (conv_em_routing's E-step spans windows): R_ij = assignment(i,
  // j).
  template <typename F>
  void set_assignments(F&& assignment) {
    for (int64_t i = 0; i < d_.I; ++i)
      for (int64_t j = 0; j < d_.J; ++j) R_[tiled_index<acc_t>(i, j, d_.J)] = assignment(i, j);
  }
  const std::vector<acc_t>& assignments() const { return R_; }

 private:
  EmDims d_;
  double eps_;
  std::vector<acc_t> R_, mass_, norm_, inv_2var_;
};

// Backward of one element: from the saved statistics st (iters, J, 2H + 1), the gradients of
// pose (J, H) and a_out (J), adds the gradients of V into g_V (I, J, H), of a_in into g_a (I)
// and of the betas into g_beta_u, g_beta_a (J). All scratch is per thread.
template <typename vote_t, typename acc_t, int kH>
class EmBackward {
 public:
  EmBackward(const EmDims& d, double eps)
      : d_(d),
        eps_(eps),
        em_(d, eps),
        tiled_ij_(padded_rows<acc_t>(d.I) * d.J),
        R_hist_(d.iters * tiled_ij_),
        g_R_(tiled_ij_),  // padding lanes: 0 (or NaN from an infinite g_mass), never read into a
                          // real one
        g_L_(kTileRows<acc_t> * d.J),
        g_mu_(d.J * d.H),
        g_var_(d.J * d.H),
        g_logit_(d.J),
        one_minus_sigmoid_(d.J),
        mass_(d.J),
        g_mass_(d.J),
        inv_var_(d.J * d.H),
        g_mu_M_(d.J * d.H),
        g_var_M_(d.J * d.H) {}

  template <typename beta_t>
  void run(VoteRows<vote_t> votes, const vote_t* a, const beta_t* bu, const acc_t* st,
           const acc_t* g_pose, const acc_t* g_a_out, acc_t* g_V, acc_t* g_a, acc_t* g_beta_u,
           acc_t* g_beta_a) {
    constexpr int64_t W = kTileRows<acc_t>;
    const int64_t I = d_.I, J = d_.J, H = kH > 0 ? kH : d_.H, JH = J * H, iters = d_.iters,
                  row = d_.stats_row(), IJ = tiled_ij_;
    const acc_t e = static_cast<acc_t>(eps_);
    std::vector<acc_t>&R_hist = R_hist_, &g_R = g_R_, &g_mu = g_mu_, &g_var = g_var_,
    &g_logit = g_logit_,  // short names
        &mass = mass_, &g_mass = g_mass_, &inv_var = inv_var_, &g_mu_M = g_mu_M_,
    &g_var_M = g_var_M_;
    // R^t for every iteration, from the saved statistics.
    em_.reset_assignments();
    for (int64_t t = 0; t < iters; ++t) {
      std::copy(em_.assignments().begin(), em_.assignments().end(), R_hist.begin() + t * IJ);
      if (t < iters - 1) em_.e_step(votes, st + t * J * row);
    }
    // Gradients reaching the last M-step's outputs.
    const acc_t* last = st + (iters - 1) * J * row;
    std::copy(g_pose, g_pose + JH, g_mu.begin());
    std::fill(g_var.begin(), g_var.end(), acc_t(0));
    for (int64_t j = 0; j < J; ++j) {
      const acc_t s = em_sigmoid(last[2 * JH + j]);
      g_logit[j] = g_a_out[j] * s * (1 - s);
    }
    for (int64_t t = iters - 1; t >= 0; --t) {
      const acc_t* mu = st + t * J * row;
      const acc_t* var = mu + JH;
      const acc_t* logit = mu + 2 * JH;
      if (t < iters - 1) {
        // E-step t: R^{t+1}_ij = softmax_j(L_ij), L_ij = log sigmoid(logit_j) + log p_ij.
        std::fill(g_mu.begin(), g_mu.end(), acc_t(0));
        std::fill(g_var.begin(), g_var.end(), acc_t(0));
        std::fill(g_logit.begin(), g_logit.end(), acc_t(0));
        // No division or exp in the loops over (i, j, h): d log sigmoid(x) / dx = 1 - sigmoid(x).
        for (int64_t jh = 0; jh < JH; ++jh) inv_var[jh] = 1 / var[jh];
        for (int64_t j = 0; j < J; ++j) one_minus_sigmoid_[j] = 1 - em_sigmoid(logit[j]);
        for (int64_t i0 = 0; i0 < I; i0 += W) {
          const int64_t n = std::min(W, I - i0);
          const acc_t* R_next = R_hist.data() + (t + 1) * IJ + i0 * J;  // this tile's (J, W)
          const acc_t* g_R_tile = g_R.data() + i0 * J;
          Vec<acc_t> weighted(acc_t(0));
          for (int64_t j = 0; j < J; ++j)
            weighted = at::vec::fmadd(Vec<acc_t>::loadu(R_next + j * W),
                                      Vec<acc_t>::loadu(g_R_tile + j * W), weighted);
          for (int64_t j = 0; j < J; ++j) {
            acc_t* g_L = g_L_.data() + j * W;
            (Vec<acc_t>::loadu(R_next + j * W) * (Vec<acc_t>::loadu(g_R_tile + j * W) - weighted))
                .store(g_L);
            for (int64_t k = 0; k < n; ++k) g_logit[j] += g_L[k] * one_minus_sigmoid_[j];
            const acc_t* mu_j = mu + j * H;
            const acc_t* iv_j = inv_var.data() + j * H;
            acc_t* g_mu_j = g_mu.data() + j * H;
            acc_t* g_var_j = g_var.data() + j * H;
            // g_V -= g_L q, g_mu += g_L q, g_var += g_L iv (q diff - 1) / 2, with q = diff / var.
            for_each_pose_chunk<acc_t>(H, [&](int64_t h, int64_t m) {
              const Vec<acc_t> mean = load_part(mu_j + h, m), iv = load_part(iv_j + h, m);
              Vec<acc_t> sum_mu = load_part(g_mu_j + h, m), sum_var = load_part(g_var_j + h, m);
              for (int64_t k = 0; k < n; ++k) {
                const Vec<acc_t> diff = load_acc<acc_t>(votes.capsule(i0 + k, j) + h, m) - mean;
                const Vec<acc_t> q = diff * iv;
                const Vec<acc_t> gl(g_L[k]);
                acc_t* gv = g_V + (i0 + k) * JH + j * H + h;
                store_part(load_part(gv, m) - gl * q, gv, m);
                sum_mu = at::vec::fmadd(gl, q, sum_mu);
                sum_var = at::vec::fmadd(Vec<acc_t>(acc_t(0.5) * g_L[k]) * iv,
                                         q * diff - Vec<acc_t>(acc_t(1)), sum_var);
              }
              store_part(sum_mu, g_mu_j + h, m);
              store_part(sum_var, g_var_j + h, m);
            });
          }
        }
      }
      // M-step t: r = R^t a, m = sum_i r, M = m + eps, mu = sum_i r V / M,
      // var = sum_i r (V - mu)^2 / M + eps, logit = lam (beta_a - sum_h (beta_u + ln(var) / 2) m).
      const acc_t* R = R_hist.data() + t * IJ;
      std::fill(mass.begin(), mass.end(), acc_t(0));
      for (int64_t i0 = 0; i0 < I; i0 += W) {
        const int64_t n = std::min(W, I - i0);
        for (int64_t j = 0; j < J; ++j)
          for (int64_t k = 0; k < n; ++k)
            mass[j] += R[i0 * J + j * W + k] * static_cast<acc_t>(a[i0 + k]);
      }
      const acc_t lam = em_lambda(d_.final_lambda, t);
      for (int64_t j = 0; j < J; ++j)
        g_mass[j] = em_m_step_backward(H, lam, e, static_cast<acc_t>(bu[j]), mass[j], mu + j * H,
                                       var + j * H, g_logit[j], g_mu.data() + j * H,
                                       g_var.data() + j * H, g_mu_M.data() + j * H,
                                       g_var_M.data() + j * H, g_beta_u[j], g_beta_a[j]);
      for (int64_t i0 = 0; i0 < I; i0 += W) {
        const int64_t n = std::min(W, I - i0);
        const Vec<acc_t> a_tile = load_acc<acc_t>(a + i0, n);  // 0 in the padding lanes
        Vec<acc_t> g_a_tile(acc_t(0));
        for (int64_t j = 0; j < J; ++j) {
          const Vec<acc_t> R_j = Vec<acc_t>::loadu(R + i0 * J + j * W);
          alignas(64) acc_t r[W];
          (R_j * a_tile).store(r);
          const acc_t* mu_j = mu + j * H;
          const acc_t* var_j = var + j * H;
          const acc_t* gm_j = g_mu_M.data() + j * H;
          const acc_t* gvar_j = g_var_M.data() + j * H;
          // g_r = g_m + sum_h gm diff + gvar (diff^2 - var0); g_V += r (gm + 2 gvar diff).
          const Vec<acc_t> g_r =
              Vec<acc_t>(g_mass[j]) + tile_sums<acc_t>(n, [&](int64_t k) {
                const vote_t* v = votes.capsule(i0 + k, j);
                acc_t* gv = g_V + (i0 + k) * JH + j * H;
                const Vec<acc_t> rk(r[k]);
                Vec<acc_t> sum(acc_t(0));
                for_each_pose_chunk<acc_t>(H, [&](int64_t h, int64_t m) {
                  const Vec<acc_t> diff = load_acc<acc_t>(v + h, m) - load_part(mu_j + h, m);
                  const Vec<acc_t> var0 = load_part(var_j + h, m) - Vec<acc_t>(e);
                  const Vec<acc_t> gm = load_part(gm_j + h, m), gvar = load_part(gvar_j + h, m);
                  sum = at::vec::fmadd(gvar, diff * diff - var0, at::vec::fmadd(gm, diff, sum));
                  store_part(at::vec::fmadd(rk, at::vec::fmadd(gvar + gvar, diff, gm),
                                            load_part(gv + h, m)),
                             gv + h, m);
                });
                return sum;
              });
          (g_r * a_tile).store(g_R.data() + i0 * J + j * W);
          g_a_tile = at::vec::fmadd(g_r, R_j, g_a_tile);
        }
        alignas(64) acc_t g_a_values[W];
        g_a_tile.store(g_a_values);
        for (int64_t k = 0; k < n; ++k) g_a[i0 + k] += g_a_values[k];
      }
    }
  }

 private:
  EmDims d_;
  double eps_;
  EmElement<vote_t, acc_t, kH> em_;
  int64_t tiled_ij_;  // padded I times J: the size of R^t or g_R
  std::vector<acc_t> R_hist_, g_R_, g_L_, g_mu_, g_var_, g_logit_, one_minus_sigmoid_, mass_,
      g_mass_, inv_var_, g_mu_M_, g_var_M_;
};

}  // namespace cpu
}  // namespace capsroute
