// The kernel path each op's last call ran, its forward and backward apart: "cpu" on the CPU; on
// CUDA the path that the dispatch decided on at run time, silent fallbacks included (a cluster
// path declined in automatic mode records the warp rows). capsroute.last_kernel_path() reads it,
// so the doctor, the tests and the benchmark know which kernels ran, not only which switch was
// set. One record per process, not per thread: the autograd engine runs CUDA backwards on a
// thread of its own, and the caller reads the record from another.
#pragma once

#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace capsroute {

enum class Direction { forward, backward };

inline const char* direction_name(Direction direction) {
  return direction == Direction::forward ? "forward" : "backward";
}

class KernelPathRecord {
 public:
  static KernelPathRecord& instance() {
    static KernelPathRecord record;
    return record;
  }
  void set(const std::string& op, Direction direction, std::string path) {
    const std::lock_guard<std::mutex> lock(mutex_);
    paths_[{op, direction_name(direction)}] = std::move(path);
  }
  // The path of op's last call in that direction ("forward" or "backward"); "" if none since
  // the last clear().
  std::string get(const std::string& op, const std::string& direction) {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto found = paths_.find({op, direction});
    return found == paths_.end() ? std::string() : found->second;
  }
  void clear() {
    const std::lock_guard<std::mutex> lock(mutex_);
    paths_.clear();
  }

 private:
  std::mutex mutex_;
  std::map<std::pair<std::string, std::string>, std::string> paths_;
};

inline void record_kernel_path(const char* op, Direction direction, std::string path) {
  KernelPathRecord::instance().set(op, direction, std::move(path));
}

// paths with `path` appended unless already there, comma-separated: an op that runs the batch in
// chunks records every path its chunks took, in the order they first ran.
inline void add_distinct_path(std::string& paths, const std::string& path) {
  if (paths.empty()) {
    paths = path;
    return;
  }
  if (("," + paths + ",").find("," + path + ",") == std::string::npos) paths += "," + path;
}

}  // namespace capsroute
