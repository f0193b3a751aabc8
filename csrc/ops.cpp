// Every capsroute operator schema. Backends implement them in cpu/ and cuda/; autograd and
// fake (meta) implementations are attached in capsroute/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(capsroute, m) {
  // squash over the last dim.
  m.def("squash(Tensor s, float eps) -> Tensor");
  m.def("_squash_backward(Tensor grad_v, Tensor s, float eps) -> Tensor");

  // Returns (v (B, J, D), final coupling c (B, I, J), s_hist (B, iters, J, D) in the
  // accumulation dtype: s before squash at each iteration, all the backward keeps).
  m.def(
      "dynamic_routing(Tensor votes, Tensor? bias, int iters, bool leaky, bool detach, float eps)"
      " -> (Tensor, Tensor, Tensor)");
  // Returns (grad_votes, grad_bias (J, D)).
  m.def(
      "_dynamic_routing_backward(Tensor grad_v, Tensor votes, Tensor s_hist, bool leaky, bool detach,"
      " float eps) -> (Tensor, Tensor)");

  // Dynamic routing over votes_ij = weight_ij @ u_i, never materialised in device memory.
  m.def(
      "dense_capsules(Tensor u, Tensor weight, Tensor? bias, int iters, bool leaky, bool detach, float eps)"
      " -> (Tensor, Tensor, Tensor)");
  // Returns (grad_u, grad_weight, grad_bias (J, D)).
  m.def(
      "_dense_capsules_backward(Tensor grad_v, Tensor u, Tensor weight, Tensor s_hist, bool leaky,"
      " bool detach, float eps) -> (Tensor, Tensor, Tensor)");
}
