// Runs CUDA kernels on the host, for tests on machines without a GPU: a thread per CUDA thread
// (from a pool kept between launches, EmuPool), all blocks of a launch at once, std::barrier for
// __syncthreads() and a barrier per warp for the shuffles; dynamic shared memory per block, and
// thread block clusters (a barrier of the cluster's threads, and each block's shared memory
// reachable by the others). Enough of CUDA for the device code of csrc/cuda (the agreement_*,
// em_* and conv_em_* kernels): __syncthreads, __syncwarp and __shfl_xor_sync with a full mask, and
// the bit casts of device_utils.cuh. Races between threads are real races here, so
// ThreadSanitizer sees missing barriers.
#pragma once

#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <semaphore>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __grid_constant__
#define __launch_bounds__(...)

struct EmuDim3 {
  unsigned x = 0, y = 1, z = 1;
};
inline thread_local EmuDim3 threadIdx, blockIdx, blockDim, gridDim;

struct EmuCluster;

// The barriers, the shuffle exchange and the dynamic shared memory of one block, and its cluster.
struct EmuBlock {
  std::barrier<> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<double> exchange;  // one slot per thread (every shuffled type fits a double)
  std::vector<double> shared;    // dynamic shared memory (doubles: aligned for every type), NaN
                                 // (garbage on a GPU: a read before a write shows)
  EmuCluster* cluster = nullptr;
  unsigned cluster_rank = 0;
  EmuBlock(unsigned threads, size_t shared_bytes)
      : block_barrier(threads),
        exchange(threads),
        shared((shared_bytes + sizeof(double) - 1) / sizeof(double),
               std::numeric_limits<double>::quiet_NaN()) {
    for (unsigned w = 0; w < threads / 32; ++w) warp_barriers.emplace_back(new std::barrier<>(32));
  }
};
inline thread_local EmuBlock* emu_block = nullptr;

// The blocks of one cluster and a barrier of all their threads.
struct EmuCluster {
  std::barrier<> barrier;
  std::vector<EmuBlock*> blocks;
  explicit EmuCluster(unsigned threads) : barrier(threads) {}
};

inline void __syncthreads() { emu_block->block_barrier.arrive_and_wait(); }

template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(emu_block->shared.data());
}
inline unsigned cluster_block_rank() { return emu_block->cluster_rank; }
inline void cluster_sync() { emu_block->cluster->barrier.arrive_and_wait(); }
template <typename T>
T* cluster_shared(T* local, unsigned rank) {
  const auto offset = reinterpret_cast<unsigned char*>(local) -
                      reinterpret_cast<unsigned char*>(emu_block->shared.data());
  return reinterpret_cast<T*>(
      reinterpret_cast<unsigned char*>(emu_block->cluster->blocks[rank]->shared.data()) + offset);
}

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "emulator: only full-mask __syncwarp is emulated\n");
    std::abort();
  }
  emu_block->warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T x, int lane_mask) {
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "emulator: only full-mask shuffles are emulated\n");
    std::abort();
  }
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  std::barrier<>& barrier = *emu_block->warp_barriers[warp];
  double* slots = emu_block->exchange.data() + warp * 32;
  slots[lane] = static_cast<double>(x);
  barrier.arrive_and_wait();
  const T y = static_cast<T>(slots[lane ^ lane_mask]);
  barrier.arrive_and_wait();  // nobody overwrites a slot before every lane has read
  return y;
}

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}
inline double __longlong_as_double(long long i) {
  double d;
  std::memcpy(&d, &i, sizeof d);
  return d;
}

// The threads that run the launches: one per CUDA thread of the largest launch so far, kept
// between launches because ThreadSanitizer slows with every thread a process has ever had. A
// launch wakes as many as it has CUDA threads and waits for them all to end, the stream order of a
// GPU: ThreadSanitizer sees the host's code and the launches ordered, and the threads of one
// launch ordered by nothing but the kernel's barriers.
class EmuPool {
 public:
  // job(0), ..., job(threads - 1), each on a thread of its own; returns when all have returned.
  void run(unsigned threads, std::function<void(unsigned)> job) {
    while (workers_.size() < threads) {
      starts_.emplace_back(new std::binary_semaphore(0));
      workers_.emplace_back([this, i = unsigned(workers_.size()), start = starts_.back().get()] {
        for (;;) {
          start->acquire();
          if (!job_) return;
          job_(i);
          ends_.release();
        }
      });
    }
    job_ = std::move(job);
    for (unsigned i = 0; i < threads; ++i) starts_[i]->release();
    for (unsigned i = 0; i < threads; ++i) ends_.acquire();
  }
  ~EmuPool() {  // at exit: wakes the threads without a job, which makes them return
    job_ = nullptr;
    for (const auto& start : starts_) start->release();
    for (std::thread& worker : workers_) worker.join();
  }

 private:
  std::function<void(unsigned)> job_;
  std::vector<std::unique_ptr<std::binary_semaphore>> starts_;  // one per thread
  std::counting_semaphore<> ends_{0};                           // one release per job
  std::vector<std::thread> workers_;
};
inline EmuPool emu_pool;

// kernel<<<grid, block, shared_bytes>>>(args...) in clusters of cluster_blocks blocks: every
// thread of every block at once; returns when all end.
template <typename Kernel, typename... Args>
void emu_launch_clusters(unsigned grid, unsigned block, unsigned cluster_blocks,
                         size_t shared_bytes, Kernel kernel, Args... args) {
  if (grid == 0 || block % 32 != 0 || grid % cluster_blocks != 0) {
    std::fprintf(stderr, "emulator: bad launch <<<%u, %u>>> in clusters of %u\n", grid, block,
                 cluster_blocks);
    std::abort();
  }
  std::vector<std::unique_ptr<EmuBlock>> blocks;
  std::vector<std::unique_ptr<EmuCluster>> clusters;
  for (unsigned g = 0; g < grid; ++g) {
    blocks.emplace_back(new EmuBlock(block, shared_bytes));
    if (g % cluster_blocks == 0) clusters.emplace_back(new EmuCluster(block * cluster_blocks));
    blocks[g]->cluster = clusters.back().get();
    blocks[g]->cluster_rank = g % cluster_blocks;
    clusters.back()->blocks.push_back(blocks[g].get());
  }
  emu_pool.run(grid * block, [&](unsigned i) {
    threadIdx.x = i % block;
    blockIdx.x = i / block;
    blockDim.x = block;
    gridDim.x = grid;
    emu_block = blocks[i / block].get();
    kernel(args...);
  });
}

// kernel<<<grid, block>>>(args...).
template <typename Kernel, typename... Args>
void emu_launch(unsigned grid, unsigned block, Kernel kernel, Args... args) {
  emu_launch_clusters(grid, block, 1, 0, kernel, args...);
}

// The `launch` of the launch sequences (csrc/cuda/agreement_sequence.cuh, em_sequence.cuh) on the
// host: the kernel on at most max_blocks blocks (fewer than the sequence asks for exercises the
// kernels' grid-stride loops) of `threads` threads.
struct EmuLaunch {
  unsigned max_blocks, threads;
  template <typename Kernel, typename... Args>
  void operator()(Kernel kernel, unsigned blocks, const Args&... args) const {
    emu_launch(blocks < max_blocks ? blocks : max_blocks, threads, kernel, args...);
  }
  // At most max_blocks clusters.
  template <typename Kernel, typename... Args>
  void cluster(Kernel kernel, unsigned clusters, int cluster_blocks, int64_t shared_bytes,
               const Args&... args) const {
    emu_launch_clusters((clusters < max_blocks ? clusters : max_blocks) * cluster_blocks, threads,
                        cluster_blocks, shared_bytes, kernel, args...);
  }
};
