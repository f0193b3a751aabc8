// The extension module: loading it registers the operators (ops.cpp, cpu/, cuda/); the module
// itself only reports how it was built.
#include <pybind11/pybind11.h>

#include <string>

#include "common/kernel_path.h"

#ifndef CAPSROUTE_TORCH_VERSION
#define CAPSROUTE_TORCH_VERSION "unknown"
#endif
#ifndef CAPSROUTE_CUDA_VERSION
#define CAPSROUTE_CUDA_VERSION ""
#endif
#ifndef CAPSROUTE_CUDA_ARCHS
#define CAPSROUTE_CUDA_ARCHS ""
#endif
#ifndef CAPSROUTE_CPU_ARCH
#define CAPSROUTE_CPU_ARCH "unknown"
#endif

PYBIND11_MODULE(_C, m) {
  m.def("build_info", [] {
    pybind11::dict info;
#ifdef CAPSROUTE_WITH_CUDA
    info["cuda"] = true;
#else
    info["cuda"] = false;
#endif
    info["torch"] = CAPSROUTE_TORCH_VERSION;
    info["cuda_version"] = CAPSROUTE_CUDA_VERSION;
    info["cuda_archs"] = CAPSROUTE_CUDA_ARCHS;
    info["cpu_arch"] = CAPSROUTE_CPU_ARCH;  // -march of the C++ sources (setup.py)
    return info;
  });
  // The kernel path of an op's last call in a direction ("" if none since the last clear).
  m.def("last_kernel_path", [](const std::string& op, const std::string& direction) {
    return capsroute::KernelPathRecord::instance().get(op, direction);
  });
  m.def("clear_kernel_paths", [] { capsroute::KernelPathRecord::instance().clear(); });
}
