// The environment switches of the CUDA kernels, read at every call (the tests flip them), plain
// C++ so that the extension module can report them (capsroute.cuda_kernel_set()).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace capsroute {
namespace cuda {

// A count forced through the environment variable `name` (an integer >= 1), or nullopt if unset.
inline std::optional<int64_t> forced_count(const char* name) {
  const char* forced = std::getenv(name);
  if (forced == nullptr) return std::nullopt;
  char* end = nullptr;
  const long long n = std::strtoll(forced, &end, 10);
  TORCH_CHECK(end != forced && *end == '\0' && n >= 1, "capsroute: ", name,
              " must be an integer >= 1, got '", forced, "'");
  return n;
}

// CAPSROUTE_CUDA_KERNELS picks the kernel set (docs/kernels.md, "CUDA, measured": v2 was as fast or
// faster on every shape the H100 ran; v1 stays only until its deletion):
//   v1: the first kernels; dense_capsules recomputes every vote from the weight in every pass and
//       never stores one.
//   v2 (default): the roofline redesign, so far: dense_capsules'
//       votes of a chunk of the batch as one batched GEMM into an L2-sized workspace, the routing
//       kernels over those stored votes and the backward's contractions as batched GEMMs; the
//       routing rows of votes read from memory a warp per part of each element, a capsule per
//       lane, every row's votes read once per pass into registers (routing_warp_kernels.cuh, where
//       the capsules fit), and on sm_90 the forward an element per cluster with its votes in shared
//       memory and the backward an element per cluster of 16 with votes, couplings and G there, the
//       vote gradient written from shared memory (routing_cluster_kernels.cuh); elsewhere the
//       vote gradient (dynamic_routing, dense_capsules v2) written a tile of rows per block; and
//       EM routing's rows cut into ranges of a block each (em_launch.cuh, em_splits).
enum class KernelSet { v1, v2 };

inline KernelSet cuda_kernel_set() {
  const char* name = std::getenv("CAPSROUTE_CUDA_KERNELS");
  if (name == nullptr || std::strcmp(name, "v2") == 0) return KernelSet::v2;
  TORCH_CHECK(std::strcmp(name, "v1") == 0,
              "capsroute: CAPSROUTE_CUDA_KERNELS must be v1 or v2, got '", name, "'");
  return KernelSet::v1;
}

// CAPSROUTE_ROUTING_CLUSTER=0 keeps v2's routing forward and backward (dynamic_routing,
// dense_capsules) on the warp-rows kernels where they would run an element per cluster (sm_90;
// routing_cluster_kernels.cuh, use_clusters); 1 (default) lets use_clusters decide; force runs the
// clusters wherever the warp rows would run, whatever the batch, and is an error where the GPU
// or the build cannot (the tests use it to know which kernels ran).
enum class ClusterMode { off, automatic, force };

inline ClusterMode routing_cluster_mode() {
  const char* value = std::getenv("CAPSROUTE_ROUTING_CLUSTER");
  if (value == nullptr || std::strcmp(value, "1") == 0) return ClusterMode::automatic;
  if (std::strcmp(value, "force") == 0) return ClusterMode::force;
  TORCH_CHECK(std::strcmp(value, "0") == 0,
              "capsroute: CAPSROUTE_ROUTING_CLUSTER must be 0, 1 or force, got '", value, "'");
  return ClusterMode::off;
}

inline const char* kernel_set_name(KernelSet set) { return set == KernelSet::v1 ? "v1" : "v2"; }

}  // namespace cuda
}  // namespace capsroute
