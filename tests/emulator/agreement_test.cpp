// The CUDA routing kernels (csrc/cuda/agreement_block_kernels.cuh) on the host emulator, against
// the CPU backend's per-element code (csrc/cpu/agreement_element.h) in double: forward outputs,
// saved state and the vote gradient (squash_rows_kernel too), by the block kernels with one block
// per element and rows split over 2, 3 and 7 blocks (more ranges than rows included), the warp-rows
// kernels (a warp per part of a range) and the cluster kernels (sm_90: an element per cluster of 8
// blocks forward, 16 backward, votes in shared memory; the backward writing the vote gradient over
// the votes), in float64 and float32, and float16/bfloat16 storage with float accumulation as the
// extension instantiates them (c10::Half / c10::BFloat16 themselves, so the roundings are the real
// ones), also with votes in the accumulation dtype as dense_capsules stores them, including
// J * D > 256 (a thread owning several columns). Workspaces and outputs start as NaN,
// so a value the kernels forget to write shows. Prints one line per failure; exits 1 if there is
// any.
//   agreement_test [quick | small [blocks | clusters]]
// small: one shape in double, fused and split launches, every kernel once: small enough for a
// ThreadSanitizer build (each emulated CUDA thread is a thread it follows). Its parts run in
// processes of their own there: TSan's vector clocks grow with the threads a process has had, so
// after the 4096-thread cluster launches every other launch runs several times slower. The
// clusters part runs the cluster kernels on contiguous votes only: on strided ones they differ in
// the global addresses alone (votes read-only, each gradient capsule written by one thread at a
// place the value checks verify), not in their shared memory or barriers.
#include "emu.h"
#include "strided.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../../csrc/cpu/agreement_element.h"
#include "../../csrc/cuda/agreement_block_kernels.cuh"
#include "../../csrc/cuda/agreement_sequence.cuh"
#include "../../csrc/cuda/squash_kernels.cuh"
#include "../../csrc/cuda/vote_sources.cuh"

using namespace capsroute;
using namespace capsroute::cuda;

namespace {

std::mt19937_64 rng(1234);
int failures = 0;
int routings_checked = 0;  // a part that selects no launch fails rather than passes
// The cluster kernels run on two clusters (up to 8192 emulated threads) in float64 and on one in
// the other dtypes, which keeps the full run's time in bounds. Under ThreadSanitizer (small mode,
// whose cost grows with the threads alive) on one, and the cluster forward only with the cluster
// backward.
bool small_mode = false;

// The launches a run makes: all of them, the block and warp-rows kernels (with the squash kernel),
// or the cluster kernels on contiguous votes.
enum class Part { all, blocks, clusters };
Part part = Part::all;

bool in_part(bool clusters, bool strided) {
  switch (part) {
    case Part::blocks:
      return !clusters;
    case Part::clusters:
      return clusters && !strided;
    default:
      return true;
  }
}

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

// The accumulation type of a storage type, as at::opmath_type: float for float16/bfloat16.
template <typename S>
using acc_of = std::conditional_t<std::is_same_v<S, double>, double, float>;

template <typename S>
const char* dtype_name() {
  if constexpr (std::is_same_v<S, double>) return "float64";
  if constexpr (std::is_same_v<S, float>) return "float32";
  if constexpr (std::is_same_v<S, c10::Half>) return "float16";
  return "bfloat16";
}

template <typename T>
void compare(const char* label, const char* what, const std::vector<T>& got,
             const std::vector<double>& want, double tol) {
  double max_want = 0, max_diff = 0;
  for (size_t k = 0; k < want.size(); ++k) {
    max_want = std::max(max_want, std::fabs(want[k]));
    const double diff = std::fabs(double(got[k]) - want[k]);
    max_diff = std::max(max_diff, std::isnan(diff) ? INFINITY : diff);
  }
  const double rel = max_diff / std::max(max_want, 1e-30);
  if (!(rel <= tol)) {
    std::printf("FAIL %s %s: relative error %.3e\n", label, what, rel);
    ++failures;
  }
}

struct Case {
  int64_t B, I, J, D, iters;
  bool leaky, detach, bias;
  unsigned grid;
  int64_t splits;
};

// What the CPU code computes from explicit votes (B, I, J, D), in double.
struct Expected {
  std::vector<double> v, c, s_hist, grad_votes, grad_bias_items;
};

Expected cpu_routing(const Case& cs, const std::vector<double>& votes,
                     const std::vector<double>& bias, const std::vector<double>& grad_v,
                     double eps) {
  const RoutingDims d{cs.B, cs.I, cs.J, cs.D, cs.iters, cs.leaky};
  const int64_t JD = d.jd();
  Expected e;
  e.v.resize(cs.B * JD);
  e.c.resize(cs.B * cs.I * cs.J);
  e.s_hist.resize(cs.B * cs.iters * JD);
  e.grad_votes.resize(cs.B * cs.I * JD);
  e.grad_bias_items.assign(cs.B * JD, 0.0);
  cpu::ForwardScratch<double> scratch(d);
  const RoutingRule<double> rule{};  // dynamic routing
  cpu::RoutingBackward<0, double> backward(d, rule, eps, cs.detach);
  std::vector<double> state(cpu::BackwardState<double>::numel(d));
  for (int64_t b = 0; b < cs.B; ++b) {
    const cpu::VoteRows<double> u{votes.data() + b * cs.I * JD, JD, cs.D};
    cpu::route_forward<0>(u, cs.bias ? bias.data() : nullptr, rule, d, eps, scratch,
                          e.s_hist.data() + b * cs.iters * JD, e.v.data() + b * JD,
                          e.c.data() + b * cs.I * cs.J);
    const cpu::BackwardState<double> st(state.data(), d);
    backward.run(u, grad_v.data() + b * JD, e.s_hist.data() + b * cs.iters * JD,
                 cpu::ParameterGrads<double>{e.grad_bias_items.data() + b * JD}, st);
    for (int64_t i = 0; i < cs.I; ++i)
      backward.vote_grad_row(st, i, e.grad_votes.data() + (b * cs.I + i) * JD);
  }
  return e;
}

// The launch sequences the ops run (agreement_sequence.cuh, on at most cs.grid blocks so that the
// kernels' grid-stride loops are exercised), with splits given, checking v, c, s_hist and
// grad_bias_items; then check_vote_grad(state) checks what the op's own kernels make of the saved
// state.
// split.warp_rows: the warp-rows kernels (votes read from memory), split.cluster_forward /
// cluster_backward: the cluster kernels, each without the workspaces it does not use (nullptr: a
// read of one would crash); the cluster backward writes grad_votes (rows at grad_rows) instead of
// the state, and check_vote_grad is not called.
template <typename S, typename Source, typename GradT, typename CheckVoteGrad>
void check_kernels(const char* label, const Case& cs, const RowSplit& split, const Source& src,
                   const std::vector<double>& bias_d, const std::vector<double>& grad_v_d,
                   const Expected& want, double eps, double tol, const CapsuleStrides& grad_rows,
                   GradT* grad_votes, CheckVoteGrad&& check_vote_grad) {
  using A = typename Source::acc_type;
  const int64_t B = cs.B, I = cs.I, J = cs.J, D = cs.D, JD = J * D, R = cs.iters;
  const RoutingDims dims{B, I, J, D, R, cs.leaky};
  const std::vector<S> bias_s = cast<S>(bias_d);
  const std::vector<A> grad_v =
      cast<A>(grad_v_d);  // the ops pass the gradient in the accumulation dtype
  const S* bias = cs.bias ? bias_s.data() : nullptr;

  // Forward.
  std::vector<A> logits = nans<A>(B * I * J), coupling = nans<A>(B * I * J), v_ws = nans<A>(B * JD);
  std::vector<A> s_hist = nans<A>(B * R * JD), partial = nans<A>(B * split.parts() * JD);
  std::vector<S> v = nans<S>(B * JD), c = nans<S>(B * I * J);
  const bool on_chip = split.cluster_forward;
  const ForwardWorkspace<A> fws{on_chip ? nullptr : logits.data(),
                                split.warp_rows ? nullptr : coupling.data(),
                                on_chip ? nullptr : v_ws.data()};
  const EmuLaunch launch{cs.grid, kBlockThreads};
  ++routings_checked;
  run_routing_forward(launch, src, bias, dims, A(eps), split, fws,
                      on_chip ? nullptr : partial.data(), s_hist.data(), v.data(), c.data());
  compare(label, "v", v, want.v, tol);
  compare(label, "c", c, want.c, tol);
  compare(label, "s_hist", s_hist, want.s_hist, tol);
  // Without couplings (c nullptr: dynamic_routing's couplings=False), v and s_hist bit for bit.
  std::vector<S> v_alone = nans<S>(B * JD);
  std::vector<A> s_hist_alone = nans<A>(B * R * JD);
  run_routing_forward(launch, src, bias, dims, A(eps), split, fws,
                      on_chip ? nullptr : partial.data(), s_hist_alone.data(), v_alone.data(),
                      static_cast<S*>(nullptr));
  compare(label, "v without couplings", v_alone, cast<double>(v), 0);
  compare(label, "s_hist without couplings", s_hist_alone, cast<double>(s_hist), 0);

  // Backward, from the kernels' own s_hist.
  const int64_t first_r = cs.detach ? R - 1 : 0, nkeep = R - first_r;
  std::vector<A> v_hist = nans<A>(B * R * JD), gs_hist = nans<A>(B * nkeep * JD);
  std::vector<A> coupling_hist = nans<A>(B * nkeep * I * J), g_logits = nans<A>(B * nkeep * I * J);
  std::vector<A> gv = nans<A>(B * JD), grad_bias_items = nans<A>(B * JD);
  const bool state = !split.cluster_backward;
  const BackwardState<A> st{state ? v_hist.data() : nullptr,
                            state ? gs_hist.data() : nullptr,
                            state ? coupling_hist.data() : nullptr,
                            state ? g_logits.data() : nullptr,
                            I,
                            J,
                            D,
                            R,
                            first_r,
                            nkeep};
  const BackwardWorkspace<A> bws{state && !split.warp_rows ? logits.data() : nullptr,
                                 state ? gv.data() : nullptr};
  std::fill(logits.begin(), logits.end(), std::numeric_limits<A>::quiet_NaN());
  run_routing_backward(launch, src, grad_v.data(), static_cast<const A*>(s_hist.data()), dims,
                       A(eps), split, st, bws, state ? partial.data() : nullptr,
                       grad_bias_items.data(), grad_rows, grad_votes);
  compare(label, "grad_bias_items", grad_bias_items, want.grad_bias_items, tol);
  if (state) check_vote_grad(st);
}

// Votes read from memory in type V, their gradient written in V (V = S as dynamic_routing, or
// V = the accumulation dtype as dense_capsules), outputs in S; by the block kernels and, where the
// capsules fit them, the warp-rows kernels. With a layout, the votes read in place from it
// (strided.h), their gradient written at the same strides into a NaN buffer of its own, which
// must keep its gaps NaN.
template <typename S, typename V>
void check_memory_votes(const char* case_label, const Case& cs, const std::vector<double>& votes,
                        const std::vector<double>& bias, const std::vector<double>& grad_v,
                        const Expected& want, double eps, double tol,
                        std::optional<RowLayout> layout = std::nullopt) {
  using A = acc_of<S>;
  const int64_t JD = cs.J * cs.D;
  const std::vector<V> votes_v = cast<V>(votes);
  const RowLayout rows = layout.value_or(RowLayout{0, 0});
  const StridedRows<V> laid_out = strided_rows(cs.B, cs.I, JD, rows, &votes_v);
  const char* grad_name = std::is_same_v<V, S> ? "grad_votes" : "grad_votes (accumulation dtype)";
  const auto check_grad = [&](const std::string& label, const StridedRows<V>& grad) {
    compare(label.c_str(), grad_name, grad.gathered(), want.grad_votes, tol);
    if (grad.gaps_written() != 0) {
      std::printf("FAIL %s %s: %ld values written between the rows\n", label.c_str(), grad_name,
                  long(grad.gaps_written()));
      ++failures;
    }
  };
  // The block kernels, the warp rows, and (they ignore the splits: once) the cluster forward with
  // the warp rows' backward, then both directions on clusters (8 and 16 blocks; as many clusters
  // as the forward alone gets, so some loop over the elements).
  const bool fit = warp_rows_fit({cs.B, cs.I, cs.J, cs.D, cs.iters, cs.leaky});
  for (const RowSplit split :
       {RowSplit{cs.splits, false}, RowSplit{cs.splits, true}, RowSplit{cs.splits, true, true},
        RowSplit{cs.splits, true, true, true}}) {
    if ((split.warp_rows && !fit) || (split.cluster_forward && cs.splits != 1)) break;
    if (small_mode && split.cluster_forward && !split.cluster_backward) continue;
    if (!in_part(split.cluster_forward, layout.has_value())) continue;
    const std::string label =
        std::string(case_label) +
        (split.cluster_backward  ? " clusters"
         : split.cluster_forward ? " cluster forward"
         : split.warp_rows       ? " warp rows"
                                 : "") +
        (layout ? " rows gap=" + std::to_string(rows.gap) + " offset=" + std::to_string(rows.offset)
                : "");
    Case launch_cs = cs;
    if (split.cluster_forward && (small_mode || !std::is_same_v<S, double>)) launch_cs.grid = 1;
    // Contiguous, the cluster backward writes the vote gradient over the votes, as dense_capsules
    // asks.
    std::vector<V> votes_then_grad = votes_v;
    StridedRows<V> cluster_grad = strided_rows<V>(cs.B, cs.I, JD, rows);
    const MemoryVotes<V, A> src =
        layout ? MemoryVotes<V, A>{laid_out.data(), laid_out.rows}
               : MemoryVotes<V, A>{votes_then_grad.data(), packed_rows(cs.I, JD)};
    check_kernels<S>(label.c_str(), launch_cs, split, src, bias, grad_v, want, eps, tol, src.rows,
                     !split.cluster_backward ? nullptr
                     : layout                ? cluster_grad.data()
                                             : votes_then_grad.data(),
                     [&](const BackwardState<A>& st) {
                       if (votes.empty()) return;
                       StridedRows<V> grad = strided_rows<V>(cs.B, cs.I, JD, rows);
                       emu_launch(2, kBlockThreads, write_vote_grad_rows_kernel<V, A>, st, cs.B,
                                  grad.rows, grad.data());
                       check_grad(label, grad);
                     });
    if (split.cluster_backward && !votes.empty()) {
      if (layout)
        check_grad(label + " (cluster)", cluster_grad);
      else
        compare(label.c_str(),
                std::is_same_v<V, S> ? "grad_votes (over the votes)"
                                     : "grad_votes (accumulation dtype)",
                votes_then_grad, want.grad_votes, tol);
    }
  }
}

template <typename S>
void check_case(const Case& cs, double tol) {
  using A = acc_of<S>;
  const double eps = 1e-8;
  const int64_t JD = cs.J * cs.D;
  // Values rounded to S first, so that both sides route the same numbers.
  const auto votes = cast<double>(cast<S>(randn(cs.B * cs.I * JD, 0.5)));
  const auto bias = cast<double>(cast<S>(randn(JD, 0.3)));
  const auto grad_v = cast<double>(cast<S>(randn(cs.B * JD, 1.0)));
  char label[200];
  std::snprintf(label, sizeof label,
                "%s B=%ld I=%ld J=%ld D=%ld iters=%ld leaky=%d detach=%d bias=%d splits=%ld",
                dtype_name<S>(), long(cs.B), long(cs.I), long(cs.J), long(cs.D), long(cs.iters),
                cs.leaky, cs.detach, cs.bias, long(cs.splits));

  const Expected from_votes = cpu_routing(cs, votes, bias, grad_v, eps);
  check_memory_votes<S, S>(label, cs, votes, bias, grad_v, from_votes, eps, tol);
  // The einsum layout read in place (strided.h): with one range (the cluster kernels too) rows
  // 16-byte aligned where J * D values are (the vector loads), with 2 rows an odd number of values
  // apart (aligned base, misaligned rows), with 3 also from one value into the storage. Not with 7
  // ranges nor in float32 (float64 and the 16-bit types cover the loads): the full run's time;
  // under ThreadSanitizer the one-range launches alone (the cluster kernels' strided writes).
  if (cs.splits <= (small_mode ? 1 : 3) && !std::is_same_v<S, float>)
    check_memory_votes<S, S>(
        label, cs, votes, bias, grad_v, from_votes, eps, tol,
        RowLayout{cs.splits == 1 ? int64_t(16 / sizeof(S)) : 1, cs.splits == 3 ? 1 : 0});
  // dense_capsules: votes (and their gradient) in the accumulation dtype.
  if constexpr (!std::is_same_v<S, A>)
    check_memory_votes<S, A>(label, cs, votes, bias, grad_v, from_votes, eps, tol);
}

// squash_rows_kernel, forward and backward, against the formulas of common/acc_math.h; one row of
// zeros (the eps path), rows shorter and longer than a warp.
template <typename S>
void check_squash(int64_t rows, int64_t D, double tol) {
  const double eps = 1e-8;
  auto s = cast<double>(cast<S>(randn(rows * D, 1.0)));
  const auto g = cast<double>(cast<S>(randn(rows * D, 1.0)));
  std::fill(s.begin(), s.begin() + D, 0.0);
  std::vector<double> want_fwd(rows * D), want_bwd(rows * D);
  for (int64_t r = 0; r < rows; ++r) {
    double q = 0, sg = 0;
    for (int64_t d = 0; d < D; ++d) {
      q += s[r * D + d] * s[r * D + d];
      sg += s[r * D + d] * g[r * D + d];
    }
    const double scale = squash_scale(q, eps);
    const SquashVjp<double> k = squash_vjp_coeffs(q, eps);
    for (int64_t d = 0; d < D; ++d) {
      want_fwd[r * D + d] = scale * s[r * D + d];
      want_bwd[r * D + d] = k.scale * g[r * D + d] + k.radial * sg * s[r * D + d];
    }
  }
  const std::vector<S> s_s = cast<S>(s), g_s = cast<S>(g);
  std::vector<S> fwd = nans<S>(rows * D), bwd = nans<S>(rows * D);
  emu_launch(2, kBlockThreads, squash_rows_kernel<false, S, S>, s_s.data(),
             static_cast<const S*>(nullptr), fwd.data(), rows, D, S(eps));
  emu_launch(2, kBlockThreads, squash_rows_kernel<true, S, S>, s_s.data(), g_s.data(), bwd.data(),
             rows, D, S(eps));
  char label[80];
  std::snprintf(label, sizeof label, "squash %s rows=%ld D=%ld",
                sizeof(S) == 8 ? "float64" : "float32", long(rows), long(D));
  compare(label, "forward", fwd, want_fwd, tol);
  compare(label, "backward", bwd, want_bwd, tol);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "full";
  const std::string part_name = argc > 2 ? argv[2] : "all";
  const std::pair<const char*, Part> parts[] = {
      {"all", Part::all}, {"blocks", Part::blocks}, {"clusters", Part::clusters}};
  const auto named = std::find_if(std::begin(parts), std::end(parts),
                                  [&](const auto& p) { return part_name == p.first; });
  if ((mode != "full" && mode != "quick" && mode != "small") || named == std::end(parts) ||
      (argc > 2 && mode != "small") || argc > 3) {
    std::fprintf(stderr, "usage: agreement_test [quick | small [blocks | clusters]]\n");
    return 2;
  }
  const bool quick = mode != "full", small = mode == "small";
  small_mode = small;
  part = named->second;
  // B, I, J, D, iters, leaky, detach, bias, grid blocks, splits (set below)
  std::vector<Case> shapes = {
      // I = 47: rows in every block of a cluster (8 x 6 forward, 16 x 3 backward), the last short.
      {3, 47, 10, 16, 3, false, false, true, 2, 1},
      {3, 47, 10, 16, 3, true, true, false, 2, 1},
      {2, 70, 33, 3, 2, false, false, false, 2, 1},
      {2, 70, 33, 3, 4, true, true, true, 1, 1},
      {2, 9, 70, 1, 3, true, false, true, 3, 1},
      {2, 40, 5, 7, 1, false, false, true, 2, 1},
      {2, 0, 4, 4, 3, false, false, true, 2, 1},
      {1, 1, 1, 1, 5, true, false, false, 1, 1},
      // J * D > 256: each column owner holds 2 (320) or 2 of 300 columns, and J = 100 > 3 lanes'
      // worth.
      {2, 40, 20, 16, 3, false, false, true, 2, 1},
      {1, 12, 100, 3, 2, true, false, true, 2, 1},
      // The warp-rows kernels: J = 16 (2 rows a warp, D = 12 as 3 of 4 vectors) and at their limit
      // of J = 32 (a row a warp, D = 5 read by scalars), walking back 3 steps.
      {2, 37, 16, 12, 3, false, false, true, 2, 1},
      {2, 45, 32, 5, 4, true, false, true, 2, 1},
  };
  // float16 / bfloat16 storage, float accumulation: a fused and a split launch of an MNIST-like
  // and a J * D > 256 shape. The outputs are rounded to the storage type: 2 ulps of it.
  std::vector<Case> low_precision = {shapes[0], shapes[8]};
  if (quick) shapes.resize(small ? 1 : 3);
  if (small) low_precision.clear();
  for (auto [rows, D] : {std::pair<int64_t, int64_t>{37, 16}, {21, 45}, {5, 1}}) {
    if (part != Part::all && part != Part::blocks) break;
    check_squash<double>(rows, D, 1e-14);
    check_squash<float>(rows, D, 1e-6);
  }
  for (const Case& shape : shapes) {
    for (int64_t splits : {1, 2, 3, 7}) {
      if (small && splits > 2) break;
      Case cs = shape;
      cs.splits = splits;
      check_case<double>(cs, 1e-12);
      if (!quick) check_case<float>(cs, 2e-4);
    }
  }
  for (const Case& shape : low_precision) {
    for (int64_t splits : {1, 3}) {
      Case cs = shape;
      cs.splits = splits;
      check_case<c10::Half>(cs, 2 * 9.77e-4);
      if (!quick) check_case<c10::BFloat16>(cs, 2 * 7.82e-3);
    }
  }
  if (routings_checked == 0) {
    std::printf("FAIL no routing launch ran\n");
    ++failures;
  }
  std::printf(failures ? "%d failures\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
