// Every capsroute operator schema, each public op defined with its autograd (autograd.cpp).
// Backends implement them in cpu/ and cuda/; the fake (meta) implementations are attached in
// capsroute/ops/. The agreement routings on votes and their dense forms take `couplings`: when
// false, their coupling output c is empty, (0,), and the couplings are never written to memory.
#include <torch/library.h>

#include <string>

#include "autograd.h"

namespace {

// Defines the op of `schema` with its Autograd kernel; its backward operator is defined apart.
void def_differentiable(torch::Library& m, const char* schema) {
  m.def(schema);
  const std::string text(schema);
  const std::string name = text.substr(0, text.find('('));
  m.impl(name.c_str(),
         torch::dispatch(c10::DispatchKey::Autograd, capsroute::autograd_kernel(name.c_str())));
}

}  // namespace

TORCH_LIBRARY(capsroute, m) {
  // squash over the last dim.
  def_differentiable(m, "squash(Tensor s, float eps) -> Tensor");
  m.def("_squash_backward(Tensor grad_v, Tensor s, float eps) -> Tensor");

  // Returns (v (B, J, D), final coupling c (B, I, J), s_hist (B, iters, J, D) in the
  // accumulation dtype: s before squash at each iteration, all the backward keeps).
  def_differentiable(
      m,
      "dynamic_routing(Tensor votes, Tensor? bias, int iters, bool leaky, bool detach, float eps,"
      " bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_votes, grad_bias (J, D)).
  m.def(
      "_dynamic_routing_backward(Tensor grad_v, Tensor votes, Tensor s_hist, bool leaky, bool "
      "detach,"
      " float eps) -> (Tensor, Tensor)");

  // Dynamic routing over votes_ij = weight_ij @ u_i, never materialised in device memory. Returns
  // what dynamic_routing returns.
  def_differentiable(
      m,
      "dense_capsules(Tensor u, Tensor weight, Tensor? bias, int iters, bool leaky, bool detach, "
      "float eps, bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_u, grad_weight, grad_bias (J, D)).
  m.def(
      "_dense_capsules_backward(Tensor grad_v, Tensor u, Tensor weight, Tensor s_hist, bool leaky,"
      " bool detach, float eps) -> (Tensor, Tensor, Tensor)");

  // EM routing (matrix capsules). Returns (pose (B, J, H), a_out (B, J), stats (B, iters, J, 2H+1)
  // in the accumulation dtype: per iteration the M-step's mean, variance and activation logit).
  def_differentiable(
      m,
      "em_routing(Tensor votes, Tensor a_in, Tensor beta_u, Tensor beta_a, int iters, float "
      "final_lambda,"
      " float eps) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_votes, grad_a_in, grad_beta_u, grad_beta_a).
  m.def(
      "_em_routing_backward(Tensor grad_pose, Tensor grad_a_out, Tensor votes, Tensor a_in, Tensor "
      "beta_u,"
      " Tensor beta_a, Tensor stats, float final_lambda, float eps) -> (Tensor, Tensor, Tensor, "
      "Tensor)");

  // EM routing over votes_ij = pose_i @ weight_ij (4x4 matrices), never materialised in memory:
  // pose (B, I, 4, 4), weight (I, J, 4, 4). Returns what em_routing returns (H = 16).
  def_differentiable(
      m,
      "em_routing_pose(Tensor pose, Tensor weight, Tensor a_in, Tensor beta_u, Tensor beta_a, int "
      "iters,"
      " float final_lambda, float eps) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_pose, grad_weight, grad_a_in, grad_beta_u, grad_beta_a).
  m.def(
      "_em_routing_pose_backward(Tensor grad_pose_out, Tensor grad_a_out, Tensor pose, Tensor "
      "weight,"
      " Tensor a_in, Tensor beta_u, Tensor beta_a, Tensor stats, float final_lambda, float eps)"
      " -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // EM routing in a convolutional capsule layer, each child's assignments normalised over every
  // parent of every window that contains it: pose (B, H, W, C_in, 4, 4), a_in (B, H, W, C_in),
  // weight (K, K, C_in, C_out, 4, 4). Returns (pose (B, H', W', C_out, 16), a_out (B, H', W',
  // C_out), stats (B, H', W', iters, C_out, 33) in the accumulation dtype, em_routing's per
  // window).
  def_differentiable(
      m,
      "conv_em_routing(Tensor pose, Tensor a_in, Tensor weight, Tensor beta_u, Tensor beta_a, int "
      "iters,"
      " int stride, int padding, float final_lambda, float eps) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_pose, grad_a_in, grad_weight, grad_beta_u, grad_beta_a).
  m.def(
      "_conv_em_routing_backward(Tensor grad_pose_out, Tensor grad_a_out, Tensor pose, Tensor a_in,"
      " Tensor weight, Tensor beta_u, Tensor beta_a, Tensor stats, int stride, int padding,"
      " float final_lambda, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");

  // Dynamic routing in a convolutional capsule layer (SegCaps' locally-constrained routing):
  // u (B, H, W, C_in, Din), weight (K, K, C_in, C_out, D, Din); the votes of each output position
  // are computed a chunk of positions at a time, never for the whole batch. Returns (v (B, H', W',
  // C_out, D), final coupling c (B, H', W', C_in, C_out), s_hist (B, H', W', iters, C_out, D) in
  // the accumulation dtype).
  def_differentiable(
      m,
      "conv_dynamic_routing(Tensor u, Tensor weight, Tensor? bias, int iters, int stride,"
      " int padding, bool leaky, bool detach, float eps) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_u, grad_weight, grad_bias (C_out, D)).
  m.def(
      "_conv_dynamic_routing_backward(Tensor grad_v, Tensor u, Tensor weight, Tensor s_hist,"
      " int stride, int padding, bool leaky, bool detach, float eps) -> (Tensor, Tensor, Tensor)");

  // Efficient-CapsNet's self-attention routing: a uniformly coupled pass, then couplings
  // softmax_j(<u_ij, sum_k u_kj> / sqrt(D)) + coupling_bias (I, J); squash "efficient" or "sabour".
  // Returns (v (B, J, D), coupling c (B, I, J), s_hist (B, 2, J, D) in the accumulation dtype).
  def_differentiable(
      m,
      "self_attention_routing(Tensor votes, Tensor? coupling_bias, str squash, float eps,"
      " bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_votes, grad_coupling_bias (I, J)).
  m.def(
      "_self_attention_routing_backward(Tensor grad_v, Tensor votes, Tensor? coupling_bias,"
      " Tensor s_hist, str squash, float eps) -> (Tensor, Tensor)");

  // Inverted dot-product attention routing (Tsai et al. 2020): uniform couplings, then
  // softmax_j(<u_ij, v_j> / sqrt(D)) of the previous pass's v; v = LayerNorm(s) with optional
  // affine norm_weight, norm_bias (D,). Returns (v (B, J, D), final coupling c (B, I, J), s_hist
  // (B, iters, J, D) in the accumulation dtype).
  def_differentiable(
      m,
      "inverted_attention_routing(Tensor votes, Tensor? norm_weight, Tensor? norm_bias, int iters,"
      " float eps, bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_votes, grad_norm_weight (D,), grad_norm_bias (D,)).
  m.def(
      "_inverted_attention_routing_backward(Tensor grad_v, Tensor votes, Tensor? norm_weight,"
      " Tensor? norm_bias, Tensor s_hist, float eps) -> (Tensor, Tensor, Tensor)");

  // self_attention_routing over votes_ij = weight_ij @ u_i, computed on the fly as dense_capsules
  // computes them: u (B, I, Din), weight (I, J, D, Din). Returns what self_attention_routing does.
  def_differentiable(
      m,
      "dense_self_attention_routing(Tensor u, Tensor weight, Tensor? coupling_bias, str squash,"
      " float eps, bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_u, grad_weight, grad_coupling_bias (I, J)).
  m.def(
      "_dense_self_attention_routing_backward(Tensor grad_v, Tensor u, Tensor weight,"
      " Tensor? coupling_bias, Tensor s_hist, str squash, float eps) -> (Tensor, Tensor, Tensor)");

  // inverted_attention_routing over votes_ij = weight_ij @ u_i, computed on the fly. Returns what
  // inverted_attention_routing does.
  def_differentiable(
      m,
      "dense_inverted_attention_routing(Tensor u, Tensor weight, Tensor? norm_weight,"
      " Tensor? norm_bias, int iters, float eps, bool couplings=True) -> (Tensor, Tensor, Tensor)");
  // Returns (grad_u, grad_weight, grad_norm_weight (D,), grad_norm_bias (D,)).
  m.def(
      "_dense_inverted_attention_routing_backward(Tensor grad_v, Tensor u, Tensor weight,"
      " Tensor? norm_weight, Tensor? norm_bias, Tensor s_hist, float eps)"
      " -> (Tensor, Tensor, Tensor, Tensor)");
}
