// The extension module: loading it registers the operators (ops.cpp, cpu/, cuda/); the module
// itself reports how it was built, and holds each operator's argument checks (checks).
#include <torch/extension.h>

#include <optional>
#include <string>

#include "autograd.h"
#include "common/checks.h"
#include "common/kernel_path.h"
#include "cpu/output_cache.h"

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
  // The CPU output cache (cpu/output_cache.h).
  m.def("cpu_cache_stats", [] {
    const capsroute::cpu::OutputCacheStats s = capsroute::cpu::output_cache_stats();
    pybind11::dict stats;
    stats["limit_bytes"] = s.limit_bytes;
    stats["cached_bytes"] = s.cached_bytes;
    stats["cached_blocks"] = s.cached_blocks;
    stats["hits"] = s.hits;
    stats["misses"] = s.misses;
    return stats;
  });
  m.def("set_cpu_cache_limit", &capsroute::cpu::set_output_cache_limit);
  m.def("empty_cpu_cache", &capsroute::cpu::empty_output_cache);

  // vjp(op, inputs, options, grads, needs_grad) -> a gradient per input (None for none): the
  // gradient with a graph, for the operators' autograd (autograd.h).
  m.def("set_reference_vjp", [](pybind11::function vjp) {
    // Never freed: a Python object must not be released after the interpreter has stopped.
    auto* fn = new pybind11::function(std::move(vjp));
    capsroute::set_reference_vjp([fn](const std::string& op, const std::vector<at::Tensor>& inputs,
                                      const std::vector<c10::IValue>& options,
                                      const std::vector<at::Tensor>& grads,
                                      const std::vector<bool>& needs_grad) {
      pybind11::gil_scoped_acquire gil;
      pybind11::list py_options;
      for (const c10::IValue& option : options) {
        if (option.isBool())
          py_options.append(option.toBool());
        else if (option.isInt())
          py_options.append(option.toInt());
        else if (option.isDouble())
          py_options.append(option.toDouble());
        else if (option.isString())
          py_options.append(option.toStringRef());
        else
          TORCH_INTERNAL_ASSERT(false, "an option of ", op, " of type ", option.tagKind());
      }
      // A Python error reaches the caller as itself: the engine carries it across threads.
      auto result = (*fn)(op, inputs, py_options, grads, needs_grad)
                        .cast<std::vector<std::optional<at::Tensor>>>();
      std::vector<at::Tensor> vjps;
      for (auto& g : result) vjps.push_back(g.has_value() ? std::move(*g) : at::Tensor());
      return vjps;
    });
  });

  // checks.<op>(the schema op's arguments): what both backends check before they compute, for
  // the fakes (capsroute/_fake.py: meta and fake tensors refused as the kernels refuse them) and
  // for the Python functions where the reference computes (torch.func, forward mode).
  namespace cr = capsroute;
  using Tensor = at::Tensor;
  using OptionalTensor = std::optional<at::Tensor>;
  pybind11::module_ checks = m.def_submodule("checks");
  checks.def("squash", &cr::check_squash_inputs);
  checks.def("_squash_backward", &cr::check_squash_backward_inputs);
  checks.def("dynamic_routing",
             [](const Tensor& votes, const OptionalTensor& bias, int64_t iters, bool, bool,
                double eps) { cr::check_dynamic_routing_inputs(votes, bias, iters, eps); });
  checks.def("_dynamic_routing_backward", [](const Tensor& grad_v, const Tensor& votes,
                                             const Tensor& s_hist, bool, bool, double eps) {
    cr::check_dynamic_routing_backward_inputs(grad_v, votes, s_hist, eps);
  });
  checks.def("dense_capsules", [](const Tensor& u, const Tensor& weight, const OptionalTensor& bias,
                                  int64_t iters, bool, bool, double eps) {
    cr::check_dense_capsules_inputs(u, weight, bias, iters, eps);
  });
  checks.def("_dense_capsules_backward",
             [](const Tensor& grad_v, const Tensor& u, const Tensor& weight, const Tensor& s_hist,
                bool, bool, double eps) {
               cr::check_dense_capsules_backward_inputs(grad_v, u, weight, s_hist, eps);
             });
  checks.def("em_routing", &cr::check_em_routing_inputs);
  checks.def("_em_routing_backward", &cr::check_em_routing_backward_inputs);
  checks.def("em_routing_pose", &cr::check_em_routing_pose_inputs);
  checks.def("_em_routing_pose_backward", &cr::check_em_routing_pose_backward_inputs);
  checks.def("conv_em_routing", &cr::check_conv_em_routing_inputs);
  checks.def("_conv_em_routing_backward", &cr::check_conv_em_routing_backward_inputs);
  checks.def("conv_dynamic_routing",
             [](const Tensor& u, const Tensor& weight, const OptionalTensor& bias, int64_t iters,
                int64_t stride, int64_t padding, bool, bool, double eps) {
               cr::check_conv_dynamic_routing_inputs(u, weight, bias, iters, stride, padding, eps);
             });
  checks.def("_conv_dynamic_routing_backward",
             [](const Tensor& grad_v, const Tensor& u, const Tensor& weight, const Tensor& s_hist,
                int64_t stride, int64_t padding, bool, bool, double eps) {
               cr::check_conv_dynamic_routing_backward_inputs(grad_v, u, weight, s_hist, stride,
                                                              padding, eps);
             });
  checks.def("self_attention_routing", &cr::check_self_attention_routing_inputs);
  checks.def("_self_attention_routing_backward", &cr::check_self_attention_routing_backward_inputs);
  checks.def("inverted_attention_routing", &cr::check_inverted_attention_routing_inputs);
  checks.def("_inverted_attention_routing_backward",
             &cr::check_inverted_attention_routing_backward_inputs);
  checks.def("dense_self_attention_routing", &cr::check_dense_self_attention_routing_inputs);
  checks.def("_dense_self_attention_routing_backward",
             &cr::check_dense_self_attention_routing_backward_inputs);
  checks.def("dense_inverted_attention_routing",
             &cr::check_dense_inverted_attention_routing_inputs);
  checks.def("_dense_inverted_attention_routing_backward",
             &cr::check_dense_inverted_attention_routing_backward_inputs);
}
