// em_routing_pose on the CPU: EM routing over votes_ij = pose_i @ weight_ij (4x4 matrices).
// Each thread computes one element's votes into a slab of its own and runs em_element.h on
// it; the backward recomputes the slab, and contracts the vote gradient into the pose
// gradient (per element) and the weight gradient (per fixed chunk of the batch, the chunks
// added in order: deterministic for any number of threads).
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

constexpr int64_t kWeightChunks = 16;  // batch chunks of the weight gradient

// votes (I, J, 16) of one element: V_ij = P_i @ W_ij, pose_i at pose + i * pose_row_stride.
template <typename scalar_t, typename acc_t>
void compute_votes(const scalar_t* pose, int64_t pose_row_stride, const scalar_t* weight, int64_t I,
                   int64_t J, acc_t* votes) {
  for (int64_t i = 0; i < I; ++i) {
    const scalar_t* P = pose + i * pose_row_stride;
    for (int64_t j = 0; j < J; ++j) {
      const scalar_t* W = weight + (i * J + j) * kPoseSize;
      acc_t* V = votes + (i * J + j) * kPoseSize;
      for (int r = 0; r < 4; ++r)
        for (int c = 0; c < 4; ++c) {
          acc_t sum = 0;
          for (int k = 0; k < 4; ++k)
            sum += static_cast<acc_t>(P[r * 4 + k]) * static_cast<acc_t>(W[k * 4 + c]);
          V[r * 4 + c] = sum;
        }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> em_routing_pose_cpu(
    const at::Tensor& pose_in, const at::Tensor& weight_in, const at::Tensor& a_in_in,
    const at::Tensor& beta_u_in, const at::Tensor& beta_a_in, int64_t iters, double final_lambda,
    double eps) {
  check_em_routing_pose_inputs(pose_in, weight_in, a_in_in, beta_u_in, beta_a_in, iters,
                               final_lambda, eps);
  record_kernel_path("em_routing_pose", Direction::forward, "cpu");
  const at::Tensor pose = with_contiguous_capsules(pose_in, 2), weight = weight_in.contiguous();
  const at::Tensor a_in = a_in_in.contiguous(), beta_u = beta_u_in.contiguous(),
                   beta_a = beta_a_in.contiguous();
  const CapsuleStrides strides = capsule_strides(pose, 2);
  const int64_t B = pose.size(0);
  const EmDims dims{B, pose.size(1), weight.size(1), kPoseSize, iters, final_lambda};
  const int64_t JH = dims.J * kPoseSize, stats_numel = iters * dims.J * dims.stats_row();
  at::Tensor pose_out = cpu::empty_output({B, dims.J, kPoseSize}, pose.options());
  at::Tensor a_out = cpu::empty_output({B, dims.J}, pose.options());
  at::Tensor stats = cpu::empty_output({B, iters, dims.J, dims.stats_row()},
                                       pose.options().dtype(acc_dtype(pose.scalar_type())));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "em_routing_pose_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* P = pose.const_data_ptr<scalar_t>();
        const scalar_t* W = weight.const_data_ptr<scalar_t>();
        const scalar_t* a = a_in.const_data_ptr<scalar_t>();
        at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
          EmElement<acc_t, acc_t, kPoseSize> em(dims, eps);
          std::vector<acc_t> votes(dims.I * JH), a_acc(dims.I);
          for (int64_t n = begin; n < end; ++n) {
            compute_votes(P + strides.offset(n, 0), strides.row, W, dims.I, dims.J, votes.data());
            for (int64_t i = 0; i < dims.I; ++i) a_acc[i] = static_cast<acc_t>(a[n * dims.I + i]);
            em.forward(cpu::VoteRows<acc_t>{votes.data(), JH, kPoseSize}, a_acc.data(),
                       beta_u.const_data_ptr<scalar_t>(), beta_a.const_data_ptr<scalar_t>(),
                       stats.mutable_data_ptr<acc_t>() + n * stats_numel,
                       pose_out.mutable_data_ptr<scalar_t>() + n * JH,
                       a_out.mutable_data_ptr<scalar_t>() + n * dims.J);
          }
        });
      });
  return {pose_out, a_out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> em_routing_pose_backward_cpu(
    const at::Tensor& grad_pose_out_in, const at::Tensor& grad_a_out_in, const at::Tensor& pose_in,
    const at::Tensor& weight_in, const at::Tensor& a_in_in, const at::Tensor& beta_u_in,
    const at::Tensor& beta_a_in, const at::Tensor& stats_in, double final_lambda, double eps) {
  check_em_routing_pose_backward_inputs(grad_pose_out_in, grad_a_out_in, pose_in, weight_in,
                                        a_in_in, beta_u_in, beta_a_in, stats_in, final_lambda, eps);
  const int64_t iters = stats_in.size(1);
  const int64_t B = pose_in.size(0), I = pose_in.size(1), J = weight_in.size(1), JH = J * kPoseSize;
  record_kernel_path("em_routing_pose", Direction::backward, "cpu");
  const EmDims dims{B, I, J, kPoseSize, iters, final_lambda};
  const at::ScalarType acc = acc_dtype(pose_in.scalar_type());
  const at::Tensor pose = with_contiguous_capsules(pose_in, 2), weight = weight_in.contiguous();
  const at::Tensor a_in = a_in_in.contiguous(), beta_u = beta_u_in.contiguous();
  const CapsuleStrides strides = capsule_strides(pose, 2);
  const at::Tensor grad_pose_out = grad_pose_out_in.to(acc).contiguous(),
                   grad_a_out = grad_a_out_in.to(acc).contiguous();
  const at::Tensor stats = stats_in.to(acc).contiguous();
  at::Tensor grad_pose = empty_capsule_gradient(pose, 2);
  const CapsuleStrides grad_strides = capsule_strides(grad_pose, 2);
  at::Tensor grad_a_in = cpu::empty_output_like(a_in);
  at::Tensor grad_beta_items = at::zeros({B, 2, J}, pose.options().dtype(acc));
  const int64_t chunks = std::max<int64_t>(1, std::min(B, kWeightChunks));
  at::Tensor grad_weight_parts = at::zeros({chunks, I, J, kPoseSize}, pose.options().dtype(acc));

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, pose.scalar_type(), "em_routing_pose_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const scalar_t* P = pose.const_data_ptr<scalar_t>();
        const scalar_t* W = weight.const_data_ptr<scalar_t>();
        const scalar_t* a = a_in.const_data_ptr<scalar_t>();
        at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
          EmBackward<acc_t, acc_t, kPoseSize> backward(dims, eps);
          std::vector<acc_t> votes(I * JH), g_V(I * JH), a_acc(I), g_a(I);
          for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
            acc_t* g_W = grad_weight_parts.mutable_data_ptr<acc_t>() + chunk * I * JH;
            for (int64_t n = chunk * B / chunks; n < (chunk + 1) * B / chunks; ++n) {
              const scalar_t* Pn = P + strides.offset(n, 0);
              compute_votes(Pn, strides.row, W, I, J, votes.data());
              for (int64_t i = 0; i < I; ++i) a_acc[i] = static_cast<acc_t>(a[n * I + i]);
              std::fill(g_V.begin(), g_V.end(), acc_t(0));
              std::fill(g_a.begin(), g_a.end(), acc_t(0));
              acc_t* g_beta_u = grad_beta_items.mutable_data_ptr<acc_t>() + n * 2 * J;
              backward.run(cpu::VoteRows<acc_t>{votes.data(), JH, kPoseSize}, a_acc.data(),
                           beta_u.const_data_ptr<scalar_t>(),
                           stats.const_data_ptr<acc_t>() + n * iters * J * dims.stats_row(),
                           grad_pose_out.const_data_ptr<acc_t>() + n * JH,
                           grad_a_out.const_data_ptr<acc_t>() + n * J, g_V.data(), g_a.data(),
                           g_beta_u, g_beta_u + J);
              std::copy(g_a.begin(), g_a.end(), grad_a_in.mutable_data_ptr<scalar_t>() + n * I);
              // V_ij = P_i W_ij: g_P_i = sum_j g_V_ij W_ij^T, g_W_ij += P_i^T g_V_ij.
              for (int64_t i = 0; i < I; ++i) {
                acc_t g_P[kPoseSize] = {};
                const scalar_t* Pi = Pn + i * strides.row;
                for (int64_t j = 0; j < J; ++j) {
                  const acc_t* gV = g_V.data() + (i * J + j) * kPoseSize;
                  const scalar_t* Wij = W + (i * J + j) * kPoseSize;
                  acc_t* gW = g_W + (i * J + j) * kPoseSize;
                  for (int r = 0; r < 4; ++r)
                    for (int k = 0; k < 4; ++k)
                      for (int c = 0; c < 4; ++c) {
                        g_P[r * 4 + k] += gV[r * 4 + c] * static_cast<acc_t>(Wij[k * 4 + c]);
                        gW[k * 4 + c] += static_cast<acc_t>(Pi[r * 4 + k]) * gV[r * 4 + c];
                      }
                }
                scalar_t* out = grad_pose.mutable_data_ptr<scalar_t>() + grad_strides.offset(n, i);
                for (int k = 0; k < kPoseSize; ++k) out[k] = static_cast<scalar_t>(g_P[k]);
              }
            }
          }
        });
      });
  // Two tensors of their own, not two rows of one: the schema's outputs must not alias (opcheck).
  const at::Tensor grad_betas = grad_beta_items.sum(0).to(pose.scalar_type());
  return {grad_pose, grad_weight_parts.sum(0).view(weight.sizes()).to(pose.scalar_type()),
          grad_a_in, grad_betas[0].clone(), grad_betas[1].clone()};
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("em_routing_pose", &em_routing_pose_cpu);
  m.impl("_em_routing_pose_backward", &em_routing_pose_backward_cpu);
}

}  // namespace capsroute
