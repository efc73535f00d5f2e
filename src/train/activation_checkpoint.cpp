// Note [Reentrant checkpointing]
// LibTorch has no public saved-tensor hooks in C++, so checkpointing uses the reentrant
// form: a custom autograd Function whose forward runs the region without grad (nothing
// inside is saved) and whose backward reruns it with grad and calls backward on the
// recomputed outputs. The region's parameters get their gradients from that inner
// backward, through their usual accumulators, so sharded units see the same
// post-accumulate hooks as without checkpointing.
#include <fsdp/activation_checkpoint.h>

#include "trace/trace.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>

namespace fsdp {
namespace {

std::atomic<int64_t> recomputes{0};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FnCapsule : torch::CustomClassHolder {
  FnCapsule(CheckpointFn f, std::string name) : fn(std::move(f)), region(std::move(name)) {}
  CheckpointFn fn;
  std::string region;  ///< for the recompute span (Note [Per-unit trace]); may be ""
};

/// RNG states of the devices a region uses: the CPU generator, and the CUDA generator
/// of the first CUDA input's device.
struct RngState {
  at::Tensor cpu;
  c10::optional<c10::Device> cuda_device;
  at::Tensor cuda;

  static RngState capture(const variable_list& inputs) {
    RngState s;
    s.cpu = at::detail::getDefaultCPUGenerator().get_state();
    for (const auto& t : inputs) {
      if (t.defined() && t.is_cuda()) {
        s.cuda_device = t.device();
        s.cuda = at::globalContext().defaultGenerator(t.device()).get_state();
        break;
      }
    }
    return s;
  }
  void restore() const {
    at::Generator g = at::detail::getDefaultCPUGenerator();
    g.set_state(cpu);
    if (cuda_device) {
      at::Generator c = at::globalContext().defaultGenerator(*cuda_device);
      c.set_state(cuda);
    }
  }
};

struct RngCapsule : torch::CustomClassHolder {
  RngState state;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // `anchor` is an empty tensor that requires grad: autograd connects a custom
  // Function's outputs to the graph only if some input requires grad, and a region's
  // parameters are not inputs (PyTorch's reentrant checkpoint has the same need).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<FnCapsule> fn,
                               at::Tensor anchor, at::TensorList input_list) {
    (void)anchor;
    variable_list inputs = input_list.vec();
    auto rng = c10::make_intrusive<RngCapsule>();
    rng->state = RngState::capture(inputs);
    ctx->saved_data["fn"] = c10::IValue::make_capsule(fn);
    ctx->saved_data["rng"] = c10::IValue::make_capsule(rng);
    ctx->save_for_backward(inputs);
    variable_list outputs;
    {
      at::NoGradGuard no_grad;
      outputs = fn->fn(inputs);
    }
    for (auto& o : outputs) {
      // An output that is an input as-is would alias it; autograd needs a new tensor.
      for (const auto& i : inputs) {
        if (o.defined() && i.defined() && o.is_same(i)) o = o.clone();
      }
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "checkpoint: double backward (create_graph=true) through a checkpointed region is "
                "not supported, because its graph is rebuilt inside backward. Run that region "
                "without fsdp::checkpoint, or take the gradient without create_graph.");
    auto fn = c10::static_intrusive_pointer_cast<FnCapsule>(ctx->saved_data["fn"].toCapsule());
    auto rng = c10::static_intrusive_pointer_cast<RngCapsule>(ctx->saved_data["rng"].toCapsule());
    auto saved = ctx->get_saved_variables();
    variable_list inputs;
    for (const auto& t : saved) {
      if (!t.defined()) {
        inputs.push_back(t);
        continue;
      }
      auto d = t.detach();
      d.set_requires_grad(t.requires_grad());
      inputs.push_back(d);
    }
    // Recompute under the forward's RNG state, then put the current state back.
    recomputes.fetch_add(1, std::memory_order_relaxed);
    RngState now = RngState::capture(inputs);
    rng->state.restore();
    variable_list outputs;
    {
      detail::trace::Scope span("recompute", [&]() {
        return "recompute " + (fn->region.empty() ? std::string("(region)") : fn->region);
      });
      at::AutoGradMode grad(true);
      outputs = fn->fn(inputs);
    }
    now.restore();
    variable_list roots, grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    variable_list result{at::Tensor(), at::Tensor()};  // the callable, the anchor
    for (const auto& i : inputs)
      result.push_back(i.defined() && i.requires_grad() ? i.grad() : at::Tensor());
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint(const CheckpointFn& fn,
                                      const std::vector<torch::Tensor>& inputs) {
  TORCH_CHECK(fn != nullptr, "checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);  // nothing would be saved anyway
  auto anchor = at::empty({0});
  anchor.set_requires_grad(true);
  // As a TensorList, so that autograd sees every input as a variable.
  return CheckpointFunction::apply(
      c10::make_intrusive<FnCapsule>(fn, detail::trace::RegionName::current()), anchor,
      at::TensorList(inputs));
}

int64_t activation_recomputes() { return recomputes.load(std::memory_order_relaxed); }

torch::Tensor checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                         const torch::Tensor& input) {
  TORCH_CHECK(fn != nullptr, "checkpoint: the function is empty");
  return checkpoint(
      [fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
      std::vector<torch::Tensor>{input})[0];
}

}  // namespace fsdp
