// Host-side argument checks shared by both backends: every message names the argument,
// what was expected and what was given.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>

#include "agreement_rules.h"
#include "dims.h"

namespace capsroute {

inline void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble || dt == at::kHalf || dt == at::kBFloat16,
              "capsroute: ", name, " must be float32, float64, float16 or bfloat16, got ", dt);
}

inline void check_rank(const at::Tensor& t, int64_t rank, const char* name, const char* layout) {
  TORCH_CHECK(t.dim() == rank, "capsroute: ", name, " must have shape ", layout, " (", rank,
              " dims), got shape ", t.sizes());
}

inline void check_same(const at::Tensor& t, const at::Tensor& ref, const char* name,
                       const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "capsroute: ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "capsroute: ", name, " has dtype ",
              t.scalar_type(), " but ", ref_name, " has dtype ", ref.scalar_type());
}

inline void check_eps(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0, "capsroute: eps must be finite and >= 0, got ", eps);
}

// s (..., D), squashed over its last dim.
inline void check_squash_inputs(const at::Tensor& s, double eps) {
  check_float_dtype(s, "s");
  TORCH_CHECK(s.dim() >= 1,
              "capsroute: s must have at least 1 dim (the capsule dim last), got a scalar");
  check_eps(eps);
}

inline void check_squash_backward_inputs(const at::Tensor& grad_v, const at::Tensor& s,
                                         double eps) {
  check_squash_inputs(s, eps);
  check_float_dtype(grad_v, "grad_v");
  TORCH_CHECK(grad_v.sizes() == s.sizes(), "capsroute: grad_v must have the shape of s, ",
              s.sizes(), ", got ", grad_v.sizes());
  TORCH_CHECK(grad_v.device() == s.device(), "capsroute: grad_v is on ", grad_v.device(),
              " but s is on ", s.device());
}

inline void check_routing_options(int64_t iters, double eps) {
  TORCH_CHECK(iters >= 1, "capsroute: iters must be >= 1, got ", iters);
  check_eps(eps);
}

inline void check_bias(const std::optional<at::Tensor>& bias, const at::Tensor& ref, int64_t J,
                       int64_t D) {
  if (!bias.has_value()) return;
  check_same(*bias, ref, "bias", "the capsule input");
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == J && bias->size(1) == D,
              "capsroute: bias must have shape (J, D) = (", J, ", ", D, "), got shape ",
              bias->sizes());
}

// votes (B, I, J, D)
inline void check_dynamic_routing_inputs(const at::Tensor& votes,
                                         const std::optional<at::Tensor>& bias, int64_t iters,
                                         double eps) {
  check_float_dtype(votes, "votes");
  check_rank(votes, 4, "votes", "(B, I, J, D)");
  TORCH_CHECK(votes.size(2) >= 1 && votes.size(3) >= 1,
              "capsroute: votes must have J >= 1 outputs and D >= 1 dims, got shape ",
              votes.sizes());
  check_bias(bias, votes, votes.size(2), votes.size(3));
  check_routing_options(iters, eps);
}

// u (B, I, Din), weight (I, J, D, Din)
inline void check_dense_shapes(const at::Tensor& u, const at::Tensor& weight) {
  check_float_dtype(u, "u");
  check_rank(u, 3, "u", "(B, I, Din)");
  check_rank(weight, 4, "weight", "(I, J, D, Din)");
  check_same(weight, u, "weight", "u");
  TORCH_CHECK(weight.size(0) == u.size(1) && weight.size(3) == u.size(2),
              "capsroute: weight must have shape (I, J, D, Din) with I = ", u.size(1),
              " and Din = ", u.size(2), " to match u of shape ", u.sizes(),
              ", got weight of shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) >= 1 && weight.size(2) >= 1,
              "capsroute: weight must have J >= 1 outputs and D >= 1 dims, got shape ",
              weight.sizes());
}

inline void check_dense_capsules_inputs(const at::Tensor& u, const at::Tensor& weight,
                                        const std::optional<at::Tensor>& bias, int64_t iters,
                                        double eps) {
  check_dense_shapes(u, weight);
  check_bias(bias, u, weight.size(1), weight.size(2));
  check_routing_options(iters, eps);
}

// Saved state of the routing forward: s before squash per iteration, (B, iters, J, D) in the
// accumulation dtype.
inline void check_routing_backward_inputs(const at::Tensor& grad_v, const at::Tensor& s_hist,
                                          int64_t B, int64_t J, int64_t D) {
  check_float_dtype(grad_v, "grad_v");
  check_float_dtype(s_hist, "s_hist");
  check_rank(grad_v, 3, "grad_v", "(B, J, D)");
  TORCH_CHECK(grad_v.size(0) == B && grad_v.size(1) == J && grad_v.size(2) == D,
              "capsroute: grad_v must have shape (", B, ", ", J, ", ", D, "), got ",
              grad_v.sizes());
  check_rank(s_hist, 4, "s_hist", "(B, iters, J, D)");
  TORCH_CHECK(
      s_hist.size(0) == B && s_hist.size(1) >= 1 && s_hist.size(2) == J && s_hist.size(3) == D,
      "capsroute: s_hist must have shape (", B, ", iters, ", J, ", ", D, "), got ", s_hist.sizes());
  TORCH_CHECK(grad_v.device() == s_hist.device(), "capsroute: grad_v is on ", grad_v.device(),
              " but s_hist is on ", s_hist.device());
}

// a_in (B, I), beta_u (J,), beta_a (J,) and the options of EM routing; ref is the input they
// must share a device and dtype with (votes or pose).
inline void check_em_common(const at::Tensor& ref, const char* ref_name, int64_t B, int64_t I,
                            int64_t J, const at::Tensor& a_in, const at::Tensor& beta_u,
                            const at::Tensor& beta_a, int64_t iters, double final_lambda,
                            double eps) {
  check_same(a_in, ref, "a_in", ref_name);
  check_same(beta_u, ref, "beta_u", ref_name);
  check_same(beta_a, ref, "beta_a", ref_name);
  TORCH_CHECK(a_in.dim() == 2 && a_in.size(0) == B && a_in.size(1) == I,
              "capsroute: a_in must have shape (B, I) = (", B, ", ", I, "), got shape ",
              a_in.sizes());
  TORCH_CHECK(beta_u.dim() == 1 && beta_u.size(0) == J,
              "capsroute: beta_u must have shape (J,) = (", J, ",), got shape ", beta_u.sizes());
  TORCH_CHECK(beta_a.dim() == 1 && beta_a.size(0) == J,
              "capsroute: beta_a must have shape (J,) = (", J, ",), got shape ", beta_a.sizes());
  TORCH_CHECK(iters >= 1, "capsroute: iters must be >= 1, got ", iters);
  TORCH_CHECK(std::isfinite(final_lambda), "capsroute: final_lambda must be finite, got ",
              final_lambda);
  TORCH_CHECK(std::isfinite(eps) && eps > 0,
              "capsroute: eps must be finite and > 0 (it floors the variance), got ", eps);
}

// votes (B, I, J, H)
inline void check_em_routing_inputs(const at::Tensor& votes, const at::Tensor& a_in,
                                    const at::Tensor& beta_u, const at::Tensor& beta_a,
                                    int64_t iters, double final_lambda, double eps) {
  check_float_dtype(votes, "votes");
  check_rank(votes, 4, "votes", "(B, I, J, H)");
  TORCH_CHECK(votes.size(2) >= 1 && votes.size(3) >= 1,
              "capsroute: votes must have J >= 1 outputs and H >= 1 pose values, got shape ",
              votes.sizes());
  check_em_common(votes, "votes", votes.size(0), votes.size(1), votes.size(2), a_in, beta_u, beta_a,
                  iters, final_lambda, eps);
}

// pose (B, I, 4, 4), weight (I, J, 4, 4)
inline void check_em_routing_pose_inputs(const at::Tensor& pose, const at::Tensor& weight,
                                         const at::Tensor& a_in, const at::Tensor& beta_u,
                                         const at::Tensor& beta_a, int64_t iters,
                                         double final_lambda, double eps) {
  check_float_dtype(pose, "pose");
  TORCH_CHECK(pose.dim() == 4 && pose.size(2) == 4 && pose.size(3) == 4,
              "capsroute: pose must have shape (B, I, 4, 4), got shape ", pose.sizes());
  check_same(weight, pose, "weight", "pose");
  TORCH_CHECK(weight.dim() == 4 && weight.size(0) == pose.size(1) && weight.size(1) >= 1 &&
                  weight.size(2) == 4 && weight.size(3) == 4,
              "capsroute: weight must have shape (I, J, 4, 4) with I = ", pose.size(1),
              " and J >= 1, got shape ", weight.sizes());
  check_em_common(pose, "pose", pose.size(0), pose.size(1), weight.size(1), a_in, beta_u, beta_a,
                  iters, final_lambda, eps);
}

// The iteration count of saved EM statistics (B, iters, J, 2H + 1), read before the other inputs
// are checked, so that a stats tensor of the wrong rank is named as such.
inline int64_t em_stats_iters(const at::Tensor& stats) {
  TORCH_CHECK(stats.dim() == 4, "capsroute: stats must have shape (B, iters, J, 2H + 1), got ",
              stats.sizes());
  return stats.size(1);
}

// What an EM routing backward gets besides the forward's inputs: grad_pose (B, J, H),
// grad_a_out (B, J) and the saved stats (B, iters, J, 2H + 1).
inline void check_em_backward_inputs(const at::Tensor& grad_pose, const at::Tensor& grad_a_out,
                                     const at::Tensor& stats, int64_t B, int64_t J, int64_t H) {
  check_float_dtype(grad_pose, "grad_pose");
  check_float_dtype(grad_a_out, "grad_a_out");
  check_float_dtype(stats, "stats");
  TORCH_CHECK(
      stats.dim() == 4 && stats.size(0) == B && stats.size(2) == J && stats.size(3) == 2 * H + 1,
      "capsroute: stats must have shape (B, iters, J, 2H + 1) = (", B, ", iters, ", J, ", ",
      2 * H + 1, "), got ", stats.sizes());
  TORCH_CHECK(grad_pose.sizes() == at::IntArrayRef({B, J, H}),
              "capsroute: grad_pose must have shape (", B, ", ", J, ", ", H, "), got ",
              grad_pose.sizes());
  TORCH_CHECK(grad_a_out.sizes() == at::IntArrayRef({B, J}),
              "capsroute: grad_a_out must have shape (", B, ", ", J, "), got ", grad_a_out.sizes());
}

inline void check_em_routing_backward_inputs(const at::Tensor& grad_pose,
                                             const at::Tensor& grad_a_out, const at::Tensor& votes,
                                             const at::Tensor& a_in, const at::Tensor& beta_u,
                                             const at::Tensor& beta_a, const at::Tensor& stats,
                                             double final_lambda, double eps) {
  check_em_routing_inputs(votes, a_in, beta_u, beta_a, em_stats_iters(stats), final_lambda, eps);
  check_em_backward_inputs(grad_pose, grad_a_out, stats, votes.size(0), votes.size(2),
                           votes.size(3));
}

inline void check_em_routing_pose_backward_inputs(const at::Tensor& grad_pose_out,
                                                  const at::Tensor& grad_a_out,
                                                  const at::Tensor& pose, const at::Tensor& weight,
                                                  const at::Tensor& a_in, const at::Tensor& beta_u,
                                                  const at::Tensor& beta_a, const at::Tensor& stats,
                                                  double final_lambda, double eps) {
  check_em_routing_pose_inputs(pose, weight, a_in, beta_u, beta_a, em_stats_iters(stats),
                               final_lambda, eps);
  check_em_backward_inputs(grad_pose_out, grad_a_out, stats, pose.size(0), weight.size(1),
                           kPoseSize);
}

// The K x K windows of a convolutional capsule layer over an H x W input.
inline void check_conv_window(int64_t K, int64_t H, int64_t W, int64_t stride, int64_t padding) {
  TORCH_CHECK(stride >= 1, "capsroute: stride must be >= 1, got ", stride);
  TORCH_CHECK(padding >= 0, "capsroute: padding must be >= 0, got ", padding);
  const int64_t Hp = H + 2 * padding, Wp = W + 2 * padding;
  TORCH_CHECK(K <= Hp && K <= Wp, "capsroute: weight's kernel size K = ", K,
              " is larger than the padded input (", Hp, " x ", Wp, " with padding ", padding, ")");
}

// pose (B, H, W, C_in, 4, 4), a_in (B, H, W, C_in), weight (K, K, C_in, C_out, 4, 4)
inline void check_conv_em_routing_inputs(const at::Tensor& pose, const at::Tensor& a_in,
                                         const at::Tensor& weight, const at::Tensor& beta_u,
                                         const at::Tensor& beta_a, int64_t iters, int64_t stride,
                                         int64_t padding, double final_lambda, double eps) {
  check_float_dtype(pose, "pose");
  TORCH_CHECK(pose.dim() == 6 && pose.size(4) == 4 && pose.size(5) == 4,
              "capsroute: pose must have shape (B, H, W, C_in, 4, 4), got shape ", pose.sizes());
  check_same(weight, pose, "weight", "pose");
  TORCH_CHECK(
      weight.dim() == 6 && weight.size(0) == weight.size(1) && weight.size(0) >= 1 &&
          weight.size(3) >= 1 && weight.size(4) == 4 && weight.size(5) == 4,
      "capsroute: weight must have shape (K, K, C_in, C_out, 4, 4) with K, C_out >= 1, got shape ",
      weight.sizes());
  TORCH_CHECK(weight.size(2) == pose.size(3), "capsroute: weight has C_in = ", weight.size(2),
              " (its dim 2) but pose has C_in = ", pose.size(3));
  check_conv_window(weight.size(0), pose.size(1), pose.size(2), stride, padding);
  check_same(a_in, pose, "a_in", "pose");
  TORCH_CHECK(a_in.sizes() == pose.sizes().slice(0, 4),
              "capsroute: a_in must have shape (B, H, W, C_in) = ", pose.sizes().slice(0, 4),
              ", got shape ", a_in.sizes());
  check_em_common(pose, "pose", pose.size(0), a_in.size(1) * a_in.size(2) * a_in.size(3),
                  weight.size(3), a_in.flatten(1), beta_u, beta_a, iters, final_lambda, eps);
}

// conv_em_routing's sizes, from inputs check_conv_em_routing_inputs passed.
inline ConvEmDims conv_em_dims(const at::Tensor& pose, const at::Tensor& weight, int64_t iters,
                               int64_t stride, int64_t padding, double final_lambda) {
  return {pose.size(0),   pose.size(1), pose.size(2), pose.size(3), weight.size(3),
          weight.size(0), stride,       padding,      iters,        final_lambda};
}

// The iteration count of conv_em_routing's saved stats (B, H', W', iters, C_out, 33).
inline int64_t conv_em_stats_iters(const at::Tensor& stats) {
  TORCH_CHECK(stats.dim() == 6,
              "capsroute: stats must have shape (B, H', W', iters, C_out, 33), got ",
              stats.sizes());
  return stats.size(3);
}

inline void check_conv_em_backward_inputs(const at::Tensor& grad_pose, const at::Tensor& grad_a_out,
                                          const at::Tensor& stats, int64_t B, int64_t Ho,
                                          int64_t Wo, int64_t J) {
  check_float_dtype(grad_pose, "grad_pose");
  check_float_dtype(grad_a_out, "grad_a_out");
  check_float_dtype(stats, "stats");
  TORCH_CHECK(stats.dim() == 6 && stats.size(0) == B && stats.size(1) == Ho &&
                  stats.size(2) == Wo && stats.size(4) == J && stats.size(5) == 2 * kPoseSize + 1,
              "capsroute: stats must have shape (B, H', W', iters, C_out, 33) = (", B, ", ", Ho,
              ", ", Wo, ", iters, ", J, ", 33), got ", stats.sizes());
  TORCH_CHECK(grad_pose.sizes() == at::IntArrayRef({B, Ho, Wo, J, kPoseSize}),
              "capsroute: grad_pose must have shape (", B, ", ", Ho, ", ", Wo, ", ", J,
              ", 16), got ", grad_pose.sizes());
  TORCH_CHECK(grad_a_out.sizes() == at::IntArrayRef({B, Ho, Wo, J}),
              "capsroute: grad_a_out must have shape (", B, ", ", Ho, ", ", Wo, ", ", J, "), got ",
              grad_a_out.sizes());
}

inline void check_conv_em_routing_backward_inputs(
    const at::Tensor& grad_pose_out, const at::Tensor& grad_a_out, const at::Tensor& pose,
    const at::Tensor& a_in, const at::Tensor& weight, const at::Tensor& beta_u,
    const at::Tensor& beta_a, const at::Tensor& stats, int64_t stride, int64_t padding,
    double final_lambda, double eps) {
  const int64_t iters = conv_em_stats_iters(stats);
  check_conv_em_routing_inputs(pose, a_in, weight, beta_u, beta_a, iters, stride, padding,
                               final_lambda, eps);
  const ConvEmDims d = conv_em_dims(pose, weight, iters, stride, padding, final_lambda);
  check_conv_em_backward_inputs(grad_pose_out, grad_a_out, stats, d.B, d.Ho(), d.Wo(), d.C_out);
}

inline void check_dynamic_routing_backward_inputs(const at::Tensor& grad_v, const at::Tensor& votes,
                                                  const at::Tensor& s_hist, double eps) {
  check_float_dtype(votes, "votes");
  check_rank(votes, 4, "votes", "(B, I, J, D)");
  check_routing_backward_inputs(grad_v, s_hist, votes.size(0), votes.size(2), votes.size(3));
  check_eps(eps);
}

inline void check_dense_capsules_backward_inputs(const at::Tensor& grad_v, const at::Tensor& u,
                                                 const at::Tensor& weight, const at::Tensor& s_hist,
                                                 double eps) {
  check_dense_shapes(u, weight);
  check_routing_backward_inputs(grad_v, s_hist, u.size(0), weight.size(1), weight.size(2));
  check_eps(eps);
}

// u (B, H, W, C_in, Din), weight (K, K, C_in, C_out, D, Din)
inline void check_conv_capsule_shapes(const at::Tensor& u, const at::Tensor& weight, int64_t stride,
                                      int64_t padding) {
  check_float_dtype(u, "u");
  check_rank(u, 5, "u", "(B, H, W, C_in, Din)");
  check_same(weight, u, "weight", "u");
  TORCH_CHECK(
      weight.dim() == 6 && weight.size(0) == weight.size(1) && weight.size(0) >= 1 &&
          weight.size(3) >= 1 && weight.size(4) >= 1,
      "capsroute: weight must have shape (K, K, C_in, C_out, D, Din) with K, C_out, D >= 1, "
      "got shape ",
      weight.sizes());
  TORCH_CHECK(weight.size(2) == u.size(3) && weight.size(5) == u.size(4),
              "capsroute: weight must have C_in = ", u.size(3),
              " (its dim 2) and Din = ", u.size(4), " (its dim 5) to match u of shape ", u.sizes(),
              ", got weight of shape ", weight.sizes());
  check_conv_window(weight.size(0), u.size(1), u.size(2), stride, padding);
}

inline void check_conv_dynamic_routing_inputs(const at::Tensor& u, const at::Tensor& weight,
                                              const std::optional<at::Tensor>& bias, int64_t iters,
                                              int64_t stride, int64_t padding, double eps) {
  check_conv_capsule_shapes(u, weight, stride, padding);
  check_bias(bias, u, weight.size(3), weight.size(4));
  check_routing_options(iters, eps);
}

// grad_v (B, H', W', C_out, D); s_hist (B, H', W', iters, C_out, D)
inline void check_conv_dynamic_routing_backward_inputs(const at::Tensor& grad_v,
                                                       const at::Tensor& u,
                                                       const at::Tensor& weight,
                                                       const at::Tensor& s_hist, int64_t stride,
                                                       int64_t padding, double eps) {
  check_conv_capsule_shapes(u, weight, stride, padding);
  check_float_dtype(grad_v, "grad_v");
  check_float_dtype(s_hist, "s_hist");
  const int64_t K = weight.size(0), C_out = weight.size(3), D = weight.size(4);
  const int64_t Ho = conv_out_size(u.size(1), K, stride, padding);
  const int64_t Wo = conv_out_size(u.size(2), K, stride, padding);
  TORCH_CHECK(grad_v.sizes() == at::IntArrayRef({u.size(0), Ho, Wo, C_out, D}),
              "capsroute: grad_v must have shape (", u.size(0), ", ", Ho, ", ", Wo, ", ", C_out,
              ", ", D, "), got ", grad_v.sizes());
  TORCH_CHECK(s_hist.dim() == 6 && s_hist.size(3) >= 1 &&
                  s_hist.sizes().slice(0, 3) == grad_v.sizes().slice(0, 3) &&
                  s_hist.sizes().slice(4) == grad_v.sizes().slice(3),
              "capsroute: s_hist must have shape (", u.size(0), ", ", Ho, ", ", Wo, ", iters, ",
              C_out, ", ", D, "), got ", s_hist.sizes());
  TORCH_CHECK(grad_v.device() == u.device() && s_hist.device() == u.device(),
              "capsroute: grad_v and s_hist must be on ", u.device(), " with u, got ",
              grad_v.device(), " and ", s_hist.device());
  check_eps(eps);
}

// A shape as Python writes a tuple: (5, 3) or (4,).
inline std::string shape_tuple(at::IntArrayRef shape) {
  std::string text = "(";
  for (size_t k = 0; k < shape.size(); ++k) text += (k ? ", " : "") + std::to_string(shape[k]);
  return text + (shape.size() == 1 ? ",)" : ")");
}

// An optional parameter of the attention routings: on the device and in the dtype of the capsule
// input ref (votes, or u of the dense routings), with the given shape.
inline void check_routing_parameter(const std::optional<at::Tensor>& t, const at::Tensor& ref,
                                    at::IntArrayRef shape, const char* name, const char* layout,
                                    const char* ref_name = "votes") {
  if (!t.has_value()) return;
  check_same(*t, ref, name, ref_name);
  TORCH_CHECK(t->sizes() == shape, "capsroute: ", name, " must have shape ", layout, " = ",
              shape_tuple(shape), ", got shape ", t->sizes());
}

// votes (B, I, J, D) of an attention routing.
inline void check_attention_votes(const at::Tensor& votes) {
  check_float_dtype(votes, "votes");
  check_rank(votes, 4, "votes", "(B, I, J, D)");
  TORCH_CHECK(votes.size(2) >= 1 && votes.size(3) >= 1,
              "capsroute: votes must have J >= 1 outputs and D >= 1 dims, got shape ",
              votes.sizes());
}

// self_attention_routing's squash argument as the nonlinearity of its last pass.
inline Nonlinearity self_attention_squash(std::string_view squash) {
  if (squash == "efficient") return Nonlinearity::squash_exp;
  TORCH_CHECK(squash == "sabour", "capsroute: squash must be \"efficient\" or \"sabour\", got \"",
              squash, "\"");
  return Nonlinearity::squash;
}

// votes (B, I, J, D), coupling_bias (I, J)
inline void check_self_attention_routing_inputs(const at::Tensor& votes,
                                                const std::optional<at::Tensor>& coupling_bias,
                                                std::string_view squash, double eps) {
  check_attention_votes(votes);
  check_routing_parameter(coupling_bias, votes, {votes.size(1), votes.size(2)}, "coupling_bias",
                          "(I, J)");
  self_attention_squash(squash);
  check_eps(eps);
}

// grad_v (B, J, D) and s_hist (B, 2, J, D): s^0 and s^1.
inline void check_self_attention_state(const at::Tensor& grad_v, const at::Tensor& s_hist,
                                       int64_t B, int64_t J, int64_t D) {
  check_routing_backward_inputs(grad_v, s_hist, B, J, D);
  TORCH_CHECK(s_hist.size(1) == 2, "capsroute: s_hist must have shape (", B, ", 2, ", J, ", ", D,
              "), got ", s_hist.sizes());
}

inline void check_self_attention_routing_backward_inputs(
    const at::Tensor& grad_v, const at::Tensor& votes,
    const std::optional<at::Tensor>& coupling_bias, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_self_attention_routing_inputs(votes, coupling_bias, squash, eps);
  check_self_attention_state(grad_v, s_hist, votes.size(0), votes.size(2), votes.size(3));
}

// u (B, I, Din), weight (I, J, D, Din), coupling_bias (I, J)
inline void check_dense_self_attention_routing_inputs(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& coupling_bias,
    std::string_view squash, double eps) {
  check_dense_shapes(u, weight);
  check_routing_parameter(coupling_bias, u, {weight.size(0), weight.size(1)}, "coupling_bias",
                          "(I, J)", "u");
  self_attention_squash(squash);
  check_eps(eps);
}

inline void check_dense_self_attention_routing_backward_inputs(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const std::optional<at::Tensor>& coupling_bias, const at::Tensor& s_hist,
    std::string_view squash, double eps) {
  check_dense_self_attention_routing_inputs(u, weight, coupling_bias, squash, eps);
  check_self_attention_state(grad_v, s_hist, u.size(0), weight.size(1), weight.size(2));
}

// LayerNorm's eps is inside the square root of the variance: > 0 keeps a constant capsule finite.
inline void check_layer_norm_eps(double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps > 0, "capsroute: eps must be finite and > 0, got ", eps);
}

// norm_weight and norm_bias (D,), on the device and in the dtype of ref (votes or u).
inline void check_norm_parameters(const std::optional<at::Tensor>& norm_weight,
                                  const std::optional<at::Tensor>& norm_bias, const at::Tensor& ref,
                                  int64_t D, const char* ref_name) {
  check_routing_parameter(norm_weight, ref, {D}, "norm_weight", "(D,)", ref_name);
  check_routing_parameter(norm_bias, ref, {D}, "norm_bias", "(D,)", ref_name);
}

// votes (B, I, J, D), norm_weight and norm_bias (D,)
inline void check_inverted_attention_routing_inputs(const at::Tensor& votes,
                                                    const std::optional<at::Tensor>& norm_weight,
                                                    const std::optional<at::Tensor>& norm_bias,
                                                    int64_t iters, double eps) {
  check_attention_votes(votes);
  check_norm_parameters(norm_weight, norm_bias, votes, votes.size(3), "votes");
  TORCH_CHECK(iters >= 1, "capsroute: iters must be >= 1, got ", iters);
  check_layer_norm_eps(eps);
}

inline void check_inverted_attention_routing_backward_inputs(
    const at::Tensor& grad_v, const at::Tensor& votes, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, const at::Tensor& s_hist, double eps) {
  check_attention_votes(votes);
  check_norm_parameters(norm_weight, norm_bias, votes, votes.size(3), "votes");
  check_routing_backward_inputs(grad_v, s_hist, votes.size(0), votes.size(2), votes.size(3));
  check_layer_norm_eps(eps);
}

// u (B, I, Din), weight (I, J, D, Din), norm_weight and norm_bias (D,)
inline void check_dense_inverted_attention_routing_inputs(
    const at::Tensor& u, const at::Tensor& weight, const std::optional<at::Tensor>& norm_weight,
    const std::optional<at::Tensor>& norm_bias, int64_t iters, double eps) {
  check_dense_shapes(u, weight);
  check_norm_parameters(norm_weight, norm_bias, u, weight.size(2), "u");
  TORCH_CHECK(iters >= 1, "capsroute: iters must be >= 1, got ", iters);
  check_layer_norm_eps(eps);
}

inline void check_dense_inverted_attention_routing_backward_inputs(
    const at::Tensor& grad_v, const at::Tensor& u, const at::Tensor& weight,
    const std::optional<at::Tensor>& norm_weight, const std::optional<at::Tensor>& norm_bias,
    const at::Tensor& s_hist, double eps) {
  check_dense_shapes(u, weight);
  check_norm_parameters(norm_weight, norm_bias, u, weight.size(2), "u");
  check_routing_backward_inputs(grad_v, s_hist, u.size(0), weight.size(1), weight.size(2));
  check_layer_norm_eps(eps);
}

inline at::ScalarType acc_dtype(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace capsroute
