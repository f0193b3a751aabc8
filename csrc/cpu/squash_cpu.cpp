#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../common/acc_math.h"
#include "../common/checks.h"
#include "../common/kernel_path.h"
#include "output_cache.h"

namespace capsroute {
namespace {

// Rows of the last dim: out = squash(s) (forward) or out = squash_vjp(s, grad) (backward).
template <bool kBackward>
at::Tensor squash_rows_cpu(const at::Tensor& s_in, const at::Tensor* grad_in, double eps) {
  if (kBackward)
    check_squash_backward_inputs(*grad_in, s_in, eps);
  else
    check_squash_inputs(s_in, eps);
  record_kernel_path("squash", kBackward ? Direction::backward : Direction::forward, "cpu");
  const at::Tensor s = s_in.contiguous();
  const at::Tensor grad = kBackward ? grad_in->to(s.scalar_type()).contiguous() : at::Tensor();
  at::Tensor out = cpu::empty_output_like(s);
  const int64_t D = s.size(-1);
  const int64_t rows = D == 0 ? 0 : s.numel() / D;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.scalar_type(), "squash_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* sp = s.const_data_ptr<scalar_t>();
    const scalar_t* gp = kBackward ? grad.const_data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 2048 / std::max<int64_t>(D, 1) + 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* x = sp + row * D;
        acc_t q = 0, sg = 0;
        for (int64_t d = 0; d < D; ++d) {
          q += static_cast<acc_t>(x[d]) * static_cast<acc_t>(x[d]);
          if (kBackward) sg += static_cast<acc_t>(x[d]) * static_cast<acc_t>(gp[row * D + d]);
        }
        if (kBackward) {
          const SquashVjp<acc_t> k = squash_vjp_coeffs(q, static_cast<acc_t>(eps));
          for (int64_t d = 0; d < D; ++d)
            op[row * D + d] = static_cast<scalar_t>(k.scale * static_cast<acc_t>(gp[row * D + d]) +
                                                    k.radial * sg * static_cast<acc_t>(x[d]));
        } else {
          const acc_t scale = squash_scale(q, static_cast<acc_t>(eps));
          for (int64_t d = 0; d < D; ++d)
            op[row * D + d] = static_cast<scalar_t>(scale * static_cast<acc_t>(x[d]));
        }
      }
    });
  });
  return out;
}

at::Tensor squash_cpu(const at::Tensor& s, double eps) {
  return squash_rows_cpu<false>(s, nullptr, eps);
}

at::Tensor squash_backward_cpu(const at::Tensor& grad_v, const at::Tensor& s, double eps) {
  TORCH_CHECK(grad_v.sizes() == s.sizes(), "capsroute: grad_v must have the shape of s ", s.sizes(),
              ", got ", grad_v.sizes());
  return squash_rows_cpu<true>(s, &grad_v, eps);
}

}  // namespace

TORCH_LIBRARY_IMPL(capsroute, CPU, m) {
  m.impl("squash", &squash_cpu);
  m.impl("_squash_backward", &squash_backward_cpu);
}

}  // namespace capsroute
