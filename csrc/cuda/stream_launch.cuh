// The `launch` the CUDA ops pass to the launch sequences (routing_sequence.cuh, em_sequence.cuh):
// a kernel on `blocks` blocks of kBlockThreads threads on the given stream, checked.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

struct StreamLaunch {
  cudaStream_t stream;
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), unsigned int blocks, const Args&... args) const {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

}  // namespace cuda
}  // namespace capsroute
