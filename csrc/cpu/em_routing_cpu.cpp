// EM routing (docs/ops.md, em_routing) on the CPU, one batch element per task of at::parallel_for
// (the per-element math is in em_element.h). The forward keeps, per iteration, the M-step's
// statistics (mean, variance, activation logit: (2H + 1) J values); the backward recomputes the
// assignments R from them and walks the iterations backwards through the E-step (a
// log-softmax) and the M-step (weighted moments).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "../common/layout.h"
#include "em_element.h"
#include "output_cache.h"

namespace capsroute {
namespace {

using cpu::EmBackward;
using cpu::EmElement;

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_cpu(
    const at::Tensor& votes_in, const at::Tensor& a_in_in, const at::Tensor& beta_u_in,
    const at::Tensor& beta_a_in, int64_t iters, double final_lambda, double eps) {
  check_em_routing_inputs(votes_in, a_in_in, beta_u_in, beta_a_in, iters, final_lambda, eps);
  record_kernel_path("em_routing", Direction::forward, "cpu");
  const at::Tensor votes = with_contiguous_capsules(votes_in), a_in = a_in_in.contiguous();
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const int64_t B = votes.size(0);
  const EmDims dims{votes.size(0), votes.size(1), votes.size(2),
                    votes.size(3), iters,         final_lambda};
  const int64_t JH = dims.J * dims.H, stats_numel = iters * dims.J * dims.stats_row();
  at::Tensor pose = cpu::empty_output({B, dims.J, dims.H}, votes.options());
  at::Tensor a_out = cpu::empty_output({B, dims.J}, votes.options());
  at::Tensor stats = cpu::empty_output({B, iters, dims.J, dims.stats_row()},
                                       votes.options().dtype(acc_dtype(votes.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* V = votes.const_data_ptr<scalar_t>();
        const scalar_t* a = a_in.const_data_ptr<scalar_t>();
        const scalar_t* bu = beta_u.const_data_ptr<scalar_t>();
        const scalar_t* ba = beta_a.const_data_ptr<scalar_t>();
        cpu::dispatch_size<kPoseSize>(dims.H, [&](auto pose_dim) {
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            EmElement<scalar_t, acc_t, decltype(pose_dim)::value> em(dims, eps);
            std::vector<scalar_t> slab;
            for (int64_t n = begin; n < end; ++n) {
              em.forward(cpu::staged_element_votes(V, strides, n, dims.I, dims.J, dims.H, slab),
                         a + n * dims.I, bu, ba, stats.mutable_data_ptr<acc_t>() + n * stats_numel,
                         pose.mutable_data_ptr<scalar_t>() + n * JH,
                         a_out.mutable_data_ptr<scalar_t>() + n * dims.J);
            }
          });
        });
      });
  return {pose, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> em_routing_backward_cpu(
    const at::Tensor& grad_pose_in, const at::Tensor& grad_a_out_in, const at::Tensor& votes_in,
    const at::Tensor& a_in_in, const at::Tensor& beta_u_in, const at::Tensor& beta_a_in,
    const at::Tensor& stats_in, double final_lambda, double eps) {
  check_em_routing_backward_inputs(grad_pose_in, grad_a_out_in, votes_in, a_in_in, beta_u_in,
                                   beta_a_in, stats_in, final_lambda, eps);
  const int64_t B = votes_in.size(0), iters = stats_in.size(1);
  record_kernel_path("em_routing", Direction::backward, "cpu");
  const EmDims dims{B, votes_in.size(1), votes_in.size(2), votes_in.size(3), iters, final_lambda};
  const int64_t I = dims.I, J = dims.J, H = dims.H, JH = J * H, row = dims.stats_row();
  const at::ScalarType acc = acc_dtype(votes_in.scalar_type());
  const at::Tensor votes = with_contiguous_capsules(votes_in), a_in = a_in_in.contiguous();
  const CapsuleStrides strides = capsule_strides(votes, 3);
  const at::Tensor beta_u = beta_u_in.contiguous(), beta_a = beta_a_in.contiguous();
  const at::Tensor grad_pose = grad_pose_in.to(acc).contiguous(),
                   grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  at::Tensor grad_votes = empty_capsule_gradient(votes, 1);
  const CapsuleStrides grad_strides = capsule_strides(grad_votes, 3);
  at::Tensor grad_a_in = cpu::empty_output_like(a_in);
  // Per-item beta gradients, summed afterwards in a fixed order (deterministic).
  at::Tensor grad_beta_items = at::zeros({B, 2, J}, votes.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, votes.scalar_type(), "em_routing_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* V = votes.const_data_ptr<scalar_t>();
        const scalar_t* a_all = a_in.const_data_ptr<scalar_t>();
        const scalar_t* bu = beta_u.const_data_ptr<scalar_t>();
        cpu::dispatch_size<kPoseSize>(dims.H, [&](auto pose_dim) {
          at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
            EmBackward<scalar_t, acc_t, decltype(pose_dim)::value> backward(dims, eps);
            std::vector<acc_t> g_V(I * JH), g_a(I);
            std::vector<scalar_t> slab;
            for (int64_t n = begin; n < end; ++n) {
              std::fill(g_V.begin(), g_V.end(), acc_t(0));
              std::fill(g_a.begin(), g_a.end(), acc_t(0));
              acc_t* g_beta_u = grad_beta_items.mutable_data_ptr<acc_t>() + n * 2 * J;
              backward.run(cpu::staged_element_votes(V, strides, n, I, J, H, slab), a_all + n * I,
                           bu, stats.const_data_ptr<acc_t>() + n * iters * J * row,
                           grad_pose.const_data_ptr<acc_t>() + n * JH,
                           grad_a_out.const_data_ptr<acc_t>() + n * J, g_V.data(), g_a.data(),
                           g_beta_u, g_beta_u + J);
              std::copy(g_a.begin(), g_a.end(), grad_a_in.mutable_data_ptr<scalar_t>() + n * I);
              for (int64_t i = 0; i < I; ++i)
                store_capsule_row(g_V.data() + i * JH, J, H, grad_strides, n, i,
                                  grad_votes.mutable_data_ptr<scalar_t>());
            }
          });
        });
      });
  // Two tensors of their own, not two rows of one: the schema's outputs must not alias (opcheck).
  const at::Tensor grad_betas = grad_beta_items.sum(0).to(votes.scalar_type());
  return {grad_votes, grad_a_in, grad_betas[0].clone(), grad_betas[1].clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("em_routing", &em_routing_cpu);
  m.impl("_em_routing_backward", &em_routing_backward_cpu);
}

}  // namespace capsroute
