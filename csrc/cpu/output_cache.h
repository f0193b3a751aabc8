// The CPU ops' large outputs (the vote gradient above all) come from blocks kept between calls.
// glibc's malloc maps a block of that size afresh on every call in some processes (or trims it back
// to the kernel), and faulting its pages in again can cost as much as the routing itself
// (docs/kernels.md, "CPU"). A block freed by its tensor is kept for the next output of about its
// size while the blocks kept total at most the limit; capsroute.set_cpu_cache_limit sets it (0:
// none kept), capsroute.empty_cpu_cache frees them. Allocations are reported to torch's profiler as
// torch's CPU allocator reports them.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace capsroute {
namespace cpu {

// at::empty and at::empty_strided for outputs: from the cache at 1 MiB and more.
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor empty_output_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                const at::TensorOptions& options);
at::Tensor empty_output_like(const at::Tensor& t);  // in the layout at::empty_like gives

struct OutputCacheStats {
  int64_t limit_bytes, cached_bytes, cached_blocks, hits, misses;
};
OutputCacheStats output_cache_stats();
void set_output_cache_limit(int64_t bytes);  // frees kept blocks beyond the new limit
void empty_output_cache();

}  // namespace cpu
}  // namespace capsroute
