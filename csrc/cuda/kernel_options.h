// The environment switches of the CUDA kernels, read at every call (the tests flip them).
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

#include "../common/forced_count.h"

namespace capsroute {
namespace cuda {

// CAPSROUTE_ROUTING_CLUSTER=0 keeps the routing forward and backward (dynamic_routing,
// dense_capsules) on the warp-rows kernels where they would run an element per cluster (sm_90;
// agreement_cluster_kernels.cuh, use_clusters); 1 (default) lets use_clusters decide; force runs
// the clusters wherever the warp rows would run, whatever the batch, and is an error where the GPU
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

// CAPSROUTE_EM_LANES: how the EM rows kernels' warps cover a row (em_kernels.cuh, EmLanes).
// auto (default) a lane per (j, h) entry where H divides the warp size, else a lane per capsule;
// capsule a lane per capsule for every H; column the entries' lanes, an error where H does not
// fit (em_launch.cuh, em_lanes).
enum class EmLanesMode { automatic, capsule, column };

inline EmLanesMode em_lanes_mode() {
  const char* value = std::getenv("CAPSROUTE_EM_LANES");
  if (value == nullptr || std::strcmp(value, "auto") == 0) return EmLanesMode::automatic;
  if (std::strcmp(value, "capsule") == 0) return EmLanesMode::capsule;
  TORCH_CHECK(std::strcmp(value, "column") == 0,
              "capsroute: CAPSROUTE_EM_LANES must be auto, capsule or column, got '", value, "'");
  return EmLanesMode::column;
}

}  // namespace cuda
}  // namespace capsroute
