#pragma once
// Wrap points and fully_shard.
// Implemented in src/engine.
//
// LibTorch modules have no forward hooks (docs/design.md, "LibTorch facts"), so a unit cannot
// attach itself to a module from the outside. The model calls a submodule *through* a wrap point,
// FullyShardedModule<M>, which forwards the call with M's own signature. A wrap point that the
// auto-wrap policy turns into a unit gathers its parameters before the call and frees them after;
// any other wrap point is a plain pass-through.

#include <fsdp/options.h>
#include <fsdp/stats.h>

#include <torch/torch.h>

#include <functional>

#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {
struct EngineAccess;
/// The engine's state of one wrap point (its unit, its model, its casts), defined inside
/// the library (src/engine/engine_access.h): no engine type appears in this header.
struct WrapPointState;
struct ConstructionState;

/// Sharded construction (fsdp::make_sharded): while a scope lives on this thread, each
/// wrap point shards its module the moment it is constructed, so a rank never holds more
/// than its shards plus the unit being built. One scope per thread at a time; finish()
/// ends it before the root is sharded. Defined in the library (src/engine).
class ConstructionScope {
 public:
  explicit ConstructionScope(const ShardingOptions& options);
  ~ConstructionScope();
  ConstructionScope(const ConstructionScope&) = delete;
  ConstructionScope& operator=(const ConstructionScope&) = delete;
  /// Ends the scope: wrap points constructed after it are ordinary again.
  void finish();

 private:
  std::shared_ptr<ConstructionState> state_;
};

// Mixed precision: floating-point tensor arguments of a unit's forward are cast to its
// compute dtype; everything else passes through untouched.
template <class T>
decltype(auto) cast_floating(T&& v, torch::Dtype) {
  return std::forward<T>(v);
}
inline torch::Tensor cast_floating(const torch::Tensor& t, torch::Dtype d) {
  return t.defined() && t.is_floating_point() ? t.to(d) : t;
}
inline torch::Tensor cast_floating(torch::Tensor& t, torch::Dtype d) {
  return cast_floating(static_cast<const torch::Tensor&>(t), d);
}
inline torch::Tensor cast_floating(torch::Tensor&& t, torch::Dtype d) {
  return cast_floating(static_cast<const torch::Tensor&>(t), d);
}

// Collects the tensors in a forward's output so that pre-backward hooks can be set on
// them. Unknown types contribute nothing.
inline void collect_tensors(const torch::Tensor& t, std::vector<torch::Tensor>& out) {
  if (t.defined()) out.push_back(t);
}
inline void collect_tensors(const std::vector<torch::Tensor>& ts, std::vector<torch::Tensor>& out) {
  for (const auto& t : ts) collect_tensors(t, out);
}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<torch::Tensor>& out);
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out);
template <class T>
void collect_tensors(const T&, std::vector<torch::Tensor>&) {}
template <class A, class B>
void collect_tensors(const std::pair<A, B>& p, std::vector<torch::Tensor>& out) {
  collect_tensors(p.first, out);
  collect_tensors(p.second, out);
}
template <class... Ts>
void collect_tensors(const std::tuple<Ts...>& t, std::vector<torch::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect_tensors(e, out), ...); }, t);
}
}  // namespace detail

/// Where one original parameter lives inside its unit's flat parameter.
struct ParamInfo {
  std::string fqn;             ///< clean name, e.g. "blocks.0.attn.qkv.weight"
  std::string unit_fqn;        ///< the owning unit ("" for the root)
  bool requires_grad = true;   ///< trainable params and frozen ones sit in separate flat params
  int64_t offset = 0;          ///< first element in the unpadded flat parameter, in elements
  int64_t numel = 0;           ///< elements
  std::vector<int64_t> shape;  ///< original shape
};

/// Base of every wrap point; not a template, so the engine can walk the module tree.
class WrapPointImpl : public torch::nn::Module {
 public:
  ~WrapPointImpl() override;
  WrapPointImpl(const WrapPointImpl&) = delete;
  WrapPointImpl& operator=(const WrapPointImpl&) = delete;

  /// The wrapped module (the M in FullyShardedModule<M>).
  virtual std::shared_ptr<torch::nn::Module> wrapped() const = 0;

  /// True once fully_shard made this wrap point a unit.
  bool is_unit() const;
  /// True when ShardingOptions::checkpoint_policy picked this wrap point.
  bool checkpointed() const;

 protected:
  explicit WrapPointImpl(const std::string& name);
  /// Called by a wrap point's constructor once its module is built: inside
  /// fsdp::make_sharded, shards the module now (docs/design.md, "Sharded construction").
  void constructed();

  // The engine's side of a call through a wrap point. FullyShardedModuleImpl::forward
  // (a template, so in this header) calls these; the engine's state stays in the library.

  /// The one path of a Tensor -> Tensor wrap point (FullyShardedModule and
  /// shard_sequential's entries alike): gather, cast the input under mixed precision,
  /// run `fn` (activation-checkpointed when the checkpoint policy picked this wrap
  /// point), cast the output, set the pre-backward hook, free.
  torch::Tensor run_tensor_forward(const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                                   torch::Tensor x);
  /// Any other forward, before the call: refuses activation checkpointing (it needs
  /// Tensor -> Tensor), gathers a unit's parameters. Returns the dtype floating inputs
  /// are cast to under mixed precision, if any.
  std::optional<torch::Dtype> before_forward();
  /// After the call: casts a floating tensor output to the root's output dtype, if set.
  torch::Tensor cast_output(torch::Tensor out) const;
  /// After the call: sets the pre-backward hooks on a unit's outputs and frees it.
  void after_forward(std::vector<torch::Tensor> outputs);
  /// A unit's forward failed with `e`: under mixed precision, a dtype mismatch gets the
  /// unit's name and the options that fix it (MixedPrecision::buffer_dtype,
  /// cast_forward_inputs); empty for any other error, which goes on as it was.
  std::optional<std::string> mixed_precision_hint(const c10::Error& e) const;

 private:
  friend struct detail::EngineAccess;
  std::unique_ptr<detail::WrapPointState> state_;
};

/// A wrap point around module holder `M` (e.g. torch::nn::Linear or a TORCH_MODULE).
template <class M>
class FullyShardedModuleImpl : public WrapPointImpl {
 public:
  explicit FullyShardedModuleImpl(M module)
      : WrapPointImpl("fsdp::FullyShardedModule"),
        module_(register_module(kWrappedName, std::move(module))) {
    constructed();
  }

  /// Calls M's forward; gathers and frees the unit's parameters around it.
  template <typename... Args>
  auto forward(Args&&... args)
      -> decltype(std::declval<M&>()->forward(std::forward<Args>(args)...)) {
    using Out = decltype(std::declval<M&>()->forward(std::forward<Args>(args)...));
    if constexpr (sizeof...(Args) == 1 && std::is_same_v<Out, torch::Tensor> &&
                  (std::is_convertible_v<Args, torch::Tensor> && ...)) {
      // Tensor -> Tensor: the path every such wrap point shares (shard_sequential's too).
      return run_tensor_forward([this](const torch::Tensor& t) { return module_->forward(t); },
                                (torch::Tensor(std::forward<Args>(args)), ...));
    } else {
      if (!is_unit() && !checkpointed()) return module_->forward(std::forward<Args>(args)...);
      const std::optional<torch::Dtype> cast = before_forward();
      auto call = [&]() {
        try {
          return cast ? module_->forward(detail::cast_floating(std::forward<Args>(args), *cast)...)
                      : module_->forward(std::forward<Args>(args)...);
        } catch (const c10::Error& e) {
          if (auto hint = mixed_precision_hint(e)) TORCH_CHECK(false, *hint);
          throw;
        }
      };
      auto out = call();
      if constexpr (std::is_same_v<std::decay_t<Out>, torch::Tensor>)
        out = cast_output(std::move(out));
      if (is_unit()) {
        std::vector<torch::Tensor> tensors;
        detail::collect_tensors(out, tensors);
        after_forward(std::move(tensors));
      }
      return out;
    }
  }

  /// The wrapped module holder.
  M& module() { return module_; }
  const M& module() const { return module_; }
  std::shared_ptr<torch::nn::Module> wrapped() const override { return module_.ptr(); }

  /// Name under which the wrapped module is registered; FQNs skip it.
  static constexpr const char* kWrappedName = "module";

 private:
  M module_;
};

/// Holder for FullyShardedModuleImpl<M>, used like any TORCH_MODULE: fc(x), fc->forward(x).
template <class M>
class FullyShardedModule : public torch::nn::ModuleHolder<FullyShardedModuleImpl<M>> {
 public:
  using torch::nn::ModuleHolder<FullyShardedModuleImpl<M>>::ModuleHolder;

  /// Calls the wrapped module's forward (ModuleHolder's own operator() cannot see a
  /// templated forward).
  template <typename... Args>
  auto operator()(Args&&... args)
      -> decltype(std::declval<FullyShardedModuleImpl<M>&>().forward(std::forward<Args>(args)...)) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

/// A sharded model, whatever its module type: what fully_shard returns (as
/// Sharded<M>), and what the free functions (checkpoints, clipping, full state dict,
/// export, loss scaling) take. Its methods are the user's verbs, as on a PyTorch
/// FSDP2 module. Cheap to copy: copies share the model.
class ShardedModel {
 public:
  /// An empty handle; every method throws until a sharded model is assigned to it.
  ShardedModel() = default;

  /// The fp32 trainable shards, one per unit: give these to any torch::optim optimizer.
  std::vector<torch::Tensor> sharded_parameters() const;
  /// Engine-held bytes by class, this rank.
  stats::MemoryStats memory_stats() const;
  /// Resets every memory counter's peak to its current value.
  void reset_peak_memory();
  /// Bytes moved by collectives, this step and in total.
  stats::CommCounters comm_stats() const;
  /// Every original parameter: FQN, owning unit, offset, numel, shape; in unit order.
  std::vector<ParamInfo> param_table() const;
  /// The options the model was sharded with.
  const ShardingOptions& sharding_options() const;

  /// Collective (every rank calls it): gathers every unit's full parameters, which stay
  /// in place (each original parameter holds its full value, in param_dtype) until
  /// reshard() or until a forward frees them. For evaluation and reading weights;
  /// changes to them are not written back into the shards (FullParamsScope does that).
  void unshard();
  /// Frees every unit's full parameters (the state after sharding). Idempotent.
  void reshard();
  /// false: backward keeps each unit's unsharded gradient and accumulates into it
  /// instead of reduce-scattering (gradient accumulation without communication, as
  /// PyTorch FSDP's set_requires_gradient_sync(False)); the first backward with true
  /// again reduces the sum once. Default true. NoSyncScope sets it for a scope.
  void set_requires_gradient_sync(bool requires_gradient_sync);
  bool requires_gradient_sync() const;
  /// false (FSDP2's set_reshard_after_backward(False)): units stay gathered after
  /// backward, so the next forward (gradient accumulation over micro-batches) gathers
  /// nothing. Set true again before the last micro-batch's backward, which then frees
  /// them; an optimizer step must not come while they are kept (reshard() frees them).
  /// Default true.
  void set_reshard_after_backward(bool reshard_after_backward);
  /// FSDP2's set_modules_to_forward_prefetch: when unit `unit_fqn` (clean FQN, "" for the
  /// root) starts its forward, gather the units `prefetch_fqns` name, instead of what the
  /// recorded order would prefetch (with no bound: ShardingOptions::max_gathered_units and
  /// prefetch do not apply). An empty list prefetches nothing from it. Replaces an earlier
  /// list; an unknown FQN is an error listing the units'.
  void set_forward_prefetch(const std::string& unit_fqn, std::vector<std::string> prefetch_fqns);
  /// FSDP2's set_modules_to_backward_prefetch: as set_forward_prefetch, when unit
  /// `unit_fqn` starts its backward.
  void set_backward_prefetch(const std::string& unit_fqn, std::vector<std::string> prefetch_fqns);

  /// The sharded model as a torch module (its root wrap point): parameters(), train(),
  /// eval(), named_parameters(), ...
  torch::nn::Module& as_module() const;
  /// True when this handle holds a sharded model.
  explicit operator bool() const { return root_ != nullptr; }

 protected:
  /// Shards the tree under `root` (fully_shard's work) and holds it.
  ShardedModel(std::shared_ptr<WrapPointImpl> root, const ShardingOptions& options);

 private:
  friend struct detail::EngineAccess;
  WrapPointImpl& root() const;
  std::shared_ptr<WrapPointImpl> root_;
};

/// A sharded model of module type M: call it like the module (model(x), model->...),
/// and use the verbs of ShardedModel on it (model.sharded_parameters(), ...).
template <class M>
class Sharded : public FullyShardedModule<M>, public ShardedModel {
 public:
  /// Shards `root` and every wrap point inside it that the policy picks.
  Sharded(FullyShardedModule<M> root, const ShardingOptions& options)
      : FullyShardedModule<M>(std::move(root)), ShardedModel(this->ptr(), options) {}
  /// Both bases can say whether they hold a model; they agree, so `if (model)` asks one.
  using ShardedModel::operator bool;
};

/// Shards `module` and every wrap point inside it that the policy picks. Returns the
/// sharded model; call the model through it.
template <class M>
Sharded<M> fully_shard(M module, const ShardingOptions& options = {}) {
  return Sharded<M>(FullyShardedModule<M>(std::move(module)), options);
}

/// Shards a model whose root already is a wrap point.
template <class M>
Sharded<M> fully_shard(FullyShardedModule<M> root, const ShardingOptions& options = {}) {
  return Sharded<M>(std::move(root), options);
}

/// Constructs M(args...) already sharded (sharded construction, as DeepSpeed's zero.Init):
/// each wrap point built during M's construction that `options.auto_wrap_policy` picks
/// shards its module the moment its constructor finishes, so a rank's peak memory is its
/// own shards plus the one unit being built, not the whole model; then the root is
/// sharded as by fully_shard. Every rank builds every unit in full before keeping its
/// shard, so the same seed gives the same weights at any world size, and the same as
/// fully_shard(M(args...), options). The policy is asked as each wrap point finishes,
/// before it has a name (WrapContext::fqn is empty). A module must be fully initialised
/// when its wrap point is built: code that runs later in the parent's constructor must
/// not read or write an inner unit's parameters (they are sharded by then; use
/// FullParamsScope after make_sharded returns).
template <class M, class... Args>
Sharded<M> make_sharded(const ShardingOptions& options, Args&&... args) {
  detail::ConstructionScope scope(options);
  M module(std::forward<Args>(args)...);
  scope.finish();
  return fully_shard(std::move(module), options);
}

/// A model is sharded once: sharding a sharded model again does not compile. (A copy of
/// its root wrap point, sliced from the handle, is refused at run time.)
template <class M>
Sharded<M> fully_shard(const Sharded<M>& model, const ShardingOptions& options = {}) = delete;

/// Shards a torch::nn::Sequential with no change to its code: each entry becomes a wrap
/// point (subject to the policy), keeping its name, so FQNs stay "0.weight", "1.bias", ...
Sharded<torch::nn::Sequential> shard_sequential(const torch::nn::Sequential& seq,
                                                const ShardingOptions& options = {});

/// Gradient accumulation without communication for a scope:
/// set_requires_gradient_sync(false) while it lives. Backward passes inside keep each
/// unit's unsharded flat gradient locally (more memory: the memory counters'
/// comm_buffers show it) and the first backward after the scope reduces the sum once
/// (less communication), as PyTorch FSDP's no_sync(). Outside the scope every backward
/// reduce-scatters into the gradient shards (least memory).
class NoSyncScope {
 public:
  explicit NoSyncScope(ShardedModel model);
  ~NoSyncScope();
  NoSyncScope(const NoSyncScope&) = delete;
  NoSyncScope& operator=(const NoSyncScope&) = delete;

 private:
  ShardedModel model_;
  bool previous_;
};

/// Clean FQNs of the module tree under `module`: wrap-point segments removed, so the
/// names equal those of the same model without wrap points.
std::vector<std::pair<std::string, torch::Tensor>> named_parameters_clean(
    const torch::nn::Module& module);
/// Clean FQNs of the buffers under `module` (LibTorch buffers are all persistent).
std::vector<std::pair<std::string, torch::Tensor>> named_buffers_clean(
    const torch::nn::Module& module);

}  // namespace fsdp
