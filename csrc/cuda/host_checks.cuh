// Host-side argument checks of the CUDA backend (tensors on a CUDA device, on the right one),
// on top of the backend-neutral checks of common/checks.h.
//
// Only c10 CUDA headers here (not ATen/cuda/CUDAContext.h, which pulls in cusparse.h and the
// build toolkit has no cuSPARSE headers).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

namespace capsroute {
namespace cuda {

// Host check: t lives on the same CUDA device as ref (the tensor the op is guarded on).
inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                              const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), "capsroute: ", name, " is on ", t.device(), " but ",
              ref_name, " is on ", ref.device());
}

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "capsroute: ", name,
              " must be a CUDA tensor for the CUDA kernels, got one on ", t.device());
}

}  // namespace cuda
}  // namespace capsroute
