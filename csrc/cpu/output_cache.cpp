// The output cache (output_cache.h): a c10::Allocator whose blocks go back to a size-ordered free
// list when their tensors free them, and to the system only beyond the limit.
#include "output_cache.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace capsroute {
namespace cpu {
namespace {

constexpr size_t kMinBytes = size_t{1} << 20;  // below: glibc's heap serves them without faults
constexpr size_t kPageBytes = 4096;
constexpr int64_t kDefaultLimitBytes = int64_t{1} << 30;

class OutputCache final : public c10::Allocator {
 public:
  // Never destroyed: a tensor may free its block after static destructors have run.
  static OutputCache& instance() {
    static OutputCache* cache = new OutputCache();
    return *cache;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    const size_t wanted = (std::max<size_t>(nbytes, 1) + kPageBytes - 1) / kPageBytes * kPageBytes;
    auto [ptr, size] = take(wanted);
    if (ptr == nullptr) {
      ptr = c10::alloc_cpu(wanted);
      size = wanted;
    }
    size_t in_use = 0, cached = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      in_use_.emplace(ptr, size);
      in_use = in_use_bytes_ += size;
      cached = cached_bytes_;
    }
    report(ptr, static_cast<int64_t>(size), in_use, cached);
    return {ptr, ptr, &release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }

  OutputCacheStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {limit_bytes_, static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(free_.size()),
            hits_, misses_};
  }

  void set_limit(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_bytes_ = bytes;
    trim_to(static_cast<size_t>(bytes));
  }

  void empty() {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_to(0);
  }

 private:
  OutputCache() = default;

  static void release(void* ptr) { instance().give_back(ptr); }

  // A kept block of wanted bytes up to an eighth more (the smallest), or {nullptr, 0}.
  std::pair<void*, size_t> take(size_t wanted) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = free_.lower_bound(wanted);
    if (it == free_.end() || it->first > wanted + wanted / 8) {
      ++misses_;
      return {nullptr, 0};
    }
    ++hits_;
    const std::pair<void*, size_t> block{it->second, it->first};
    cached_bytes_ -= it->first;
    free_.erase(it);
    return block;
  }

  void give_back(void* ptr) {
    size_t size = 0, in_use = 0, cached = 0;
    bool keep = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = in_use_.find(ptr);
      size = it->second;
      in_use_.erase(it);
      in_use = in_use_bytes_ -= size;
      keep = static_cast<int64_t>(cached_bytes_ + size) <= limit_bytes_;
      if (keep) {
        free_.emplace(size, ptr);
        cached_bytes_ += size;
      }
      cached = cached_bytes_;
    }
    report(ptr, -static_cast<int64_t>(size), in_use, cached);
    if (!keep) c10::free_cpu(ptr);
  }

  // Frees the largest kept blocks until at most bytes are kept; the caller holds mutex_.
  void trim_to(size_t bytes) {
    while (cached_bytes_ > bytes) {
      const auto largest = std::prev(free_.end());
      cached_bytes_ -= largest->first;
      c10::free_cpu(largest->second);
      free_.erase(largest);
    }
  }

  // As torch's CPU allocator reports, so that torch.profiler's memory view counts these tensors.
  static void report(void* ptr, int64_t bytes, size_t in_use, size_t cached) {
    if (c10::memoryProfilingEnabled())
      c10::reportMemoryUsageToProfiler(ptr, bytes, in_use, in_use + cached,
                                       c10::Device(c10::DeviceType::CPU));
  }

  std::mutex mutex_;
  std::multimap<size_t, void*> free_;         // kept blocks by size
  std::unordered_map<void*, size_t> in_use_;  // blocks held by tensors, and their sizes
  size_t in_use_bytes_ = 0, cached_bytes_ = 0;
  int64_t limit_bytes_ = kDefaultLimitBytes;
  int64_t hits_ = 0, misses_ = 0;
};

c10::DispatchKeySet cpu_keys() { return c10::DispatchKeySet(c10::DispatchKey::CPU); }

bool cached(at::IntArrayRef sizes, at::IntArrayRef strides, const at::TensorOptions& options) {
  const size_t nbytes =
      at::detail::computeStorageNbytes(sizes, strides, options.dtype().itemsize());
  return nbytes >= kMinBytes;
}

}  // namespace

at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return empty_output_strided(sizes, c10::contiguous_strides(sizes), options);
}

at::Tensor empty_output_strided(at::IntArrayRef sizes, at::IntArrayRef strides,
                                const at::TensorOptions& options) {
  TORCH_INTERNAL_ASSERT(options.device().is_cpu());
  if (!cached(sizes, strides, options)) return at::empty_strided(sizes, strides, options);
  return at::detail::empty_strided_generic(sizes, strides, &OutputCache::instance(), cpu_keys(),
                                           options.dtype().toScalarType());
}

at::Tensor empty_output_like(const at::Tensor& t) {
  const at::Tensor layout = at::empty_like(t, t.options().device(at::kMeta));  // no memory
  return empty_output_strided(layout.sizes(), layout.strides(), t.options());
}

OutputCacheStats output_cache_stats() { return OutputCache::instance().stats(); }
void set_output_cache_limit(int64_t bytes) { OutputCache::instance().set_limit(bytes); }
void empty_output_cache() { OutputCache::instance().empty(); }

}  // namespace cpu
}  // namespace capsroute
