// The operators' autograd, in C++ (autograd.cpp): attached to each op where ops.cpp defines it.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/library.h>

#include <functional>
#include <string>
#include <vector>

namespace capsroute {

// The Autograd kernel of operator `op`, whose backward operator is `_<op>_backward`.
torch::CppFunction autograd_kernel(const char* op);

// The gradient of op's inputs as a graph (create_graph=True): given the op's name, its inputs
// (undefined for None), its options, the gradients of its differentiable outputs (undefined for
// none) and which inputs need one; returns a gradient per input (undefined for none). Set by
// capsroute/ops/_autograd.py, which differentiates the plain-PyTorch reference.
using ReferenceVjp = std::function<std::vector<at::Tensor>(
    const std::string& op, const std::vector<at::Tensor>& inputs,
    const std::vector<c10::IValue>& options, const std::vector<at::Tensor>& grads,
    const std::vector<bool>& needs_grad)>;
void set_reference_vjp(ReferenceVjp vjp);

}  // namespace capsroute
