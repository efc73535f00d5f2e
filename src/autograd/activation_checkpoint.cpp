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
#include <mutex>

namespace fsdp {
namespace {

std::atomic<int64_t> recomputes{0};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct FnCapsule : torch::CustomClassHolder {
  FnCapsule(ActivationCheckpointFn f, std::string name, ActivationCheckpointOptions o)
      : fn(std::move(f)), region(std::move(name)), options(o) {}
  ActivationCheckpointFn fn;
  std::string region;  ///< for the recompute span (Note [Per-unit trace]); may be ""
  ActivationCheckpointOptions options;
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

// Note [Activation offload]
// With ActivationCheckpointOptions::offload_inputs a region saves host copies of its inputs instead
// of the inputs (pinned and non-blocking from a GPU), so the device copies go once the
// forward moves on. Regions that offload in one forward form a chain, newest last; when a
// region's backward starts it takes its inputs back (already copied if the region after
// it prefetched them) and issues the copy of the region before it, whose backward comes
// next, so that copy runs while this region recomputes. The host bytes are counted from
// forward until the graph holding them is freed (a retained graph can run backward again).
struct Offloaded : torch::CustomClassHolder {
  std::vector<at::Tensor> host;  ///< host copies (undefined for undefined inputs)
  std::vector<bool> requires_grad;
  std::vector<c10::Device> device;
  std::vector<at::Tensor> back;  ///< device copies issued ahead (prefetch), taken once
  /// The region offloaded before it (weak: typed as the base, Offloaded being incomplete).
  c10::weak_intrusive_ptr<torch::CustomClassHolder> previous{
      c10::intrusive_ptr<torch::CustomClassHolder>()};
  int64_t bytes = 0;
  stats::MemoryCounter* counter = nullptr;
  std::mutex mu;

  // When the last strong reference goes (the graph is freed): weak references (the
  // chain) may keep the object itself a while longer, not its host copies.
  void release_resources() override {
    host.clear();
    back.clear();
    if (counter != nullptr) counter->current -= bytes;
    counter = nullptr;
  }
  // Issues the copies back to the inputs' devices (no-op when already issued).
  void bring_back() {
    std::lock_guard<std::mutex> lock(mu);
    if (!back.empty()) return;
    for (size_t i = 0; i < host.size(); ++i) {
      if (!host[i].defined() || device[i].is_cpu()) {
        back.push_back(host[i]);
        continue;
      }
      back.push_back(host[i].to(device[i], /*non_blocking=*/true));
    }
  }
  // The inputs for backward: the copies brought back (issued now if nobody did), which
  // are dropped here so that a second backward copies again.
  std::vector<at::Tensor> take() {
    bring_back();
    std::lock_guard<std::mutex> lock(mu);
    return std::exchange(back, {});
  }
};

// The newest region that offloaded in this thread's forward: the next one links to it.
thread_local c10::weak_intrusive_ptr<torch::CustomClassHolder> newest_offloaded{
    c10::intrusive_ptr<torch::CustomClassHolder>()};

c10::intrusive_ptr<Offloaded> offload(const variable_list& inputs, stats::MemoryCounter* counter) {
  auto o = c10::make_intrusive<Offloaded>();
  for (const auto& t : inputs) {
    o->requires_grad.push_back(t.defined() && t.requires_grad());
    o->device.push_back(t.defined() ? t.device() : c10::Device(at::kCPU));
    if (!t.defined()) {
      o->host.emplace_back();
      continue;
    }
    at::Tensor h = at::empty(
        t.sizes(), t.options().device(at::kCPU).requires_grad(false).pinned_memory(t.is_cuda()));
    h.copy_(t.detach(), /*non_blocking=*/t.is_cuda());
    o->bytes += static_cast<int64_t>(h.nbytes());
    o->host.push_back(std::move(h));
  }
  o->counter = counter;
  if (counter != nullptr) {
    counter->current += o->bytes;
    counter->peak = std::max(counter->peak, counter->current);
  }
  o->previous = newest_offloaded;
  newest_offloaded = c10::weak_intrusive_ptr<torch::CustomClassHolder>(
      c10::intrusive_ptr<torch::CustomClassHolder>(o));
  return o;
}

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
    if (fn->options.offload_inputs) {
      ctx->saved_data["offloaded"] =
          c10::IValue::make_capsule(offload(inputs, fn->options.host_counter));
    } else {
      ctx->save_for_backward(inputs);
    }
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
                "activation_checkpoint: double backward (create_graph=true) through a checkpointed "
                "region is "
                "not supported, because its graph is rebuilt inside backward. Run that region "
                "without fsdp::activation_checkpoint, or take the gradient without create_graph.");
    auto fn = c10::static_intrusive_pointer_cast<FnCapsule>(ctx->saved_data["fn"].toCapsule());
    auto rng = c10::static_intrusive_pointer_cast<RngCapsule>(ctx->saved_data["rng"].toCapsule());
    variable_list saved;
    std::vector<bool> requires_grad;
    if (ctx->saved_data.count("offloaded") != 0) {
      // Note [Activation offload]: this region's inputs, then the previous region's copy.
      auto off =
          c10::static_intrusive_pointer_cast<Offloaded>(ctx->saved_data["offloaded"].toCapsule());
      saved = off->take();
      requires_grad = off->requires_grad;
      if (auto prev = off->previous.lock())
        c10::static_intrusive_pointer_cast<Offloaded>(prev)->bring_back();
    } else {
      saved = ctx->get_saved_variables();
      for (const auto& t : saved) requires_grad.push_back(t.defined() && t.requires_grad());
    }
    variable_list inputs;
    for (size_t i = 0; i < saved.size(); ++i) {
      const auto& t = saved[i];
      if (!t.defined()) {
        inputs.push_back(t);
        continue;
      }
      auto d = t.detach();
      d.set_requires_grad(requires_grad[i]);
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

std::vector<torch::Tensor> activation_checkpoint(const ActivationCheckpointFn& fn,
                                                 const std::vector<torch::Tensor>& inputs,
                                                 const ActivationCheckpointOptions& options) {
  TORCH_CHECK(fn != nullptr, "activation_checkpoint: the function is empty");
  if (!at::GradMode::is_enabled()) return fn(inputs);  // nothing would be saved anyway
  auto anchor = at::empty({0});
  anchor.set_requires_grad(true);
  // As a TensorList, so that autograd sees every input as a variable.
  return CheckpointFunction::apply(
      c10::make_intrusive<FnCapsule>(fn, detail::trace::RegionName::current(), options), anchor,
      at::TensorList(inputs));
}

std::vector<torch::Tensor> activation_checkpoint(const ActivationCheckpointFn& fn,
                                                 const std::vector<torch::Tensor>& inputs) {
  return activation_checkpoint(fn, inputs, ActivationCheckpointOptions{});
}

int64_t activation_recomputes() { return recomputes.load(std::memory_order_relaxed); }

torch::Tensor activation_checkpoint(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                    const torch::Tensor& input,
                                    const ActivationCheckpointOptions& options) {
  TORCH_CHECK(fn != nullptr, "activation_checkpoint: the function is empty");
  return activation_checkpoint(
      [fn](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{fn(in[0])}; },
      std::vector<torch::Tensor>{input}, options)[0];
}

}  // namespace fsdp
