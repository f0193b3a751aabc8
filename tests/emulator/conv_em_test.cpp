// The conv_em_routing kernels (csrc/cuda/conv_em_kernels.cuh) on the host emulator, run by the
// launch sequences the op uses (csrc/cuda/conv_em_sequence.cuh), against a long double reference
// of docs/ops.md's definition: the forward with every vote and assignment stored, recorded on a
// scalar tape whose reverse sweep gives every gradient (an oracle that shares no code with the
// kernels' hand-derived backward). Statistics, outputs and the gradients of pose, a_in, weight,
// beta_u and beta_a, for stride 1 and 2, padding 0 and 1, K = 1 and 3 (children no window
// contains, windows wholly on padding), C_out = 3 and 5, B = 1 and 2, one to three iterations,
// float and double (float16/bfloat16 storage on one shape), grids smaller than the launches ask
// for and several chunk counts of the weight gradient. Workspaces start as NaN. Prints one line
// per failure; exits 1 if there is any.
//   conv_em_test [quick | small]   (small: every kernel once on one small shape)
#include "emu.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../../csrc/cuda/conv_em_kernels.cuh"
#include "../../csrc/cuda/conv_em_sequence.cuh"

using namespace capsroute;
using namespace capsroute::cuda;
using Real = long double;

// ---- a scalar tape: each node's value and its (at most two) parents' partial derivatives ----
struct Tape {
  struct Node {
    Real value;
    int64_t a, b;
    Real da, db;
  };
  std::vector<Node> nodes;
  std::vector<Real> reverse(const std::vector<std::pair<int64_t, Real>>& seeds) const {
    std::vector<Real> g(nodes.size(), 0);
    for (const auto& [id, s] : seeds) g[id] += s;
    for (int64_t k = static_cast<int64_t>(nodes.size()) - 1; k >= 0; --k) {
      const Node& n = nodes[k];
      if (n.a >= 0) g[n.a] += g[k] * n.da;
      if (n.b >= 0) g[n.b] += g[k] * n.db;
    }
    return g;
  }
};
static Tape tape;

struct Var {
  int64_t id;
  Real value() const { return tape.nodes[id].value; }
};
Var node(Real v, int64_t a = -1, Real da = 0, int64_t b = -1, Real db = 0) {
  tape.nodes.push_back({v, a, b, da, db});
  return {static_cast<int64_t>(tape.nodes.size()) - 1};
}
Var operator+(Var x, Var y) { return node(x.value() + y.value(), x.id, 1, y.id, 1); }
Var operator-(Var x, Var y) { return node(x.value() - y.value(), x.id, 1, y.id, -1); }
Var operator*(Var x, Var y) {
  return node(x.value() * y.value(), x.id, y.value(), y.id, x.value());
}
Var operator/(Var x, Var y) {
  const Real q = x.value() / y.value();
  return node(q, x.id, 1 / y.value(), y.id, -q / y.value());
}
Var operator+(Var x, Real c) { return node(x.value() + c, x.id, 1); }
Var operator*(Real c, Var x) { return node(c * x.value(), x.id, c); }
Var exp(Var x) {
  const Real e = std::exp(x.value());
  return node(e, x.id, e);
}
Var log(Var x) { return node(std::log(x.value()), x.id, 1 / x.value()); }
Var log_sigmoid(Var x) {  // -log(1 + exp(-x)), each branch free of overflow
  const Real v = x.value();
  const Real s = v >= 0 ? 1 / (1 + std::exp(-v)) : std::exp(v) / (1 + std::exp(v));
  return node(v >= 0 ? -std::log1p(std::exp(-v)) : v - std::log1p(std::exp(v)), x.id, 1 - s);
}
Var sigmoid(Var x) {
  const Real v = x.value();
  const Real s = v >= 0 ? 1 / (1 + std::exp(-v)) : std::exp(v) / (1 + std::exp(v));
  return node(s, x.id, s * (1 - s));
}

struct Case {
  int64_t B, H, W, C_in, C_out, K, stride, padding, iters;
  unsigned grid;
};

// The reference's results (long double) and the kernels' (gathered as long double).
struct Results {
  std::vector<Real> stats, pose_out, a_out, g_pose, g_a, g_weight, g_beta_u, g_beta_a;
};

// The reference: docs/ops.md, conv_em_routing, with every assignment stored.
Results reference(const ConvEmDims& d, const std::vector<Real>& pose, const std::vector<Real>& a,
                  const std::vector<Real>& weight, const std::vector<Real>& bu,
                  const std::vector<Real>& ba, const std::vector<Real>& g_pose_out,
                  const std::vector<Real>& g_a_out, Real eps) {
  tape.nodes.clear();
  const auto leaves = [](const std::vector<Real>& v) {
    std::vector<Var> out;
    for (Real x : v) out.push_back(node(x));
    return out;
  };
  const std::vector<Var> P = leaves(pose), A = leaves(a), Wt = leaves(weight), BU = leaves(bu),
                         BA = leaves(ba);
  const int64_t Ho = d.Ho(), Wo = d.Wo(), J = d.C_out, windows = d.B * Ho * Wo,
                E = d.K * d.K * d.C_in;
  const int64_t children = d.B * d.H * d.W * d.C_in;
  // child[n * E + e]: window n's child e = (ky K + kx) C_in + c, or -1 on padding.
  std::vector<int64_t> child(windows * E, -1);
  std::vector<int64_t> cover(children, 0);
  for (int64_t n = 0; n < windows; ++n) {
    const int64_t b = n / (Ho * Wo), y = n / Wo % Ho, x = n % Wo;
    for (int64_t ky = 0; ky < d.K; ++ky)
      for (int64_t kx = 0; kx < d.K; ++kx) {
        const int64_t iy = y * d.stride - d.padding + ky, ix = x * d.stride - d.padding + kx;
        if (iy < 0 || iy >= d.H || ix < 0 || ix >= d.W) continue;
        for (int64_t c = 0; c < d.C_in; ++c) {
          const int64_t i = ((b * d.H + iy) * d.W + ix) * d.C_in + c;
          child[n * E + (ky * d.K + kx) * d.C_in + c] = i;
          if (c == 0) ++cover[i];
        }
      }
  }
  for (int64_t i = 0; i < children; ++i) cover[i] = cover[i - i % d.C_in];
  // Votes V[((n E + e) J + o) 16 + h] and assignments R[(n E + e) J + o].
  std::vector<Var> V(windows * E * J * kPoseSize, Var{-1}), R(windows * E * J, Var{-1});
  for (int64_t n = 0; n < windows; ++n)
    for (int64_t e = 0; e < E; ++e) {
      const int64_t i = child[n * E + e];
      if (i < 0) continue;
      for (int64_t o = 0; o < J; ++o) {
        const int64_t m = (e * J + o) * kPoseSize;  // weight[ky, kx, c, o]
        for (int64_t r = 0; r < 4; ++r)
          for (int64_t col = 0; col < 4; ++col) {
            Var s = P[i * 16 + r * 4] * Wt[m + col];
            for (int64_t k = 1; k < 4; ++k) s = s + P[i * 16 + r * 4 + k] * Wt[m + k * 4 + col];
            V[((n * E + e) * J + o) * 16 + r * 4 + col] = s;
          }
        R[(n * E + e) * J + o] = node(Real(1) / (cover[i] * J));
      }
    }
  std::vector<Real> stats(windows * d.iters * J * kStatsRow);
  std::vector<Var> mu(windows * J * 16, Var{-1}), var(windows * J * 16, Var{-1}),
      logit(windows * J, Var{-1});
  for (int64_t t = 0; t < d.iters; ++t) {
    const Real lam = static_cast<Real>(em_lambda(d.final_lambda, t));
    for (int64_t n = 0; n < windows; ++n)
      for (int64_t o = 0; o < J; ++o) {
        const auto vote = [&](int64_t e, int h) { return V[((n * E + e) * J + o) * 16 + h]; };
        Var mass = node(0), sum[16], sq[16];
        for (int h = 0; h < 16; ++h) sum[h] = sq[h] = node(0);
        for (int64_t e = 0; e < E; ++e) {
          const int64_t i = child[n * E + e];
          if (i < 0) continue;
          const Var r = R[(n * E + e) * J + o] * A[i];
          mass = mass + r;
          for (int h = 0; h < 16; ++h) sum[h] = sum[h] + r * vote(e, h);
        }
        const Var M = mass + eps;
        Var* m = &mu[(n * J + o) * 16];
        for (int h = 0; h < 16; ++h) m[h] = sum[h] / M;
        for (int64_t e = 0; e < E; ++e) {
          const int64_t i = child[n * E + e];
          if (i < 0) continue;
          const Var r = R[(n * E + e) * J + o] * A[i];
          for (int h = 0; h < 16; ++h) {
            const Var diff = vote(e, h) - m[h];
            sq[h] = sq[h] + r * diff * diff;
          }
        }
        Var cost = node(0);
        for (int h = 0; h < 16; ++h) {
          var[(n * J + o) * 16 + h] = sq[h] / M + eps;
          cost = cost + (BU[o] + Real(0.5) * log(var[(n * J + o) * 16 + h])) * mass;
        }
        logit[n * J + o] = lam * (BA[o] - cost);
        Real* st = stats.data() + (n * d.iters + t) * J * kStatsRow;
        for (int h = 0; h < 16; ++h) {
          st[o * 16 + h] = m[h].value();
          st[(J + o) * 16 + h] = var[(n * J + o) * 16 + h].value();
        }
        st[2 * J * 16 + o] = logit[n * J + o].value();
      }
    if (t == d.iters - 1) break;
    // E-step: L_ij = ln a_j + ln p_ij, R_ij = exp(L_ij - Z_i), Z_i = top_i + ln sum exp(L - top_i)
    // over the child's pairs (top_i a constant: the sum is exact whatever it is).
    std::vector<Var> L(windows * E * J, Var{-1});
    std::vector<Real> top(children, -INFINITY);
    for (int64_t n = 0; n < windows; ++n)
      for (int64_t o = 0; o < J; ++o) {
        Var lp = log_sigmoid(logit[n * J + o]);
        for (int h = 0; h < 16; ++h)
          lp = lp - (Real(0.5) * log(var[(n * J + o) * 16 + h]) + Real(0.9189385332046727));
        for (int64_t e = 0; e < E; ++e) {
          const int64_t i = child[n * E + e];
          if (i < 0) continue;
          Var l = lp;
          for (int h = 0; h < 16; ++h) {
            const Var diff = V[((n * E + e) * J + o) * 16 + h] - mu[(n * J + o) * 16 + h];
            l = l - diff * diff / (Real(2) * var[(n * J + o) * 16 + h]);
          }
          L[(n * E + e) * J + o] = l;
          top[i] = std::max(top[i], l.value());
        }
      }
    std::vector<Var> total(children, Var{-1});
    for (int64_t i = 0; i < children; ++i) total[i] = node(0);
    for (int64_t k = 0; k < windows * E; ++k)
      for (int64_t o = 0; o < J && child[k] >= 0; ++o)
        total[child[k]] = total[child[k]] + exp(L[k * J + o] + (-top[child[k]]));
    for (int64_t k = 0; k < windows * E; ++k)
      for (int64_t o = 0; o < J && child[k] >= 0; ++o)
        R[k * J + o] = exp(L[k * J + o] - (log(total[child[k]]) + top[child[k]]));
  }
  // Outputs, and the reverse sweep from sum g_pose_out pose_out + g_a_out a_out.
  Results out;
  out.stats = stats;
  std::vector<std::pair<int64_t, Real>> seeds;
  for (int64_t k = 0; k < windows * J; ++k) {
    for (int h = 0; h < 16; ++h) {
      out.pose_out.push_back(mu[k * 16 + h].value());
      seeds.push_back({mu[k * 16 + h].id, g_pose_out[k * 16 + h]});
    }
    const Var s = sigmoid(logit[k]);
    out.a_out.push_back(s.value());
    seeds.push_back({s.id, g_a_out[k]});
  }
  const std::vector<Real> g = tape.reverse(seeds);
  const auto grads = [&](const std::vector<Var>& leaves) {
    std::vector<Real> v;
    for (const Var& x : leaves) v.push_back(g[x.id]);
    return v;
  };
  out.g_pose = grads(P);
  out.g_a = grads(A);
  out.g_weight = grads(Wt);
  out.g_beta_u = grads(BU);
  out.g_beta_a = grads(BA);
  return out;
}

std::mt19937_64 rng(8765);
std::vector<Real> randn(int64_t n, double scale = 1.0) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<Real> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
std::vector<Real> randu(int64_t n) {
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<Real> v(n);
  for (auto& x : v) x = ud(rng);
  return v;
}
template <typename T>
std::vector<T> cast(const std::vector<Real>& v) {
  std::vector<T> o(v.size());
  for (size_t k = 0; k < v.size(); ++k) o[k] = static_cast<T>(v[k]);
  return o;
}
template <typename T>
std::vector<Real> widen(const std::vector<T>& v) {
  std::vector<Real> o(v.size());
  for (size_t k = 0; k < v.size(); ++k) o[k] = static_cast<Real>(v[k]);
  return o;
}
template <typename T>
std::vector<T> nans(int64_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

static int failures = 0, checks = 0;
static double worst = 0;

// max |got - want| / max |want| (NaN anywhere in got: infinite).
double rel_err(const std::vector<Real>& got, const std::vector<Real>& want) {
  if (got.size() != want.size()) return INFINITY;
  double maxabs = 0, maxdiff = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    if (std::isnan(double(got[k]))) return INFINITY;
    maxabs = std::max(maxabs, std::fabs(double(want[k])));
    maxdiff = std::max(maxdiff, std::fabs(double(got[k] - want[k])));
  }
  return maxdiff == 0 ? 0 : maxdiff / std::max(maxabs, 1e-300);
}

void judge(const std::string& what, const std::vector<Real>& got, const std::vector<Real>& want,
           double tol) {
  ++checks;
  const double err = rel_err(got, want);
  worst = std::max(worst, err);
  if (err <= tol) return;
  std::printf("  FAIL %s: rel err %.3e (tolerance %.1e)\n", what.c_str(), err, tol);
  ++failures;
}

// The kernels on the case's inputs rounded to S (accumulating in A), and the reference on the same
// rounded inputs; tol for what the kernels keep in A, out_tol for what they store in S.
template <typename S, typename A>
void test_case(const Case& cs, const char* tname, double tol, double out_tol,
               const std::vector<int64_t>& chunk_counts) {
  const ConvEmDims d{cs.B, cs.H,      cs.W,       cs.C_in,  cs.C_out,
                     cs.K, cs.stride, cs.padding, cs.iters, 1.0};
  const int64_t J = cs.C_out, windows = cs.B * d.Ho() * d.Wo(),
                children = cs.B * cs.H * cs.W * cs.C_in, matrices = cs.K * cs.K * cs.C_in * J;
  const double eps = 1e-6;
  // Rounded to S first, so that both sides see the same inputs.
  const auto pose = cast<S>(randn(children * 16)), a = cast<S>(randu(children)),
             weight = cast<S>(randn(matrices * 16, 0.5)), bu = cast<S>(randn(J, 0.5)),
             ba = cast<S>(randn(J, 0.5));
  const auto g_pose_out = cast<A>(randn(windows * J * 16)), g_a_out = cast<A>(randn(windows * J));
  const Results want = reference(d, widen(pose), widen(a), widen(weight), widen(bu), widen(ba),
                                 widen(g_pose_out), widen(g_a_out), eps);
  const ConvEmInputs<S, A> in{d,         pose.data(), a.data(), weight.data(),
                              bu.data(), ba.data(),   A(eps)};
  const EmuLaunch launch{cs.grid, kBlockThreads};
  auto e_rows = nans<A>(windows * (cs.iters - 1) * J * kStatsRow),
       log_norm = nans<A>((cs.iters - 1) * children);
  const ConvEmWorkspace<A> ws{e_rows.data(), log_norm.data()};
  auto stats = nans<A>(windows * cs.iters * J * kStatsRow);
  auto pose_out = nans<S>(windows * J * 16), a_out = nans<S>(windows * J);
  run_conv_em_forward(launch, in, ws, stats.data(), pose_out.data(), a_out.data());
  char name[200];
  std::snprintf(name, sizeof name,
                "%s B=%ld H=%ld W=%ld C_in=%ld C_out=%ld K=%ld stride=%ld "
                "padding=%ld iters=%ld ",
                tname, long(cs.B), long(cs.H), long(cs.W), long(cs.C_in), long(cs.C_out),
                long(cs.K), long(cs.stride), long(cs.padding), long(cs.iters));
  const std::string p = name;
  judge(p + "stats", widen(stats), want.stats, tol);
  judge(p + "pose_out", widen(pose_out), want.pose_out, out_tol);
  judge(p + "a_out", widen(a_out), want.a_out, out_tol);
  for (const int64_t chunks : chunk_counts) {
    // The workspaces the forward left are NaN again: the backward fills them from stats.
    std::fill(e_rows.begin(), e_rows.end(), std::numeric_limits<A>::quiet_NaN());
    std::fill(log_norm.begin(), log_norm.end(), std::numeric_limits<A>::quiet_NaN());
    auto m_rows = nans<A>(windows * cs.iters * J * kStatsRow),
         child_sums = nans<A>((cs.iters - 1) * children), g_beta = nans<A>(windows * 2 * J),
         parts = nans<A>(chunks * matrices * 16);
    const ConvEmBackwardWorkspace<A> bws{m_rows.data(), child_sums.data(), g_beta.data(),
                                         parts.data()};
    auto g_pose = nans<S>(children * 16), g_a = nans<S>(children);
    auto g_weight = nans<A>(matrices * 16);
    run_conv_em_backward(launch, in,
                         ConvEmSaved<A>{stats.data(), g_pose_out.data(), g_a_out.data()}, ws, bws,
                         chunks, g_pose.data(), g_a.data(), g_weight.data());
    std::vector<Real> g_beta_u(J, 0), g_beta_a(J, 0);
    for (int64_t n = 0; n < windows; ++n)
      for (int64_t o = 0; o < J; ++o) {
        g_beta_u[o] += g_beta[n * 2 * J + o];
        g_beta_a[o] += g_beta[n * 2 * J + J + o];
      }
    const std::string q = p + "chunks=" + std::to_string(chunks) + " ";
    judge(q + "grad_pose", widen(g_pose), want.g_pose, out_tol);
    judge(q + "grad_a_in", widen(g_a), want.g_a, out_tol);
    judge(q + "grad_weight", widen(g_weight), want.g_weight, tol);
    judge(q + "grad_beta_u", g_beta_u, want.g_beta_u, tol);
    judge(q + "grad_beta_a", g_beta_a, want.g_beta_a, tol);
  }
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "full";
  if (mode != "full" && mode != "quick" && mode != "small") {
    std::fprintf(stderr, "usage: conv_em_test [quick | small]\n");
    return 2;
  }
  // B, H, W, C_in, C_out, K, stride, padding, iters, emulated grid.
  std::vector<Case> cases = {
      {1, 4, 4, 2, 3, 3, 1, 0, 3, 2},  // overlapping windows, every child in 1 to 4
      {2, 5, 4, 2, 5, 3, 2, 1, 2, 3},  // stride 2, padding 1
      {2, 3, 3, 3, 3, 1, 1, 0, 3, 2},  // K = 1: one window per child
      {1, 5, 5, 2, 3, 1, 2, 1, 2, 2},  // K = 1, stride 2: uncovered children, windows on padding
      {2, 4, 5, 2, 3, 3, 1, 1, 1, 3},  // one iteration
  };
  if (mode == "quick") cases.resize(2);
  if (mode == "small") cases = {{1, 4, 3, 2, 3, 3, 2, 1, 2, 2}};
  for (const Case& cs : cases) {
    test_case<double, double>(cs, "double", 1e-11, 1e-11, {1, 3});
    if (mode != "small") test_case<float, float>(cs, "float", 2e-4, 2e-4, {2});
  }
  if (mode == "full") {
    test_case<c10::Half, float>(cases[1], "float16", 2e-4, 1e-3, {2});
    test_case<c10::BFloat16, float>(cases[1], "bfloat16", 2e-4, 8e-3, {2});
  }
  std::printf("%d checks, worst rel err %.3e\n", checks, worst);
  std::printf(failures ? "%d failures\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
