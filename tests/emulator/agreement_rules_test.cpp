// The block routing kernels (csrc/cuda/agreement_block_kernels.cuh) under the attention routings'
// rules (csrc/common/agreement_rules.h) on the host emulator: self_attention_routing
// (agree_with_mean, an identity pass then squash_exp or squash, a coupling bias or none) and
// inverted_attention_routing (replace, layer_norm with or without its affine parameters), forward
// (v, c, s_hist) and backward (the vote gradient and the parameters' gradients from their items,
// summed here), fused and with the rows split over 2 and 3 blocks, in float64 and float32, against
// a plain double-precision implementation of the rule's loop and its reverse mode (itself checked
// against central differences of its forward on a small shape). Workspaces start as NaN, so a value
// the kernels forget to write shows. Prints one line per failure; exits 1 if there is any.
//   agreement_rules_test [full | small]
// small: one shape of each op in float64, fused and split over 2 blocks: small enough for a
// ThreadSanitizer build.
#include "emu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "../../csrc/cuda/agreement_block_kernels.cuh"
#include "../../csrc/cuda/agreement_sequence.cuh"
#include "../../csrc/cuda/vote_sources.cuh"

using namespace capsroute;
using namespace capsroute::cuda;

namespace {

std::mt19937_64 rng(39);
int failures = 0;

std::vector<double> randn(int64_t n, double scale) {
  std::normal_distribution<double> normal(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = normal(rng);
  return v;
}

template <typename T, typename U>
std::vector<T> cast(const std::vector<U>& v) {
  return std::vector<T>(v.begin(), v.end());
}

template <typename T>
std::vector<T> nans(int64_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

template <typename T>
void compare(const std::string& label, const char* what, const std::vector<T>& got,
             const std::vector<double>& want, double tol) {
  double max_want = 0, max_diff = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    max_want = std::max(max_want, std::fabs(want[k]));
    const double diff = std::fabs(double(got[k]) - want[k]);
    max_diff = std::max(max_diff, std::isnan(diff) ? INFINITY : diff);
  }
  const double rel = max_diff / std::max(max_want, 1e-30);
  if (!(rel <= tol) || got.size() != want.size()) {
    std::printf("FAIL %s %s: relative error %.3e\n", label.c_str(), what, rel);
    ++failures;
  }
}

// An op's rule in double: its parameters (empty where absent) and eps.
struct RuleCase {
  const char* name;
  LogitRule logits;
  Nonlinearity f;
  int64_t iters;
  bool coupling_bias, norm_weight, norm_bias;
  double eps;
};

struct Shape {
  int64_t B, I, J, D;
  unsigned grid;
};

struct Params {
  std::vector<double> coupling_bias, norm_weight, norm_bias;  // (I, J), (D,), (D,)
};

// The op's rule (agreement_rules.h) with these parameters (empty: absent).
template <typename acc_t>
RoutingRule<acc_t> make_rule(const RuleCase& rc, const Shape& sh, const std::vector<acc_t>& cb,
                             const std::vector<acc_t>& w, const std::vector<acc_t>& nb) {
  const auto data = [](const std::vector<acc_t>& p) { return p.empty() ? nullptr : p.data(); };
  return rc.logits == LogitRule::agree_with_mean ? self_attention_rule(sh.J, sh.D, rc.f, data(cb))
                                                 : inverted_attention_rule(sh.D, data(w), data(nb));
}

// ---- the reference: the rule's loop and its reverse mode, one element at a time, in double ----

struct Expected {
  std::vector<double> v, c, s_hist, grad_votes, grad_coupling_bias, grad_norm_weight,
      grad_norm_bias;
};

// v = f(s) of a capsule, and f's VJP (adding layer_norm's parameter gradients).
void capsule_output(Nonlinearity f, const RoutingRule<double>& rule, const double* s, int64_t D,
                    double eps, double* v) {
  if (f == Nonlinearity::layer_norm) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < D; ++d) mean += s[d] / D;
    for (int64_t d = 0; d < D; ++d) var += (s[d] - mean) * (s[d] - mean) / D;
    for (int64_t d = 0; d < D; ++d)
      v[d] = (s[d] - mean) / std::sqrt(var + eps) * (rule.norm_weight ? rule.norm_weight[d] : 1) +
             (rule.norm_bias ? rule.norm_bias[d] : 0);
    return;
  }
  double q = 0;
  for (int64_t d = 0; d < D; ++d) q += s[d] * s[d];
  const double n = std::sqrt(q + eps);
  const double scale = f == Nonlinearity::identity ? 1
                       : q == 0                    ? 0
                       : f == Nonlinearity::squash ? q / (1 + q) / n
                                                   : -std::expm1(-n) / n;
  for (int64_t d = 0; d < D; ++d) v[d] = scale * s[d];
}

void capsule_vjp(Nonlinearity f, const RoutingRule<double>& rule, const double* s, const double* gv,
                 int64_t D, double eps, double* gs, double* gw, double* gb) {
  if (f == Nonlinearity::layer_norm) {
    double mean = 0, var = 0;
    for (int64_t d = 0; d < D; ++d) mean += s[d] / D;
    for (int64_t d = 0; d < D; ++d) var += (s[d] - mean) * (s[d] - mean) / D;
    const double inv_std = 1 / std::sqrt(var + eps);
    double gx_mean = 0, gx_xhat_mean = 0;
    for (int64_t d = 0; d < D; ++d) {
      const double gx = gv[d] * (rule.norm_weight ? rule.norm_weight[d] : 1);
      gx_mean += gx / D;
      gx_xhat_mean += gx * (s[d] - mean) * inv_std / D;
    }
    for (int64_t d = 0; d < D; ++d) {
      const double xhat = (s[d] - mean) * inv_std;
      const double gx = gv[d] * (rule.norm_weight ? rule.norm_weight[d] : 1);
      gs[d] = inv_std * (gx - gx_mean - xhat * gx_xhat_mean);
      gw[d] += gv[d] * xhat;
      gb[d] += gv[d];
    }
    return;
  }
  // Radial: v = scale(q) s, g_s = scale g + 2 scale'(q) <s, g> s (scale' by the quotient rule).
  double q = 0, sg = 0;
  for (int64_t d = 0; d < D; ++d) {
    q += s[d] * s[d];
    sg += s[d] * gv[d];
  }
  double scale = 1, dscale = 0;
  if (f != Nonlinearity::identity && q > 0) {
    const double n = std::sqrt(q + eps), dn = 1 / (2 * n);  // dn/dq
    if (f == Nonlinearity::squash) {
      scale = q / ((1 + q) * n);
      dscale = (1 / ((1 + q) * n)) - q / ((1 + q) * (1 + q) * n) - q / ((1 + q) * n * n) * dn;
    } else {
      scale = -std::expm1(-n) / n;
      dscale = (std::exp(-n) / n - scale / n) * dn;
    }
  } else if (f != Nonlinearity::identity) {
    scale = 0;
  }
  for (int64_t d = 0; d < D; ++d) gs[d] = scale * gv[d] + 2 * dscale * sg * s[d];
}

// The forward of element-major votes (B, I, J, D); with grad_v, the backward too.
Expected reference(const RuleCase& rc, const Shape& sh, const std::vector<double>& votes,
                   const Params& pr, const std::vector<double>* grad_v) {
  const int64_t B = sh.B, I = sh.I, J = sh.J, D = sh.D, JD = J * D, R = rc.iters;
  const RoutingRule<double> rule =
      make_rule(rc, sh, pr.coupling_bias, pr.norm_weight, pr.norm_bias);
  Expected e;
  e.v.assign(B * JD, 0);
  e.c.assign(B * I * J, 0);
  e.s_hist.assign(B * R * JD, 0);
  e.grad_votes.assign(B * I * JD, 0);
  e.grad_coupling_bias.assign(I * J, 0);
  e.grad_norm_weight.assign(D, 0);
  e.grad_norm_bias.assign(D, 0);
  for (int64_t b = 0; b < B; ++b) {
    const double* u = votes.data() + b * I * JD;
    std::vector<double> logits(I * J, 0), c(R * I * J), v(R * JD);
    double* s = e.s_hist.data() + b * R * JD;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        double* li = logits.data() + i * J;
        double* ci = c.data() + (r * I + i) * J;
        for (int64_t j = 0; j < J && r > 0; ++j) {
          double a = 0;
          for (int64_t d = 0; d < D; ++d) a += u[i * JD + j * D + d] * v[(r - 1) * JD + j * D + d];
          li[j] = rule.next_logit(li[j], a);
        }
        const double max_logit = *std::max_element(li, li + J);
        double denom = 0;
        for (int64_t j = 0; j < J; ++j) denom += std::exp(li[j] - max_logit);
        for (int64_t j = 0; j < J; ++j)
          ci[j] = std::exp(li[j] - max_logit) / denom +
                  (r > 0 && rule.coupling_bias ? rule.coupling_bias[i * J + j] : 0);
      }
      for (int64_t i = 0; i < I; ++i)
        for (int64_t jd = 0; jd < JD; ++jd)
          s[r * JD + jd] += c[(r * I + i) * J + jd / D] * u[i * JD + jd];
      for (int64_t j = 0; j < J; ++j)
        capsule_output(rule.pass_nonlinearity(r, R), rule, s + r * JD + j * D, D, rc.eps,
                       v.data() + r * JD + j * D);
    }
    std::copy(v.end() - JD, v.end(), e.v.begin() + b * JD);
    std::copy(c.end() - I * J, c.end(), e.c.begin() + b * I * J);
    if (grad_v == nullptr) continue;
    // Reverse mode: gv^r from the output (r = R - 1) or the logits of pass r + 1 (g_agree, the
    // gradient of the agreements <u_ij, v^r_j>), then gs^r, the couplings' and logits' gradients.
    double* gu = e.grad_votes.data() + b * I * JD;
    std::vector<double> g_logit(I * J, 0), g_agree(I * J, 0), gv(JD), gs(JD);
    for (int64_t r = R - 1; r >= 0; --r) {
      for (int64_t jd = 0; jd < JD; ++jd) gv[jd] = r == R - 1 ? (*grad_v)[b * JD + jd] : 0;
      for (int64_t i = 0; i < I && r < R - 1; ++i)
        for (int64_t jd = 0; jd < JD; ++jd) {
          gv[jd] += g_agree[i * J + jd / D] * u[i * JD + jd];
          gu[i * JD + jd] += g_agree[i * J + jd / D] * v[r * JD + jd];
        }
      for (int64_t j = 0; j < J; ++j)
        capsule_vjp(rule.pass_nonlinearity(r, R), rule, s + r * JD + j * D, gv.data() + j * D, D,
                    rc.eps, gs.data() + j * D, e.grad_norm_weight.data(), e.grad_norm_bias.data());
      for (int64_t i = 0; i < I; ++i)
        for (int64_t jd = 0; jd < JD; ++jd) gu[i * JD + jd] += c[(r * I + i) * J + jd / D] * gs[jd];
      if (r == 0) break;
      for (int64_t i = 0; i < I; ++i) {
        std::vector<double> gc(J), p(J);
        double weighted = 0;
        for (int64_t j = 0; j < J; ++j) {
          gc[j] = 0;
          for (int64_t d = 0; d < D; ++d) gc[j] += gs[j * D + d] * u[i * JD + j * D + d];
          if (rule.coupling_bias) e.grad_coupling_bias[i * J + j] += gc[j];
          p[j] = c[(r * I + i) * J + j] - (rule.coupling_bias ? rule.coupling_bias[i * J + j] : 0);
          weighted += p[j] * gc[j];
        }
        for (int64_t j = 0; j < J; ++j) {
          const int64_t ij = i * J + j;
          // dL/db^r: the softmax VJP, plus dL/db^{r+1} where b^{r+1} = b^r + agreement.
          g_logit[ij] = p[j] * (gc[j] - weighted) +
                        (rule.carries_logit_gradient() && r < R - 1 ? g_logit[ij] : 0);
          g_agree[ij] =
              rule.carries_logit_gradient() ? g_logit[ij] : rule.logit_scale * g_logit[ij];
        }
      }
    }
  }
  return e;
}

// The reference's backward against central differences of its forward: the derivative of
// L = <grad_v, v> along random directions of the votes and the parameters.
void check_reference(const RuleCase& rc) {
  const Shape sh{2, 5, 3, 4, 1};
  Params pr;
  if (rc.coupling_bias) pr.coupling_bias = randn(sh.I * sh.J, 0.2);
  if (rc.norm_weight) pr.norm_weight = randn(sh.D, 1.0);
  if (rc.norm_bias) pr.norm_bias = randn(sh.D, 0.5);
  const auto votes = randn(sh.B * sh.I * sh.J * sh.D, 0.7), grad_v = randn(sh.B * sh.J * sh.D, 1);
  const Expected e = reference(rc, sh, votes, pr, &grad_v);
  const auto loss = [&](const std::vector<double>& u, const Params& p) {
    const std::vector<double> v = reference(rc, sh, u, p, nullptr).v;
    double l = 0;
    for (size_t k = 0; k < v.size(); ++k) l += grad_v[k] * v[k];
    return l;
  };
  // (a gradient of an absent parameter along an empty direction: 0)
  const auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
    double sum = 0;
    for (size_t k = 0; k < b.size(); ++k) sum += a[k] * b[k];
    return sum;
  };
  const auto du = randn(votes.size(), 1.0);
  Params dp{randn(pr.coupling_bias.size(), 1.0), randn(pr.norm_weight.size(), 1.0),
            randn(pr.norm_bias.size(), 1.0)};
  const double want = dot(e.grad_votes, du) + dot(e.grad_coupling_bias, dp.coupling_bias) +
                      dot(e.grad_norm_weight, dp.norm_weight) + dot(e.grad_norm_bias, dp.norm_bias);
  const double h = 1e-5;
  const auto moved = [&](double t) {
    std::vector<double> u = votes;
    Params p = pr;
    for (size_t k = 0; k < u.size(); ++k) u[k] += t * du[k];
    for (size_t k = 0; k < p.coupling_bias.size(); ++k)
      p.coupling_bias[k] += t * dp.coupling_bias[k];
    for (size_t k = 0; k < p.norm_weight.size(); ++k) p.norm_weight[k] += t * dp.norm_weight[k];
    for (size_t k = 0; k < p.norm_bias.size(); ++k) p.norm_bias[k] += t * dp.norm_bias[k];
    return loss(u, p);
  };
  const double got = (moved(h) - moved(-h)) / (2 * h);
  if (!(std::fabs(got - want) <= 1e-6 * std::max(1.0, std::fabs(want)))) {
    std::printf("FAIL reference %s: directional derivative %.10g, central difference %.10g\n",
                rc.name, want, got);
    ++failures;
  }
}

// ---- the kernels ----

// The launch sequences the ops run (agreement_sequence.cuh, block kernels with `splits` ranges,
// on at most sh.grid blocks), then the vote gradient's writer, against the reference.
template <typename A>
void check_kernels(const RuleCase& rc, const Shape& sh, int64_t splits, double tol) {
  const int64_t B = sh.B, I = sh.I, J = sh.J, D = sh.D, JD = J * D, R = rc.iters;
  Params pr;
  if (rc.coupling_bias) pr.coupling_bias = cast<double>(cast<A>(randn(I * J, 0.05)));
  if (rc.norm_weight) pr.norm_weight = cast<double>(cast<A>(randn(D, 1.0)));
  if (rc.norm_bias) pr.norm_bias = cast<double>(cast<A>(randn(D, 0.5)));
  const auto votes_d = cast<double>(cast<A>(randn(B * I * JD, 0.5)));
  const auto grad_v_d = cast<double>(cast<A>(randn(B * JD, 1.0)));
  const Expected want = reference(rc, sh, votes_d, pr, &grad_v_d);
  char label_buf[200];
  std::snprintf(label_buf, sizeof label_buf, "%s %s B=%ld I=%ld J=%ld D=%ld iters=%ld splits=%ld",
                rc.name, sizeof(A) == 8 ? "float64" : "float32", long(B), long(I), long(J), long(D),
                long(R), long(splits));
  const std::string label = label_buf;

  const std::vector<A> votes = cast<A>(votes_d), grad_v = cast<A>(grad_v_d);
  const std::vector<A> cb = cast<A>(pr.coupling_bias), w = cast<A>(pr.norm_weight),
                       nb = cast<A>(pr.norm_bias);
  const RoutingRule<A> rule = make_rule(rc, sh, cb, w, nb);
  const RoutingDims dims{B, I, J, D, R, false};
  const RowSplit split{splits, false};
  const MemoryVotes<A, A> src{votes.data(), packed_rows(I, JD)};
  const EmuLaunch launch{sh.grid, kBlockThreads};

  std::vector<A> logits = nans<A>(B * I * J), coupling = nans<A>(B * I * J), v_ws = nans<A>(B * JD);
  std::vector<A> s_hist = nans<A>(B * R * JD), partial = nans<A>(B * splits * JD);
  std::vector<A> v = nans<A>(B * JD), c = nans<A>(B * I * J);
  run_routing_forward(launch, src, static_cast<const A*>(nullptr), dims, A(rc.eps), split,
                      ForwardWorkspace<A>{logits.data(), coupling.data(), v_ws.data()},
                      partial.data(), s_hist.data(), v.data(), c.data(), rule);
  compare(label, "v", v, want.v, tol);
  compare(label, "c", c, want.c, tol);
  compare(label, "s_hist", s_hist, want.s_hist, tol);

  // Backward from the kernels' own s_hist; the items zeroed, as the op does.
  std::vector<A> v_hist = nans<A>(B * R * JD), gs_hist = nans<A>(B * R * JD);
  std::vector<A> coupling_hist = nans<A>(B * R * I * J), g_logits = nans<A>(B * R * I * J);
  std::vector<A> gv = nans<A>(B * JD);
  std::vector<A> cb_items(rc.coupling_bias ? B * I * J : 0), w_items(rc.norm_weight ? B * JD : 0),
      nb_items(rc.norm_bias ? B * JD : 0);
  const auto data = [](std::vector<A>& items) { return items.empty() ? nullptr : items.data(); };
  const BackwardState<A> st{v_hist.data(),
                            gs_hist.data(),
                            coupling_hist.data(),
                            g_logits.data(),
                            I,
                            J,
                            D,
                            R,
                            0,
                            R,
                            {data(cb_items), data(w_items), data(nb_items)}};
  std::fill(logits.begin(), logits.end(), std::numeric_limits<A>::quiet_NaN());
  run_routing_backward(launch, src, grad_v.data(), static_cast<const A*>(s_hist.data()), dims,
                       A(rc.eps), split, st, BackwardWorkspace<A>{logits.data(), gv.data()},
                       partial.data(), static_cast<A*>(nullptr), packed_rows(I, JD),
                       static_cast<A*>(nullptr), rule);
  std::vector<A> grad_votes = nans<A>(B * I * JD);
  if (I > 0)
    emu_launch(2, kBlockThreads, write_vote_grad_rows_kernel<A, A>, st, B, packed_rows(I, JD),
               grad_votes.data());
  compare(label, "grad_votes", grad_votes, want.grad_votes, tol);
  // The op's sums of the items: over the batch, and for LayerNorm's over the capsules too.
  const auto summed = [&](const std::vector<A>& items, int64_t outer, int64_t n) {
    std::vector<double> sum(n, 0);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t k = 0; k < n; ++k) sum[k] += items[o * n + k];
    return sum;
  };
  if (rc.coupling_bias)
    compare(label, "grad_coupling_bias", summed(cb_items, B, I * J), want.grad_coupling_bias, tol);
  if (rc.norm_weight)
    compare(label, "grad_norm_weight", summed(w_items, B * J, D), want.grad_norm_weight, tol);
  if (rc.norm_bias)
    compare(label, "grad_norm_bias", summed(nb_items, B * J, D), want.grad_norm_bias, tol);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "full";
  if (mode != "full" && mode != "small") {
    std::fprintf(stderr, "usage: agreement_rules_test [full | small]\n");
    return 2;
  }
  const bool small = mode == "small";
  // name, logit rule, nonlinearity, iters, coupling bias, norm weight, norm bias, eps
  const std::vector<RuleCase> rules = {
      {"self_attention", LogitRule::agree_with_mean, Nonlinearity::squash_exp, 2, true, false,
       false, 1e-8},
      {"inverted_attention", LogitRule::replace, Nonlinearity::layer_norm, 3, false, true, true,
       1e-5},
      {"self_attention sabour", LogitRule::agree_with_mean, Nonlinearity::squash, 2, false, false,
       false, 1e-8},
      {"inverted_attention plain", LogitRule::replace, Nonlinearity::layer_norm, 2, false, false,
       false, 1e-5},
      {"inverted_attention weight", LogitRule::replace, Nonlinearity::layer_norm, 1, false, true,
       false, 1e-5},
  };
  for (const RuleCase& rc : rules) check_reference(rc);
  // B, I, J, D, grid blocks. MNIST-like; J > 32 (lanes with 2 capsules) and J * D > 256 (threads
  // with 2 columns); D = 1 (LayerNorm of a constant: eps alone); an empty element.
  std::vector<Shape> shapes = {
      {3, 47, 10, 16, 2}, {2, 40, 33, 9, 2}, {2, 9, 6, 1, 3}, {2, 0, 4, 4, 2}};
  const size_t rule_count = small ? 2 : rules.size();
  if (small) shapes.resize(1), shapes[0] = {2, 21, 5, 8, 2};
  for (const Shape& sh : shapes)
    for (size_t k = 0; k < rule_count; ++k)
      for (int64_t splits : {1, 2, 3}) {
        if (small && splits > 2) break;
        // The extra rules once, in float64 and on the first shape.
        if (k >= 2 && (&sh != &shapes[0] || splits == 2)) continue;
        check_kernels<double>(rules[k], sh, splits, 1e-11);
        if (!small && k < 2) check_kernels<float>(rules[k], sh, splits, 5e-4);
      }
  std::printf(failures ? "%d failures\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
