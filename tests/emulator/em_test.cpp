// The EM routing kernels (csrc/cuda/em_kernels.cuh) on the host emulator, against the CPU
// backend's element code (csrc/cpu/em_element.h) with the same storage and accumulation types:
// statistics, outputs and every gradient, over votes read from memory, for J, H, I and iteration
// counts around the edge cases (J = 1, I = 0 or 1, one iteration), batches larger than the grid,
// run by the launch sequences the ops use (csrc/cuda/em_sequence.cuh), and the robustness cases of
// docs/ops.md, em_routing (zero activations, identical votes, votes of 1e3; a NaN vote must give
// NaN, not hang). Workspaces start as NaN. Where the two disagree past the tolerance, both are
// compared with the CPU code in long double: the kernels must be as close to it as the CPU code is
// (ill-conditioned cases are reported as such). em_routing_pose too: votes P_i @ W_ij inside the
// kernels, the backward in batch chunks, and the contractions into grad_pose and grad_weight.
// float16/bfloat16 storage with float accumulation (c10::Half / c10::BFloat16 themselves) on a few
// shapes, as the extension instantiates them. Prints one line per failure; exits 1 if there is any.
//   em_test [quick | small]   (small: every kernel once on one small shape, for a ThreadSanitizer
//   build)
#include "emu.h"
#include "strided.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

// The long double "truth" runs the CPU code in long double: the math it calls, in long double.
namespace capsroute {
inline long double acc_exp(long double x) { return std::exp(x); }
inline long double acc_log(long double x) { return std::log(x); }
inline long double acc_log1p(long double x) { return std::log1p(x); }
}  // namespace capsroute

#include "../../csrc/cpu/em_element.h"
#include "../../csrc/cuda/em_kernels.cuh"
#include "../../csrc/cuda/em_sequence.cuh"
#include "../../csrc/cuda/vote_sources.cuh"

using namespace capsroute;
using namespace capsroute::cuda;

std::mt19937_64 rng(4321);
std::vector<double> randn(int64_t n, double scale = 1.0) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}
std::vector<double> randu(int64_t n) {
  std::uniform_real_distribution<double> ud(0.0, 1.0);
  std::vector<double> v(n);
  for (auto& x : v) x = ud(rng);
  return v;
}
template <typename T, typename U>
std::vector<T> cast(const std::vector<U>& v) {
  std::vector<T> o(v.size());
  for (size_t k = 0; k < v.size(); ++k) o[k] = static_cast<T>(v[k]);
  return o;
}
template <typename T>
std::vector<T> nans(int64_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}

static int failures = 0, checks = 0, ill = 0;
static double worst = 0;
template <typename T, typename U>
double rel_err(const std::vector<T>& got, const std::vector<U>& want) {
  if (got.size() != want.size()) return INFINITY;
  double maxabs = 0, maxdiff = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    const double g = static_cast<double>(got[k]), w = static_cast<double>(want[k]);
    maxabs = std::max(maxabs, std::fabs(w));
    double d = std::fabs(g - w);
    if (std::isnan(g) || std::isnan(w)) d = std::isnan(g) && std::isnan(w) ? 0 : INFINITY;
    maxdiff = std::max(maxdiff, d);
  }
  return maxdiff == 0 ? 0 : maxdiff / std::max(maxabs, 1e-300);
}
template <typename T, typename U, typename W>
void judge(const std::string& what, const std::vector<T>& got, const std::vector<U>& want,
           const std::vector<W>& truth, double tol) {
  ++checks;
  const double agree = rel_err(got, want);
  worst = std::max(worst, agree);
  if (agree <= tol) return;
  const double err_emu = rel_err(got, truth), err_cpu = rel_err(want, truth);
  // Roundoff of a different (but fixed) summation order, amplified by the problem: the
  // emulated kernel must be about as close to the long double truth as the CPU code is. "About":
  // on an ill-conditioned case the error of one evaluation order is a sample, not a bound; the
  // CPU code's vector loops (other orders and FMA contractions) moved its own float error by up
  // to 6.6x against the same kernel (B=7 I=13 J=5 H=16 iters=5 lambda=0.01: 7.8e-5 vs 5.1e-4).
  const double slack = 1000 * double(std::numeric_limits<decltype(want[0] * 1)>::epsilon());
  if (err_emu <= 8 * err_cpu + slack) {
    ++ill;
    std::printf("  ill-conditioned %s: emu vs cpu %.2e; vs long double: emu %.2e, cpu %.2e\n",
                what.c_str(), agree, err_emu, err_cpu);
    return;
  }
  std::printf("  FAIL %s: emu vs cpu %.3e; vs long double: emu %.2e, cpu %.2e\n", what.c_str(),
              agree, err_emu, err_cpu);
  ++failures;
}

struct Case {
  int64_t B, I, J, H, iters;
  double final_lambda;
  unsigned grid;
  const char* special;  // "", "a_zero_some", "a_zero_all", "identical", "large"
};

// One element's results: forward and backward, same storage S and accumulation A everywhere.
template <typename S, typename A>
struct Results {
  std::vector<A> stats;
  std::vector<S> pose, a_out;
  std::vector<A> g_V, g_a, g_beta;  // g_beta (2, J), summed over b
  int64_t gaps_written = 0;         // (emu_run)
};

template <typename S, typename A>
Results<S, A> cpu_run(const Case& cs, const std::vector<S>& V, const std::vector<S>& a,
                      const std::vector<S>& bu, const std::vector<S>& ba, const std::vector<A>& gp,
                      const std::vector<A>& ga, double eps) {
  const EmDims d{cs.B, cs.I, cs.J, cs.H, cs.iters, cs.final_lambda};
  const int64_t I = cs.I, J = cs.J, JH = cs.J * cs.H, row = d.stats_row(), sn = cs.iters * J * row;
  Results<S, A> o;
  o.stats.resize(cs.B * sn);
  o.pose.resize(cs.B * JH);
  o.a_out.resize(cs.B * J);
  o.g_V.assign(cs.B * I * JH, A(0));
  o.g_a.assign(cs.B * I, A(0));
  std::vector<A> gb(cs.B * 2 * J, A(0));
  cpu::EmElement<S, A, 0> em(d, eps);  // 0: H not fixed at compile time
  for (int64_t n = 0; n < cs.B; ++n)
    em.forward(cpu::VoteRows<S>{V.data() + n * I * JH, JH, cs.H}, a.data() + n * I, bu.data(),
               ba.data(), o.stats.data() + n * sn, o.pose.data() + n * JH, o.a_out.data() + n * J);
  cpu::EmBackward<S, A, 0> back(d, eps);
  for (int64_t n = 0; n < cs.B; ++n)
    back.run(cpu::VoteRows<S>{V.data() + n * I * JH, JH, cs.H}, a.data() + n * I, bu.data(),
             o.stats.data() + n * sn, gp.data() + n * JH, ga.data() + n * J,
             o.g_V.data() + n * I * JH, o.g_a.data() + n * I, gb.data() + n * 2 * J,
             gb.data() + n * 2 * J + J);
  o.g_beta.assign(2 * J, A(0));
  for (int64_t n = 0; n < cs.B; ++n)
    for (int64_t k = 0; k < 2 * J; ++k) o.g_beta[k] += gb[n * 2 * J + k];
  return o;
}

// splits: the row ranges per element; lanes: how a warp covers a row. The votes read in place from
// `layout` (strided.h), and the vote gradient written at the same strides into a NaN buffer,
// gathered into o.g_V (and o.gaps_written, the values written between its rows).
template <typename S, typename A>
Results<S, A> emu_run(const Case& cs, const std::vector<S>& V, const std::vector<S>& a,
                      const std::vector<S>& bu, const std::vector<S>& ba, const std::vector<A>& gp,
                      const std::vector<A>& ga, double eps, int64_t splits, EmLanes lanes,
                      RowLayout layout) {
  const int64_t B = cs.B, I = cs.I, J = cs.J, H = cs.H, JH = J * H, R = cs.iters;
  const EmDims dims{B, I, J, H, R, cs.final_lambda};
  const StridedRows<S> laid_out = strided_rows(B, I, JH, layout, &V);
  const MemoryVotes<S, A> src{laid_out.data(), laid_out.rows};
  const EmuLaunch launch{cs.grid, kBlockThreads};
  Results<S, A> o;
  o.stats = nans<A>(B * R * dims.stats_block());
  o.pose = nans<S>(B * JH);
  o.a_out = nans<S>(B * J);
  {
    auto Rw = nans<A>(B * I * J), mass = nans<A>(B * J), norm = nans<A>(B * J),
         partial = nans<A>(B * splits * (J + JH));
    const EmForwardWorkspace<A> ws{Rw.data(), mass.data(), norm.data(), partial.data()};
    run_em_forward(launch, src, a.data(), bu.data(), ba.data(), dims, static_cast<A>(eps), splits,
                   lanes, ws, o.stats.data(), o.pose.data(), o.a_out.data());
  }
  auto R_hist = nans<A>(B * R * I * J), g_R = nans<A>(B * I * J), norm = nans<A>(B * R * J);
  auto g_mu = nans<A>(B * JH), g_var = nans<A>(B * JH), g_logit = nans<A>(B * J),
       mass = nans<A>(B * J), g_mass = nans<A>(B * J);
  auto partial_cols = nans<A>(B * splits * (2 * JH + J)),
       partial_mass = nans<A>(B * splits * R * J);
  StridedRows<A> g_V = strided_rows<A>(B, I, JH, layout);
  o.g_a = nans<A>(B * I);
  auto gb = nans<A>(B * 2 * J);
  const EmBackwardWorkspace<A> ws{
      R_hist.data(),  g_R.data(),  norm.data(),   g_mu.data(),         g_var.data(),
      g_logit.data(), mass.data(), g_mass.data(), partial_cols.data(), partial_mass.data()};
  const EmGrads<A> out{g_V.data(), g_V.rows, o.g_a.data(), gb.data()};
  run_em_backward(launch, src, a.data(), bu.data(), static_cast<const A*>(o.stats.data()),
                  gp.data(), ga.data(), dims, static_cast<A>(eps), splits, lanes, ws, out);
  o.g_V = g_V.gathered();
  o.gaps_written = g_V.gaps_written();
  o.g_beta.assign(2 * J, A(0));
  for (int64_t n = 0; n < B; ++n)
    for (int64_t k = 0; k < 2 * J; ++k) o.g_beta[k] += gb[n * 2 * J + k];
  return o;
}

template <typename S, typename A>
void test_case(const Case& cs, const char* tname, double tol) {
  const int64_t B = cs.B, I = cs.I, J = cs.J, H = cs.H, JH = J * H;
  const double eps = 1e-6;
  std::vector<double> V = randn(B * I * JH), a = randu(B * I), bu = randn(J, 0.5),
                      ba = randn(J, 0.5);
  const std::string sp = cs.special;
  if (sp == "a_zero_some")
    for (int64_t k = 0; k < B * I; k += 3) a[k] = 0;
  if (sp == "a_zero_all") std::fill(a.begin(), a.end(), 0.0);
  if (sp == "identical")
    for (int64_t n = 0; n < B; ++n)
      for (int64_t i = 1; i < I; ++i)
        for (int64_t k = 0; k < JH; ++k) V[(n * I + i) * JH + k] = V[n * I * JH + k];
  if (sp == "large")
    for (auto& x : V) x *= 1e3;
  if (sp == "nan") V[0] = std::numeric_limits<double>::quiet_NaN();
  auto Vs = cast<S>(V), as = cast<S>(a), bus = cast<S>(bu), bas = cast<S>(ba);
  auto gp = cast<A>(randn(B * JH)), ga = cast<A>(randn(B * J));
  const auto want = cpu_run<S, A>(cs, Vs, as, bus, bas, gp, ga, eps);
  // The truth for judging disagreements: the CPU code on the same inputs in long double.
  const auto truth = cpu_run<S, long double>(cs, Vs, as, bus, bas, cast<long double>(gp),
                                             cast<long double>(ga), eps);
  // Outputs stored in S are rounded to S: allow one ulp of S.
  const double out_tol = std::max(tol, double(std::numeric_limits<S>::epsilon()));
  // One range (the CPU's order), and 2 to 4 ranges where (B + I) % 4 gives them (more ranges than
  // rows where I is small).
  std::vector<int64_t> split_counts{1};
  if (const int64_t more = (cs.B + cs.I) % 4 + 1; more > 1) split_counts.push_back(more);
  // The votes contiguous, and input-capsule-major as torch.einsum leaves them, rows an odd number
  // of values apart from one value into the storage (strided.h). The warps' lanes as the op
  // chooses them (em_launch.cuh: a lane per entry where H fits); where that is the entries, a lane
  // per capsule too (CAPSROUTE_EM_LANES=capsule) on one range of contiguous double votes (the H
  // that do not fit run it in every dtype).
  const EmLanes chosen = em_column_lanes_fit(H) ? EmLanes::column : EmLanes::capsule;
  std::vector<std::tuple<int64_t, RowLayout, EmLanes>> runs;
  for (const int64_t splits : split_counts)
    for (const RowLayout layout : {RowLayout{0, 0}, RowLayout{1, 1}})
      runs.emplace_back(splits, layout, chosen);
  if (chosen == EmLanes::column && std::is_same_v<S, double>)
    runs.emplace_back(1, RowLayout{0, 0}, EmLanes::capsule);
  for (const auto& [splits, layout, lanes] : runs) {
    const auto got = emu_run<S, A>(cs, Vs, as, bus, bas, gp, ga, eps, splits, lanes, layout);
    const std::string p = std::string(tname) + " splits=" + std::to_string(splits) +
                          (lanes == EmLanes::column ? " column lanes" : " capsule lanes") +
                          (layout.gap > 0 ? " strided " : " ");
    if (got.gaps_written != 0) {
      std::printf("  FAIL %s: %ld values written between the rows of grad_votes\n", p.c_str(),
                  long(got.gaps_written));
      ++failures;
    }
    judge(p + "stats", got.stats, want.stats, truth.stats, tol);
    judge(p + "pose", got.pose, want.pose, truth.pose, out_tol);
    judge(p + "a_out", got.a_out, want.a_out, truth.a_out, out_tol);
    judge(p + "grad_votes", got.g_V, want.g_V, truth.g_V, tol);
    judge(p + "grad_a_in", got.g_a, want.g_a, truth.g_a, tol);
    judge(p + "grad_betas", got.g_beta, want.g_beta, truth.g_beta, tol);
    // No NaN anywhere unless one was planted in the input.
    if (sp != "nan") {
      bool bad = false;
      for (auto x : got.stats) bad |= !std::isfinite(double(x));
      for (auto x : got.g_V) bad |= !std::isfinite(double(x));
      for (auto x : got.g_a) bad |= !std::isfinite(double(x));
      for (auto x : got.g_beta) bad |= !std::isfinite(double(x));
      if (bad) {
        std::printf("  FAIL %s: non-finite output\n", p.c_str());
        ++failures;
      }
    }
  }
}

// em_routing_pose: votes V_ij = P_i W_ij (4x4) computed inside the kernels (PoseVotes), the
// backward over the batch in chunks of `chunk` elements (run_pose_backward, as the op runs it), and
// the vote gradient contracted into grad_pose and grad_weight. S is the accumulation type too,
// so the CPU code can be given the same votes the kernels compute. The poses read in place from
// `layout` (strided.h), grad_pose written at the same strides.
template <typename S>
void test_pose_case(int64_t B, int64_t I, int64_t J, int64_t iters, int64_t chunk, int64_t splits,
                    unsigned grid, double tol, RowLayout layout = {0, 0},
                    EmLanes lanes = EmLanes::column) {
  constexpr int64_t H = kPoseSize;
  const int64_t JH = J * H;
  const double eps = 1e-6;
  const Case cs{B, I, J, H, iters, 1.0, grid, ""};
  const auto pose = cast<S>(randn(B * I * H)), weight = cast<S>(randn(I * J * H, 0.5)),
             a = cast<S>(randu(B * I));
  const auto bu = cast<S>(randn(J, 0.5)), ba = cast<S>(randn(J, 0.5));
  const auto gp = cast<S>(randn(B * JH)), ga = cast<S>(randn(B * J));
  std::vector<S> V(B * I * JH);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t jh = 0; jh < JH; ++jh)
        V[(b * I + i) * JH + jh] =
            PoseVotes<S, S>{pose.data(), packed_rows(I, H), weight.data(), J}(b, i, jh);
  const auto want = cpu_run<S, S>(cs, V, a, bu, ba, gp, ga, eps);
  const auto truth =
      cpu_run<S, long double>(cs, V, a, bu, ba, cast<long double>(gp), cast<long double>(ga), eps);
  // grad_pose and grad_weight from the CPU's vote gradient (and from the long double one).
  auto contract = [&](const auto& g_V) {
    using T = std::decay_t<decltype(g_V[0])>;
    std::vector<T> g_pose(B * I * H, T(0)), g_weight(I * J * H, T(0));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < I; ++i)
        for (int64_t j = 0; j < J; ++j)
          for (int64_t r = 0; r < 4; ++r)
            for (int64_t c = 0; c < 4; ++c) {
              const T g = g_V[((b * I + i) * J + j) * H + r * 4 + c];
              for (int64_t k = 0; k < 4; ++k) {
                g_pose[(b * I + i) * H + r * 4 + k] += g * T(weight[(i * J + j) * H + k * 4 + c]);
                g_weight[(i * J + j) * H + k * 4 + c] += T(pose[(b * I + i) * H + r * 4 + k]) * g;
              }
            }
    return std::make_pair(g_pose, g_weight);
  };
  const auto [want_g_pose, want_g_weight] = contract(want.g_V);
  const auto [true_g_pose, true_g_weight] = contract(truth.g_V);

  const EmDims dims{B, I, J, H, iters, 1.0};
  const StridedRows<S> laid_out = strided_rows(B, I, H, layout, &pose);
  const PoseVotes<S, S> src{laid_out.data(), laid_out.rows, weight.data(), J};
  auto stats = nans<S>(B * iters * dims.stats_block()), pose_out = nans<S>(B * JH),
       a_out = nans<S>(B * J);
  auto R = nans<S>(B * I * J), mass = nans<S>(B * J), norm = nans<S>(B * J),
       partial = nans<S>(B * splits * (J + JH));
  const EmuLaunch launch{grid, kBlockThreads};
  run_em_forward(launch, src, a.data(), bu.data(), ba.data(), dims, S(eps), splits, lanes,
                 EmForwardWorkspace<S>{R.data(), mass.data(), norm.data(), partial.data()},
                 stats.data(), pose_out.data(), a_out.data());

  auto R_hist = nans<S>(chunk * iters * I * J), g_R = nans<S>(chunk * I * J),
       norm_hist = nans<S>(chunk * iters * J);
  auto g_mu = nans<S>(chunk * JH), g_var = nans<S>(chunk * JH), g_logit = nans<S>(chunk * J),
       chunk_mass = nans<S>(chunk * J), g_mass = nans<S>(chunk * J), g_V = nans<S>(chunk * I * JH);
  auto partial_cols = nans<S>(chunk * splits * (2 * JH + J)),
       partial_mass = nans<S>(chunk * splits * iters * J);
  const EmBackwardWorkspace<S> ws{R_hist.data(),      g_R.data(),    norm_hist.data(),
                                  g_mu.data(),        g_var.data(),  g_logit.data(),
                                  chunk_mass.data(),  g_mass.data(), partial_cols.data(),
                                  partial_mass.data()};
  auto g_a = nans<S>(B * I), g_beta = nans<S>(B * 2 * J), g_weight = nans<S>(I * J * H);
  StridedRows<S> grad_pose = strided_rows<S>(B, I, H, layout);
  run_pose_backward(launch, laid_out.data(), laid_out.rows, weight.data(), a.data(), bu.data(),
                    static_cast<const S*>(stats.data()), gp.data(), ga.data(), dims, S(eps), splits,
                    lanes, chunk, ws, g_V.data(), grad_pose.rows, grad_pose.data(), g_a.data(),
                    g_weight.data(), g_beta.data());
  const std::vector<S> g_pose = grad_pose.gathered();
  std::vector<S> g_beta_sum(2 * J, S(0));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < 2 * J; ++k) g_beta_sum[k] += g_beta[b * 2 * J + k];
  const std::string p = std::string(sizeof(S) == 8 ? "double" : "float") +
                        (layout.gap > 0 ? " strided" : "") + " pose B=" + std::to_string(B) +
                        " I=" + std::to_string(I) + " J=" + std::to_string(J) +
                        " chunk=" + std::to_string(chunk) + " splits=" + std::to_string(splits) +
                        (lanes == EmLanes::column ? " column lanes " : " capsule lanes ");
  judge(p + "stats", stats, want.stats, truth.stats, tol);
  judge(p + "pose", pose_out, want.pose, truth.pose, tol);
  judge(p + "a_out", a_out, want.a_out, truth.a_out, tol);
  judge(p + "grad_pose", g_pose, want_g_pose, true_g_pose, tol);
  judge(p + "grad_weight", g_weight, want_g_weight, true_g_weight, tol);
  judge(p + "grad_a_in", g_a, want.g_a, truth.g_a, tol);
  judge(p + "grad_betas", g_beta_sum, want.g_beta, truth.g_beta, tol);
  if (grad_pose.gaps_written() != 0) {
    std::printf("  FAIL %s: %ld values written between the rows of grad_pose\n", p.c_str(),
                long(grad_pose.gaps_written()));
    ++failures;
  }
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "full";
  if (mode != "full" && mode != "quick" && mode != "small") {
    std::fprintf(stderr, "usage: em_test [quick | small]\n");
    return 2;
  }
  std::vector<Case> cases;
  // The grid of the brief: J in {1, 3, 33}, H in {1, 16}, I in {1, 37}, iters in {1, 2, 3},
  // with B alternately smaller (1) and larger (5) than the emulated grid of 2 or 3 blocks.
  int k = 0;
  for (int64_t J : {1, 3, 33})
    for (int64_t H : {1, 16})
      for (int64_t I : {1, 37})
        for (int64_t iters : {1, 2, 3}) {
          const bool small = k % 2 == 0;
          cases.push_back({small ? 1 : 5, I, J, H, iters, k % 3 == 0 ? 0.01 : 1.0,
                           small ? 2u : (k % 4 == 1 ? 2u : 3u), ""});
          ++k;
        }
  // Extra shapes: many rows per warp, J*H beyond one block of column owners, no inputs, robustness.
  cases.push_back({3, 300, 10, 16, 3, 1.0, 2, ""});
  cases.push_back({2, 20, 64, 5, 3, 1.0, 2, ""});
  cases.push_back({2, 0, 4, 4, 3, 1.0, 2, ""});
  cases.push_back({3, 24, 5, 16, 3, 1.0, 2, "a_zero_some"});
  cases.push_back({3, 24, 5, 16, 3, 1.0, 2, "a_zero_all"});
  cases.push_back({3, 24, 5, 16, 3, 1.0, 2, "identical"});
  cases.push_back({3, 24, 5, 16, 3, 1.0, 2, "large"});
  cases.push_back({2, 9, 4, 3, 4, 1.0, 1, "nan"});
  cases.push_back({7, 13, 5, 16, 5, 0.01, 3, ""});
  // The entries' lanes at the other H that divide the warp: rounds part-filled (J H = 14, 56) and
  // a capsule a round (H = 32).
  cases.push_back({2, 11, 7, 2, 3, 1.0, 2, ""});
  cases.push_back({2, 11, 7, 8, 2, 1.0, 3, ""});
  cases.push_back({3, 9, 3, 32, 3, 1.0, 2, ""});
  if (mode == "quick") {
    cases = {{5, 37, 33, 16, 3, 1.0, 2, ""},
             {3, 37, 3, 16, 2, 1.0, 2, ""},
             {1, 20, 64, 5, 3, 1.0, 2, ""}};
  }
  // small: every kernel once on a small shape, for a ThreadSanitizer build (a thread per CUDA
  // thread).
  const bool small = mode == "small";
  if (small) cases = {{3, 13, 5, 16, 3, 1.0, 2, ""}};
  for (const Case& cs : cases) {
    std::printf("case B=%ld I=%ld J=%ld H=%ld iters=%ld lambda=%g grid=%u %s\n", long(cs.B),
                long(cs.I), long(cs.J), long(cs.H), long(cs.iters), cs.final_lambda, cs.grid,
                cs.special);
    test_case<double, double>(cs, "double", 1e-12);
    if (!small) test_case<float, float>(cs, "float", 2e-5);
  }
  // float16 / bfloat16 storage, float accumulation: both sides read the same rounded inputs and
  // accumulate in float, so float's tolerance holds, and one ulp of the storage type on its
  // outputs.
  std::vector<Case> low_precision = {{5, 37, 33, 16, 3, 1.0, 2, ""},
                                     {3, 24, 5, 16, 3, 1.0, 2, "a_zero_some"}};
  if (small) low_precision.clear();
  for (const Case& cs : low_precision) {
    std::printf("case B=%ld I=%ld J=%ld H=%ld iters=%ld %s, low precision\n", long(cs.B),
                long(cs.I), long(cs.J), long(cs.H), long(cs.iters), cs.special);
    test_case<c10::Half, float>(cs, "float16", 2e-5);
    if (mode == "full") test_case<c10::BFloat16, float>(cs, "bfloat16", 2e-5);
  }
  for (int64_t chunk : {1, 2, 5}) {
    if (small && chunk > 2) break;
    for (int64_t splits : {int64_t(1), chunk + 1}) {
      test_pose_case<double>(5, 9, 4, 3, chunk, splits, 2, 1e-12);
      // Poses input-capsule-major (as einsum or permute leave them), 3 values apart, from one
      // value into the storage.
      test_pose_case<double>(5, 9, 4, 3, chunk, splits, 2, 1e-12, RowLayout{3, 1});
      if (mode == "full") test_pose_case<float>(5, 9, 4, 3, chunk, splits, 2, 2e-5);
    }
  }
  if (mode == "full") test_pose_case<double>(2, 1, 1, 1, 1, 1, 1, 1e-12);
  test_pose_case<double>(5, 9, 4, 3, 2, 3, 2, 1e-12, RowLayout{0, 0}, EmLanes::capsule);
  std::printf("%d checks, worst emu-vs-cpu rel err %.3e, %d explained by conditioning\n", checks,
              worst, ill);
  std::printf(failures ? "%d failures\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
