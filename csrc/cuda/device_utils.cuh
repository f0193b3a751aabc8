// Device-side helpers shared by the capsroute kernels: block shape, integer helpers, warp
// reductions and launch-configuration arithmetic. Free of torch headers, so the kernel headers
// that include only this (agreement_block_kernels.cuh) also compile on the host against the CUDA
// emulator of tests/emulator.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#include <cooperative_groups.h>
#endif

namespace capsroute {
namespace cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Threads per block of every capsroute kernel: a multiple of the warp size, so that loops
// whose bounds are uniform per warp always keep whole warps together.
constexpr int kBlockThreads = 256;
constexpr int kWarpsPerBlock = kBlockThreads / kWarpSize;
static_assert(kBlockThreads % kWarpSize == 0, "blocks must be made of whole warps");

// Grid-stride loops cap their grids here; more work just loops.
constexpr int64_t kMaxBlocks = int64_t(1) << 16;

template <typename T>
__host__ __device__ __forceinline__ T ceil_div(T a, T b) {
  return (a + b - 1) / b;
}

// Sum / max over the 32 lanes of a warp; every lane gets the result. All 32 lanes must call
// these together (full mask). The xor butterfly combines a + b and b + a at each step, so
// every lane ends with the bitwise same value.
template <typename T>
__device__ __forceinline__ T warp_sum(T x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1)
    x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

template <typename T>
__device__ __forceinline__ T warp_max(T x) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    const T y = __shfl_xor_sync(kFullMask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}

// -infinity in the accumulation type (overloaded on a dummy argument of that type).
__device__ __forceinline__ float neg_infinity(float) { return -__int_as_float(0x7f800000); }
__device__ __forceinline__ double neg_infinity(double) {
  return -__longlong_as_double(0x7ff0000000000000LL);
}

// ---- dynamic shared memory and thread block clusters (sm_90) ----
// (On the host, tests/emulator/emu.h defines the same functions.)
#if defined(__CUDACC__)
// This block's dynamic shared memory (the launch's bytes), as T.
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char capsroute_dynamic_shared[];
  return reinterpret_cast<T*>(capsroute_dynamic_shared);
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
// This block's rank in its cluster, a barrier of the whole cluster (ordering the blocks' shared
// memory writes before it with the reads after it), and block `rank`'s copy of a shared variable.
__device__ __forceinline__ unsigned cluster_block_rank() {
  return cooperative_groups::this_cluster().block_rank();
}
__device__ __forceinline__ void cluster_sync() { cooperative_groups::this_cluster().sync(); }
template <typename T>
__device__ __forceinline__ T* cluster_shared(T* local, unsigned rank) {
  return cooperative_groups::this_cluster().map_shared_rank(local, static_cast<int>(rank));
}
#endif
#endif

// Rows [begin, end) of one range when an element's rows are cut into contiguous ranges.
struct RowRange {
  int64_t begin, end;
};

// Rows of range g of `splits` over I rows (empty when g * ceil(I / splits) >= I).
__host__ __device__ __forceinline__ RowRange split_rows(int64_t I, int64_t splits, int64_t g) {
  const int64_t chunk = ceil_div<int64_t>(I, splits);
  const int64_t begin = g * chunk < I ? g * chunk : I;
  return {begin, begin + chunk < I ? begin + chunk : I};
}

// The (element b, range g) items of a row-range kernel, grid-stride over blocks, item =
// b * splits + g: f(b, item, rows) for each, then a barrier (the block moves on together).
template <typename F>
__device__ __forceinline__ void for_each_row_range(int64_t B, int64_t I, int64_t splits, F&& f) {
  for (int64_t item = blockIdx.x; item < B * splits; item += gridDim.x) {
    f(item / splits, item, split_rows(I, splits, item % splits));
    __syncthreads();
  }
}

// Blocks for a grid-stride loop over n items with kBlockThreads threads per block (n > 0).
inline unsigned int blocks_for(int64_t n) {
  return static_cast<unsigned int>(
      std::min<int64_t>(ceil_div<int64_t>(n, kBlockThreads), kMaxBlocks));
}

// Blocks for a grid-stride loop over n warp-sized items (one warp each).
inline unsigned int blocks_for_warps(int64_t n) {
  return static_cast<unsigned int>(
      std::min<int64_t>(ceil_div<int64_t>(n, kWarpsPerBlock), kMaxBlocks));
}

// Blocks for kernels with one block per batch element (looping when B exceeds the cap).
inline unsigned int blocks_for_items(int64_t B) {
  return static_cast<unsigned int>(std::min<int64_t>(B, kMaxBlocks));
}

}  // namespace cuda
}  // namespace capsroute
