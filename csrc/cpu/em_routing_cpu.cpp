// EM routing (DESIGN.md 2.3) on the CPU, one batch element per task of at::parallel_for.
// The forward keeps, per iteration, the M-step's statistics (mean, variance, activation logit:
// (2H + 1) J values); the backward recomputes the assignments R from them and walks the
// iterations backwards through the E-step (a log-softmax) and the M-step (weighted moments).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../common/checks.h"
#include "../common/math.h"

namespace capsroute {
namespace {

struct EmDims {
  int64_t I, J, H, iters;
  double final_lambda, eps;
  int64_t stats_row() const { return 2 * H + 1; }  // mu (H), var (H), logit
  double lambda(int64_t t) const { return final_lambda * (1.0 - std::pow(0.95, static_cast<double>(t + 1))); }
};

template <typename T>
T log_sigmoid(T x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

template <typename T>
T sigmoid(T x) {
  return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x));
}

// One element: votes V (I, J, H), a_in (I), betas (J); statistics per iteration in `stats`
// (iters, J, 2H + 1). All scratch is per thread.
template <typename vote_t, typename acc_t>
class EmElement {
 public:
  explicit EmElement(const EmDims& d) : d_(d), R_(d.I * d.J), mass_(d.J), norm_(d.J) {}

  // The M-step of iteration t from the assignments in R_: writes mu, var, logit into st.
  template <typename beta_t>
  void m_step(const vote_t* V, const vote_t* a_in, const beta_t* beta_u, const beta_t* beta_a, int64_t t,
              acc_t* st) {
    const int64_t I = d_.I, J = d_.J, H = d_.H, JH = J * H;
    const acc_t eps = d_.eps;
    acc_t* mu = st;
    acc_t* var = st + JH;
    acc_t* logit = st + 2 * JH;
    std::fill(mass_.begin(), mass_.end(), acc_t(0));
    std::fill(mu, mu + 2 * JH, acc_t(0));
    for (int64_t i = 0; i < I; ++i) {
      const acc_t a = static_cast<acc_t>(a_in[i]);
      for (int64_t j = 0; j < J; ++j) {
        const acc_t r = R_[i * J + j] * a;
        mass_[j] += r;
        const vote_t* v = V + (i * J + j) * H;
        for (int64_t h = 0; h < H; ++h) mu[j * H + h] += r * static_cast<acc_t>(v[h]);
      }
    }
    for (int64_t jh = 0; jh < JH; ++jh) mu[jh] /= mass_[jh / H] + eps;
    // Second pass for the variance: sum r (V - mu)^2 is exact where sum r V^2 - m mu^2 cancels.
    for (int64_t i = 0; i < I; ++i) {
      const acc_t a = static_cast<acc_t>(a_in[i]);
      for (int64_t j = 0; j < J; ++j) {
        const acc_t r = R_[i * J + j] * a;
        const vote_t* v = V + (i * J + j) * H;
        for (int64_t h = 0; h < H; ++h) {
          const acc_t diff = static_cast<acc_t>(v[h]) - mu[j * H + h];
          var[j * H + h] += r * diff * diff;
        }
      }
    }
    const acc_t lam = d_.lambda(t);
    for (int64_t j = 0; j < J; ++j) {
      acc_t cost = 0;
      for (int64_t h = 0; h < H; ++h) {
        acc_t& vr = var[j * H + h];
        vr = vr / (mass_[j] + eps) + eps;
        cost += (static_cast<acc_t>(beta_u[j]) + acc_t(0.5) * std::log(vr)) * mass_[j];
      }
      logit[j] = lam * (static_cast<acc_t>(beta_a[j]) - cost);
    }
  }

  // The E-step after iteration t (statistics st): R_ = softmax_j(log a_j + log p_ij), in the log domain.
  void e_step(const vote_t* V, const acc_t* st) {
    const int64_t I = d_.I, J = d_.J, H = d_.H, JH = J * H;
    const acc_t* mu = st;
    const acc_t* var = st + JH;
    const acc_t* logit = st + 2 * JH;
    const acc_t half_log_2pi = acc_t(0.9189385332046727);
    for (int64_t j = 0; j < J; ++j) {
      acc_t norm = log_sigmoid(logit[j]);
      for (int64_t h = 0; h < H; ++h) norm -= acc_t(0.5) * std::log(var[j * H + h]) + half_log_2pi;
      norm_[j] = norm;
    }
    for (int64_t i = 0; i < I; ++i) {
      acc_t* Ri = R_.data() + i * J;
      acc_t max_log = -INFINITY;
      for (int64_t j = 0; j < J; ++j) {
        const vote_t* v = V + (i * J + j) * H;
        acc_t log_p = norm_[j];
        for (int64_t h = 0; h < H; ++h) {
          const acc_t diff = static_cast<acc_t>(v[h]) - mu[j * H + h];
          log_p -= diff * diff / (acc_t(2) * var[j * H + h]);
        }
        Ri[j] = log_p;
        max_log = log_p > max_log ? log_p : max_log;
      }
      acc_t denom = 0;
      for (int64_t j = 0; j < J; ++j) denom += (Ri[j] = std::exp(Ri[j] - max_log));
      for (int64_t j = 0; j < J; ++j) Ri[j] /= denom;
    }
  }

  void reset_assignments() { std::fill(R_.begin(), R_.end(), acc_t(1) / acc_t(d_.J)); }
  const std::vector<acc_t>& assignments() const { return R_; }

 private:
  EmDims d_;
  std::vector<acc_t> R_, mass_, norm_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_cpu(const at::Tensor& votes_in, const at::Tensor& a_in_in,
                                                              const at::Tensor& beta_u_in, const at::Tensor& beta_a_in,
                                                              int64_t iters, double final_lambda, double eps) {
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  const at::Tensor votes = votes_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const int64_t B = votes.size(0);
  const EmDims dims{votes.size(1), votes.size(2), votes.size(3), iters, final_lambda, eps};
  const int64_t JH = dims.J * dims.H, stats_numel = iters * dims.J * dims.stats_row();
  at::Tensor pose = at::empty({B, dims.J, dims.H}, votes.options());
  at::Tensor a_out = at::empty({B, dims.J}, votes.options());
  at::Tensor stats = at::empty({B, iters, dims.J, dims.stats_row()}, votes.options().dtype(acc_dtype(votes.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* V = votes.const_data_ptr<scalar_t>();
    const scalar_t* a = a_in.const_data_ptr<scalar_t>();
    const scalar_t* bu = beta_u.const_data_ptr<scalar_t>();
    const scalar_t* ba = beta_a.const_data_ptr<scalar_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      EmElement<scalar_t, acc_t> em(dims);
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* Vn = V + n * dims.I * JH;
        acc_t* st = stats.data_ptr<acc_t>() + n * stats_numel;
        em.reset_assignments();
        for (int64_t t = 0; t < iters; ++t) {
          acc_t* st_t = st + t * dims.J * dims.stats_row();
          em.m_step(Vn, a + n * dims.I, bu, ba, t, st_t);
          if (t < iters - 1) em.e_step(Vn, st_t);
        }
        const acc_t* last = st + (iters - 1) * dims.J * dims.stats_row();
        for (int64_t jh = 0; jh < JH; ++jh) pose.data_ptr<scalar_t>()[n * JH + jh] = static_cast<scalar_t>(last[jh]);
        for (int64_t j = 0; j < dims.J; ++j)
          a_out.data_ptr<scalar_t>()[n * dims.J + j] = static_cast<scalar_t>(sigmoid(last[2 * JH + j]));
      }
    });
  });
  return {pose, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> em_routing_backward_cpu(
    const at::Tensor& grad_pose_in, const at::Tensor& grad_a_out_in, const at::Tensor& votes_in,
    const at::Tensor& a_in_in, const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, const at::Tensor& stats_in,
    double final_lambda, double eps) {
  const int64_t iters = stats_in.dim() == 4 ? stats_in.size(1) : 0;
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  const int64_t B = votes_in.size(0);
  const EmDims dims{votes_in.size(1), votes_in.size(2), votes_in.size(3), iters, final_lambda, eps};
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H, row = dims.stats_row();
  TORCH_CHECK(stats_in.size(0) == B && stats_in.size(2) == J && stats_in.size(3) == row,
              "capsroute: stats must have shape (B, iters, J, 2H+1) = (", B, ", iters, ", J, ", ", row, "), got ",
              stats_in.sizes());
  TORCH_CHECK(grad_pose_in.sizes() == at::IntArrayRef({B, J, H}), "capsroute: grad_pose must have shape (", B, ", ",
              J, ", ", H, "), got ", grad_pose_in.sizes());
  TORCH_CHECK(grad_a_out_in.sizes() == at::IntArrayRef({B, J}), "capsroute: grad_a_out must have shape (", B, ", ",
              J, "), got ", grad_a_out_in.sizes());
  const at::ScalarType acc = acc_dtype(votes_in.scalar_type());
  const at::Tensor votes = votes_in.contiguous(), a_in = a_in_in.contiguous();
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const at::Tensor grad_pose = grad_pose_in.to(acc).contiguous(), grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  at::Tensor grad_votes = at::empty_like(votes);
  at::Tensor grad_a_in = at::empty_like(a_in);
  // Per-item beta gradients, summed afterwards in a fixed order (deterministic).
  at::Tensor grad_beta_items = at::zeros({B, 2, J}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* V = votes.const_data_ptr<scalar_t>();
    const scalar_t* a_all = a_in.const_data_ptr<scalar_t>();
    const scalar_t* bu = beta_u.const_data_ptr<scalar_t>();
    const acc_t e = static_cast<acc_t>(eps);
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      EmElement<scalar_t, acc_t> em(dims);
      std::vector<acc_t> R_hist(iters * I * J), g_V(I * JH), g_R(I * J), g_mu(JH), g_var(JH), g_logit(J), mass(J),
          g_mass(J), g_a_acc(I);
      for (int64_t n = begin; n < end; ++n) {
        const scalar_t* Vn = V + n * I * JH;
        const scalar_t* a = a_all + n * I;
        const acc_t* st = stats.const_data_ptr<acc_t>() + n * iters * J * row;
        acc_t* g_beta_u = grad_beta_items.data_ptr<acc_t>() + n * 2 * J;
        acc_t* g_beta_a = g_beta_u + J;
        // R^t for every iteration, from the saved statistics.
        em.reset_assignments();
        for (int64_t t = 0; t < iters; ++t) {
          std::copy(em.assignments().begin(), em.assignments().end(), R_hist.begin() + t * I * J);
          if (t < iters - 1) em.e_step(Vn, st + t * J * row);
        }
        std::fill(g_V.begin(), g_V.end(), acc_t(0));
        scalar_t* g_a = grad_a_in.data_ptr<scalar_t>() + n * I;
        std::fill(g_a_acc.begin(), g_a_acc.end(), acc_t(0));
        // Gradients reaching the last M-step's outputs.
        const acc_t* last = st + (iters - 1) * J * row;
        for (int64_t jh = 0; jh < JH; ++jh) g_mu[jh] = grad_pose.const_data_ptr<acc_t>()[n * JH + jh];
        std::fill(g_var.begin(), g_var.end(), acc_t(0));
        for (int64_t j = 0; j < J; ++j) {
          const acc_t s = sigmoid(last[2 * JH + j]);
          g_logit[j] = grad_a_out.const_data_ptr<acc_t>()[n * J + j] * s * (1 - s);
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
            const acc_t* R_next = R_hist.data() + (t + 1) * I * J;
            for (int64_t i = 0; i < I; ++i) {
              acc_t weighted = 0;
              for (int64_t j = 0; j < J; ++j) weighted += R_next[i * J + j] * g_R[i * J + j];
              for (int64_t j = 0; j < J; ++j) {
                const acc_t g_L = R_next[i * J + j] * (g_R[i * J + j] - weighted);
                g_logit[j] += g_L * (1 - sigmoid(logit[j]));  // d log sigmoid(x) / dx = 1 - sigmoid(x)
                const scalar_t* v = Vn + (i * J + j) * H;
                acc_t* gv = g_V.data() + (i * J + j) * H;
                for (int64_t h = 0; h < H; ++h) {
                  const acc_t inv_var = 1 / var[j * H + h];
                  const acc_t diff = static_cast<acc_t>(v[h]) - mu[j * H + h];
                  gv[h] -= g_L * diff * inv_var;
                  g_mu[j * H + h] += g_L * diff * inv_var;
                  g_var[j * H + h] += g_L * acc_t(0.5) * inv_var * (diff * diff * inv_var - 1);
                }
              }
            }
          }
          // M-step t: r = R^t a, m = sum_i r, M = m + eps, mu = sum_i r V / M,
          // var = sum_i r (V - mu)^2 / M + eps, logit = lam (beta_a - sum_h (beta_u + ln(var) / 2) m).
          const acc_t* R = R_hist.data() + t * I * J;
          std::fill(mass.begin(), mass.end(), acc_t(0));
          for (int64_t i = 0; i < I; ++i)
            for (int64_t j = 0; j < J; ++j) mass[j] += R[i * J + j] * static_cast<acc_t>(a[i]);
          const acc_t lam = dims.lambda(t);
          for (int64_t j = 0; j < J; ++j) {
            const acc_t g_cost = -lam * g_logit[j];  // the same for every h
            g_beta_a[j] += lam * g_logit[j];
            g_beta_u[j] += g_cost * static_cast<acc_t>(H) * mass[j];
            acc_t g_m = 0;
            for (int64_t h = 0; h < H; ++h) {
              g_var[j * H + h] += g_cost * acc_t(0.5) * mass[j] / var[j * H + h];
              g_m += g_cost * (static_cast<acc_t>(bu[j]) + acc_t(0.5) * std::log(var[j * H + h]));
            }
            g_mass[j] = g_m;
          }
          // var0 = var - eps also depends on mu through sum_i r (V - mu) = eps mu: fold that into g_mu.
          for (int64_t jh = 0; jh < JH; ++jh) {
            const acc_t M = mass[jh / H] + e;
            g_mu[jh] -= g_var[jh] * 2 * e * mu[jh] / M;
          }
          for (int64_t i = 0; i < I; ++i) {
            const acc_t ai = static_cast<acc_t>(a[i]);
            acc_t g_ai = 0;
            for (int64_t j = 0; j < J; ++j) {
              const acc_t M = mass[j] + e;
              const acc_t r = R[i * J + j] * ai;
              const scalar_t* v = Vn + (i * J + j) * H;
              acc_t* gv = g_V.data() + (i * J + j) * H;
              acc_t g_r = g_mass[j];
              for (int64_t h = 0; h < H; ++h) {
                const acc_t diff = static_cast<acc_t>(v[h]) - mu[j * H + h];
                const acc_t var0 = var[j * H + h] - e;
                g_r += (g_mu[j * H + h] * diff + g_var[j * H + h] * (diff * diff - var0)) / M;
                gv[h] += r * (g_mu[j * H + h] + 2 * g_var[j * H + h] * diff) / M;
              }
              g_R[i * J + j] = g_r * ai;
              g_ai += g_r * R[i * J + j];
            }
            g_a_acc[i] += g_ai;
          }
        }
        for (int64_t i = 0; i < I; ++i) g_a[i] = static_cast<scalar_t>(g_a_acc[i]);
        scalar_t* g_votes = grad_votes.data_ptr<scalar_t>() + n * I * JH;
        for (int64_t k = 0; k < I * JH; ++k) g_votes[k] = static_cast<scalar_t>(g_V[k]);
      }
    });
  });
  const at::Tensor grad_betas = grad_beta_items.sum(0).to(votes.scalar_type());
  return {grad_votes, grad_a_in, grad_betas[0], grad_betas[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("em_routing", &em_routing_cpu);
  m.impl("_em_routing_backward", &em_routing_backward_cpu);
}

}  // namespace capsroute
