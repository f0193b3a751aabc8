// The `launch` the CUDA ops pass to the launch sequences (agreement_sequence.cuh, em_sequence.cuh):
// a kernel on `blocks` blocks of kBlockThreads threads on the given stream, checked (or on
// clusters of blocks with dynamic shared memory); and how many row ranges fill the device.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "device_utils.cuh"

namespace capsroute {
namespace cuda {

// Streaming multiprocessors of the current device.
inline int64_t device_sms() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Row ranges per element (a block each) for B elements of I rows: 1 when B blocks fill the
// current device, else enough for about kBlocksPerSm blocks per SM, each range at least min_rows
// rows long. (The routing and EM kernels' row-range paths.)
constexpr int64_t kBlocksPerSm = 4;

inline int64_t row_ranges_to_fill_device(int64_t B, int64_t I, int64_t min_rows) {
  const int64_t wanted_blocks = kBlocksPerSm * device_sms();
  if (B >= wanted_blocks / 2) return 1;
  const int64_t max_ranges = std::max<int64_t>(1, I / min_rows);
  return std::min<int64_t>(ceil_div<int64_t>(wanted_blocks, std::max<int64_t>(B, 1)), max_ranges);
}

// The same for kernels of which only blocks_per_sm fit an SM: as many ranges as keep the B x
// ranges blocks within one wave of resident blocks (rounding up would leave a short second wave).
inline int64_t row_ranges_in_one_wave(int64_t B, int64_t I, int64_t min_rows,
                                      int64_t blocks_per_sm) {
  const int64_t resident = blocks_per_sm * device_sms();
  const int64_t max_ranges = std::max<int64_t>(1, I / min_rows);
  return std::clamp<int64_t>(resident / std::max<int64_t>(B, 1), 1, max_ranges);
}

// A cluster kernel on the current device, set up once per (device, kernel) and cached, so that
// a launch makes no attribute calls: the PTX version of the code loaded for it, and the dynamic
// shared memory a block may have (the opt-in maximum less the kernel's static shared memory).
// Where the code is built for sm_90 or later (elsewhere the cluster kernels trap and are never
// launched), the kernel is allowed all of that (always the same value, so host threads launching
// it with different sizes cannot race on the attribute), clusters beyond the portable 8 blocks
// (sm_90 schedules 16), and the SMs' memory split in favour of shared memory (the cluster kernels
// keep their rows there; with the default split 2 blocks an SM would depend on the driver).
struct ClusterKernelSetup {
  int ptx_version;
  int64_t max_dynamic_shared_bytes;
};

inline ClusterKernelSetup cluster_kernel_setup(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, ClusterKernelSetup> setups;
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = setups.find({device, kernel});
  if (found != setups.end()) return found->second;
  int max_shared = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  const ClusterKernelSetup setup{attributes.ptxVersion,
                                 max_shared - static_cast<int64_t>(attributes.sharedSizeBytes)};
  if (setup.ptx_version >= 90) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(setup.max_dynamic_shared_bytes)));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
  }
  setups.emplace(std::make_pair(device, kernel), setup);
  return setup;
}

// The launch configuration of `clusters` clusters of cluster_blocks blocks with shared_bytes of
// dynamic shared memory each (the kernel set up by cluster_kernel_setup).
struct ClusterLaunch {
  cudaLaunchAttribute cluster_dims = {};
  cudaLaunchConfig_t config = {};
  ClusterLaunch(unsigned int clusters, int cluster_blocks, int64_t shared_bytes,
                cudaStream_t stream) {
    cluster_dims.id = cudaLaunchAttributeClusterDimension;
    cluster_dims.val.clusterDim.x = cluster_blocks;
    cluster_dims.val.clusterDim.y = 1;
    cluster_dims.val.clusterDim.z = 1;
    config.gridDim = dim3(clusters * cluster_blocks);
    config.blockDim = dim3(kBlockThreads);
    config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
    config.stream = stream;
    config.attrs = &cluster_dims;
    config.numAttrs = 1;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // config points at cluster_dims
};

// How many clusters of cluster_blocks blocks with shared_bytes each of a cluster kernel the
// current device runs at once (0: it cannot schedule them), cached per device, kernel and size.
inline int resident_clusters(const void* kernel, int cluster_blocks, int64_t shared_bytes) {
  cluster_kernel_setup(kernel);  // the attributes it sets decide the occupancy
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, int64_t>, int> counts;
  const auto key =
      std::make_tuple(int{c10::cuda::current_device()}, kernel, cluster_blocks, shared_bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = counts.find(key);
  if (found != counts.end()) return found->second;
  const ClusterLaunch launch(1, cluster_blocks, shared_bytes, nullptr);
  int count = 0;
  const cudaError_t status = cudaOccupancyMaxActiveClusters(&count, kernel, &launch.config);
  if (status == cudaErrorInvalidClusterSize || status == cudaErrorNotSupported) {
    (void)cudaGetLastError();  // clusters of this size not schedulable here: not an error of the op
    count = 0;
  } else {
    C10_CUDA_CHECK(status);
  }
  counts.emplace(key, count);
  return count;
}

struct StreamLaunch {
  cudaStream_t stream;
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), unsigned int blocks, const Args&... args) const {
    kernel<<<blocks, kBlockThreads, 0, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // `kernel` on `clusters` clusters of cluster_blocks blocks (sm_90), each block with
  // shared_bytes of dynamic shared memory (see ClusterLaunch).
  template <typename... Params, typename... Args>
  void cluster(void (*kernel)(Params...), unsigned int clusters, int cluster_blocks,
               int64_t shared_bytes, const Args&... args) const {
    cluster_kernel_setup(reinterpret_cast<const void*>(kernel));  // once per device
    const ClusterLaunch launch(clusters, cluster_blocks, shared_bytes, stream);
    C10_CUDA_CHECK(cudaLaunchKernelEx(&launch.config, kernel, args...));
  }
};

}  // namespace cuda
}  // namespace capsroute
