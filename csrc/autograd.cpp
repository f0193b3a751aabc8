// Every operator's autograd (docs/ops.md, "Derivatives"), read from its two schemas: the forward
// runs the op below autograd; the backward runs `_<op>_backward` or, when the engine builds a
// graph of the gradient (grad mode is on in a backward only with create_graph=True), the
// reference's autograd through set_reference_vjp's callback, so that every higher derivative is
// exact. In C++ because a Python autograd costs more host time than a small call's kernels.
//
// What the schemas say: an op's leading Tensor arguments are its inputs and the rest its options;
// an op returning several outputs returns its saved state last. `_<op>_backward` takes a grad_*
// per differentiable output first, then by name the op's inputs and options it needs and the
// state (its one other argument), and returns a gradient per input, in order.
#include "autograd.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include <deque>
#include <mutex>

namespace capsroute {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

ReferenceVjp& reference_vjp() {
  static ReferenceVjp vjp;
  return vjp;
}

bool is_tensor(const c10::Argument& arg) {
  return arg.type()->isSubtypeOf(*c10::OptionalType::ofTensor());
}

// How an op's autograd calls its operators, from their schemas (on the first call: the schemas
// may be defined after the kernel is made).
struct OpAutograd {
  enum class Source { kGrad, kInput, kOption, kState };
  struct BackwardArg {
    Source source;
    size_t index;  // among the grads, inputs or options
  };

  explicit OpAutograd(std::string name) : name(std::move(name)) {}

  void resolve() {
    std::call_once(resolved, [this] {
      auto& dispatcher = c10::Dispatcher::singleton();
      forward = dispatcher.findSchemaOrThrow(("capsroute::" + name).c_str(), "");
      backward = dispatcher.findSchemaOrThrow(("capsroute::_" + name + "_backward").c_str(), "");
      const auto& args = forward->schema().arguments();
      num_outputs = forward->schema().returns().size();
      num_inputs = 0;
      while (num_inputs < args.size() && is_tensor(args[num_inputs])) ++num_inputs;
      num_options = args.size() - num_inputs;
      TORCH_INTERNAL_ASSERT(backward->schema().returns().size() == num_inputs, "_", name,
                            "_backward must return a gradient per input");
      auto index_of = [&](const std::string& arg_name) {
        for (size_t i = 0; i < args.size(); ++i)
          if (args[i].name() == arg_name) return i;
        return args.size();
      };
      for (const c10::Argument& arg : backward->schema().arguments()) {
        const size_t i = index_of(arg.name());
        if (i < num_inputs)
          backward_args.push_back({Source::kInput, i});
        else if (i < args.size())
          backward_args.push_back({Source::kOption, i - num_inputs});
        else if (arg.name().rfind("grad_", 0) == 0)
          backward_args.push_back({Source::kGrad, num_differentiable++});
        else
          backward_args.push_back({Source::kState, 0});
      }
    });
  }

  std::string name;
  std::once_flag resolved;
  std::optional<c10::OperatorHandle> forward, backward;
  size_t num_inputs = 0, num_options = 0, num_outputs = 0, num_differentiable = 0;
  std::vector<BackwardArg> backward_args;
};

// Made while ops.cpp defines the operators (at load, one thread); read-only afterwards.
std::deque<OpAutograd>& registry() {
  static std::deque<OpAutograd> ops;
  return ops;
}

c10::IValue optional_tensor(const at::Tensor& t) {
  return t.defined() ? c10::IValue(t) : c10::IValue();
}

struct RoutingFunction : torch::autograd::Function<RoutingFunction> {
  // given: the op's inputs that are not None, at input positions `slots`; below: the dispatch keys
  // after autograd's. The arguments after `given` get no gradient.
  static variable_list forward(AutogradContext* ctx, at::TensorList given, int64_t op_index,
                               const std::vector<int64_t>& slots,
                               const std::vector<c10::IValue>& options, c10::DispatchKeySet below) {
    const OpAutograd& op = registry()[op_index];
    torch::jit::Stack stack(op.num_inputs);  // None where no input is given
    for (size_t k = 0; k < given.size(); ++k) stack[slots[k]] = given[k];
    stack.insert(stack.end(), options.begin(), options.end());
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.forward->redispatchBoxed(below, &stack);
    }
    variable_list outputs;
    for (c10::IValue& out : stack) outputs.push_back(std::move(out).toTensor());

    ctx->saved_data["op"] = op_index;
    ctx->saved_data["slots"] = slots;
    ctx->saved_data["options"] = c10::ivalue::Tuple::create(options);
    variable_list saved(given.begin(), given.end());
    saved.push_back(op.num_outputs > 1 ? outputs.back() : at::Tensor());
    ctx->save_for_backward(saved);
    if (op.num_outputs > 1) {
      // The couplings and the state get no gradient (the kernel hands them on detached), and an
      // output given none gets no zeros here: the backward makes those it needs, which only an
      // op with two differentiable outputs or more can miss.
      ctx->set_materialize_grads(false);
      if (op.num_differentiable > 1)
        for (size_t k = 0; k < op.num_differentiable; ++k)
          ctx->saved_data["sizes" + std::to_string(k)] = outputs[k].sym_sizes();
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const OpAutograd& op = registry()[ctx->saved_data["op"].toInt()];
    const std::vector<int64_t> slots = ctx->saved_data["slots"].toIntVector();
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& state = saved.back();
    std::vector<at::Tensor> inputs(op.num_inputs);  // undefined for None
    for (size_t k = 0; k < slots.size(); ++k) inputs[slots[k]] = saved[k];
    grads.resize(op.num_differentiable);
    variable_list result(slots.size() + 4);  // + op_index, slots, options, below: no gradient
    const at::Tensor* some_grad = nullptr;
    for (const at::Tensor& g : grads)
      if (g.defined() && some_grad == nullptr) some_grad = &g;
    if (some_grad == nullptr) return result;
    const auto& option_tuple = ctx->saved_data["options"].toTupleRef().elements();
    const std::vector<c10::IValue> options(option_tuple.begin(), option_tuple.end());

    if (at::GradMode::is_enabled()) {
      std::vector<bool> needs_grad(op.num_inputs, false);
      for (size_t k = 0; k < slots.size(); ++k) needs_grad[slots[k]] = ctx->needs_input_grad(k);
      TORCH_CHECK(reference_vjp(), "capsroute: no reference for a gradient with a graph of ",
                  op.name, " (import capsroute.ops)");
      const std::vector<at::Tensor> vjp =
          reference_vjp()(op.name, inputs, options, grads, needs_grad);
      for (size_t k = 0; k < slots.size(); ++k) result[k] = vjp[slots[k]];
      return result;
    }

    // The backward operators want every grad: zeros for an output that got none.
    for (size_t k = 0; k < grads.size(); ++k)
      if (!grads[k].defined())
        grads[k] = at::zeros_symint(ctx->saved_data["sizes" + std::to_string(k)].toSymIntVector(),
                                    some_grad->options());
    torch::jit::Stack stack;
    for (const OpAutograd::BackwardArg& arg : op.backward_args) {
      switch (arg.source) {
        case OpAutograd::Source::kGrad:
          stack.emplace_back(grads[arg.index]);
          break;
        case OpAutograd::Source::kInput:
          stack.push_back(optional_tensor(inputs[arg.index]));
          break;
        case OpAutograd::Source::kOption:
          stack.push_back(options[arg.index]);
          break;
        case OpAutograd::Source::kState:
          stack.emplace_back(state);
      }
    }
    op.backward->callBoxed(&stack);
    for (size_t k = 0; k < slots.size(); ++k)
      if (ctx->needs_input_grad(k)) result[k] = stack[slots[k]].toTensor();
    return result;
  }
};

class AutogradKernel final : public c10::OperatorKernel {
 public:
  explicit AutogradKernel(int64_t op_index) : op_index_(op_index) {}

  void operator()(const c10::OperatorHandle&, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = keys & c10::after_ADInplaceOrView_keyset;
    OpAutograd& op = registry()[op_index_];
    op.resolve();
    const size_t first = stack->size() - op.num_inputs - op.num_options;
    std::vector<at::Tensor> given;
    std::vector<int64_t> slots;
    bool requires_grad = false;
    for (size_t i = 0; i < op.num_inputs; ++i) {
      const c10::IValue& t = (*stack)[first + i];
      if (t.isNone()) continue;
      given.push_back(t.toTensor());
      slots.push_back(static_cast<int64_t>(i));
      requires_grad |= given.back().requires_grad();
    }
    if (!requires_grad || !at::GradMode::is_enabled()) {
      at::AutoDispatchBelowADInplaceOrView guard;
      op.forward->redispatchBoxed(below, stack);
      return;
    }
    const std::vector<c10::IValue> options(stack->begin() + first + op.num_inputs, stack->end());
    variable_list outputs =
        RoutingFunction::apply(at::TensorList(given), op_index_, slots, options, below);
    // Detached rather than marked non-differentiable, which compiled autograd refuses.
    for (size_t k = op.num_differentiable; k < outputs.size(); ++k)
      outputs[k] = outputs[k].detach();
    stack->resize(first);
    for (at::Tensor& out : outputs) stack->emplace_back(std::move(out));
  }

 private:
  int64_t op_index_;
};

}  // namespace

torch::CppFunction autograd_kernel(const char* op) {
  registry().emplace_back(op);
  return torch::CppFunction::makeFromBoxedFunctor(
      std::make_unique<AutogradKernel>(static_cast<int64_t>(registry().size() - 1)));
}

void set_reference_vjp(ReferenceVjp vjp) { reference_vjp() = std::move(vjp); }

}  // namespace capsroute
