#pragma once
// Wrap points and fully_shard.
//
// LibTorch modules have no forward hooks (docs/design.md, "LibTorch facts"), so a unit cannot attach
// itself to a module from the outside. The model calls a submodule *through* a wrap
// point, FullyShardedModule<M>, which forwards the call with M's own signature. A wrap
// point that the auto-wrap policy turns into a unit gathers its parameters before the
// call and frees them after; any other wrap point is a plain pass-through.

#include <fsdp/activation_checkpoint.h>
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
class WrapPointImpl;
class FusedAdamW;
namespace detail {
class Unit;
class Runtime;
void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& options);
}  // namespace detail

/// Where one original parameter lives inside its unit's flat parameter.
struct ParamInfo {
  std::string fqn;              ///< clean name, e.g. "blocks.0.attn.qkv.weight"
  std::string unit_fqn;         ///< the owning unit ("" for the root)
  bool requires_grad = true;    ///< trainable params and frozen ones sit in separate flat params
  int64_t offset = 0;           ///< first element in the unpadded flat parameter, in elements
  int64_t numel = 0;            ///< elements
  std::vector<int64_t> shape;   ///< original shape
};

/// One flat parameter of a unit (a unit has one for trainable, one for frozen params).
struct FlatParamInfo {
  std::string unit_fqn;       ///< the owning unit ("" for the root)
  torch::Dtype param_dtype = torch::kFloat32;  ///< dtype of its gathered parameters
  bool requires_grad = true;  ///< trainable (true) or frozen (false)
  int64_t numel = 0;          ///< elements before padding
  int64_t padded_numel = 0;   ///< numel rounded up to a multiple of the shard group size
  int64_t shard_numel = 0;    ///< padded_numel / shard group size: elements each rank keeps
};

/// This rank's piece of one flat parameter, as checkpoint code sees it. The unpadded
/// flat parameter is split into `shard_group_size` equal chunks (the last ones padded);
/// ranks of other shard groups (HYBRID_SHARD, NO_SHARD) hold replicas of the same chunks.
struct LocalShard {
  FlatParamInfo info;
  int shard_group_size = 1;  ///< ranks the flat parameter is split over
  int shard_rank = 0;        ///< this rank's chunk index
  bool writer = true;        ///< first replica of its chunk: the one that saves it
  int64_t begin = 0;         ///< first element of the unpadded flat parameter held here
  int64_t length = 0;        ///< real (unpadded) elements held here; 0 when only padding
  torch::Tensor shard;       ///< the fp32 shard (shard_numel elements); the optimizer's parameter
  std::vector<ParamInfo> params;  ///< original parameters inside, aliases included
};

/// Base of every wrap point; not a template, so the engine can walk the module tree.
class WrapPointImpl : public torch::nn::Module {
 public:
  /// The wrapped module (the M in FullyShardedModule<M>).
  virtual std::shared_ptr<torch::nn::Module> wrapped() const = 0;

  /// True once fully_shard made this wrap point a unit.
  bool is_unit() const { return unit_ != nullptr; }
  /// True on the wrap point fully_shard returned.
  bool is_root() const { return runtime_ != nullptr; }
  /// True when ShardingOptions::checkpoint_policy picked this wrap point.
  bool checkpointed() const { return checkpoint_; }

  // The rest is valid on the root only.

  /// The fp32 trainable shards, one per unit: give these to any torch::optim optimizer.
  std::vector<torch::Tensor> sharded_parameters() const;
  /// Engine-held bytes by class, this rank.
  MemoryStats memory_stats() const;
  /// Resets every memory counter's peak to its current value.
  void reset_peak_memory();
  /// Bytes moved by collectives, this step and in total.
  CommCounters comm_stats() const;
  /// Every original parameter: FQN, owning unit, offset, numel, shape; in unit order.
  std::vector<ParamInfo> param_table() const;
  /// Every flat parameter, in unit order (root first, then units in module order).
  std::vector<FlatParamInfo> flat_params() const;
  /// Every flat parameter's piece on this rank, in flat_params() order.
  std::vector<LocalShard> local_shards() const;
  /// Collective over the shard group (all its ranks call it): the full fp32 value
  /// (unpadded numel elements) of flat parameter `index`, built from `shard_like`, this
  /// rank's shard of it or of any state laid out like it (e.g. Adam's exp_avg). Counted
  /// in MemoryStats::checkpoint_buffers while the returned tensor lives.
  torch::Tensor gather_flat(size_t index, const torch::Tensor& shard_like) const;
  /// Lets `optimizer` write each updated trainable shard, in param_dtype, in its update
  /// pass (FusedAdamW::set_copy_out); the next gathers send that copy instead of
  /// casting the shard, as long as the shard has not changed since. Only for 16-bit
  /// param_dtype with shards on the CPU (CPU training or cpu_offload). Returns how many
  /// flat parameters were attached.
  int attach_copy_out(FusedAdamW& optimizer);
  /// Gathers that used an optimizer's copy (attach_copy_out) instead of a cast.
  int64_t copy_out_gathers() const;
  /// The options the model was sharded with.
  const ShardingOptions& sharding_options() const;
  /// The internal runtime; for the engine and checkpoint code.
  detail::Runtime& runtime() const;

 protected:
  explicit WrapPointImpl(const std::string& name) : torch::nn::Module(name) {}
  void pre_forward();
  void post_forward(std::vector<torch::Tensor> outputs);
  /// The one path of a Tensor -> Tensor wrap point (FullyShardedModule and
  /// shard_sequential's entries alike): gather, cast the input under mixed precision,
  /// run `fn` (activation-checkpointed when the checkpoint policy picked this wrap
  /// point), cast the output, set the pre-backward hook, free.
  torch::Tensor run_tensor_forward(const std::function<torch::Tensor(const torch::Tensor&)>& fn, torch::Tensor x);
  /// Throws: the checkpoint policy picked this wrap point, but its forward is not
  /// Tensor -> Tensor, which activation checkpointing needs.
  [[noreturn]] void fail_checkpoint_needs_tensor_forward() const;
  /// Set by fully_shard under mixed precision: floating inputs are cast to this dtype.
  std::optional<torch::Dtype> cast_inputs_;
  /// Set on the root when MixedPrecision::output_dtype is given.
  std::optional<torch::Dtype> cast_outputs_;
  /// Set by fully_shard when the checkpoint policy picks this wrap point.
  bool checkpoint_ = false;
  /// This wrap point's clean FQN, for errors (set by fully_shard).
  std::string fqn_;

 private:
  friend class detail::Runtime;
  friend void detail::shard_module_tree(const std::shared_ptr<WrapPointImpl>&, const ShardingOptions&);
  std::shared_ptr<detail::Unit> unit_;        ///< set when this wrap point is a unit
  std::shared_ptr<detail::Runtime> runtime_;  ///< set on the root only
};

namespace detail {
// Mixed precision: floating-point tensor arguments are cast to the unit's compute dtype;
// everything else passes through untouched.
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
inline void collect_tensors(const std::vector<torch::Tensor>& ts,
                            std::vector<torch::Tensor>& out) {
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

/// A wrap point around module holder `M` (e.g. torch::nn::Linear or a TORCH_MODULE).
template <class M>
class FullyShardedModuleImpl : public WrapPointImpl {
 public:
  explicit FullyShardedModuleImpl(M module)
      : WrapPointImpl("fsdp::FullyShardedModule"),
        module_(register_module(kWrappedName, std::move(module))) {}

  /// Calls M's forward; gathers and frees the unit's parameters around it.
  template <typename... Args>
  auto forward(Args&&... args) -> decltype(std::declval<M&>()->forward(std::forward<Args>(args)...)) {
    using Out = decltype(std::declval<M&>()->forward(std::forward<Args>(args)...));
    if constexpr (sizeof...(Args) == 1 && std::is_same_v<Out, torch::Tensor> &&
                  (std::is_convertible_v<Args, torch::Tensor> && ...)) {
      // Tensor -> Tensor: the path every such wrap point shares (shard_sequential's too).
      return run_tensor_forward([this](const torch::Tensor& t) { return module_->forward(t); },
                                (torch::Tensor(std::forward<Args>(args)), ...));
    } else {
      if (!is_unit() && !checkpointed()) return module_->forward(std::forward<Args>(args)...);
      if (checkpointed() && torch::GradMode::is_enabled()) fail_checkpoint_needs_tensor_forward();
      if (is_unit()) pre_forward();
      auto out = cast_inputs_ ? module_->forward(detail::cast_floating(std::forward<Args>(args), *cast_inputs_)...)
                              : module_->forward(std::forward<Args>(args)...);
      if constexpr (std::is_same_v<std::decay_t<Out>, torch::Tensor>) {
        if (cast_outputs_ && out.defined() && out.is_floating_point()) out = out.to(*cast_outputs_);
      }
      if (is_unit()) {
        std::vector<torch::Tensor> tensors;
        detail::collect_tensors(out, tensors);
        post_forward(std::move(tensors));
      }
      return out;
    }
  }

  /// The wrapped module holder.  /// The wrapped module holder.
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

/// Wrap point for an entry of a torch::nn::Sequential (Tensor -> Tensor).
class SequentialEntryImpl : public WrapPointImpl {
 public:
  explicit SequentialEntryImpl(torch::nn::AnyModule module);
  torch::Tensor forward(torch::Tensor x);
  std::shared_ptr<torch::nn::Module> wrapped() const override { return module_.ptr(); }

 private:
  torch::nn::AnyModule module_;
};

namespace detail {
/// Turns the tree under `root` into units; `root` becomes the root unit.
void shard_module_tree(const std::shared_ptr<WrapPointImpl>& root, const ShardingOptions& options);
/// Rebuilds `seq` with every entry behind a wrap point, keeping entry names.
torch::nn::Sequential wrap_sequential_entries(const torch::nn::Sequential& seq);
}  // namespace detail

/// Shards `module` and every wrap point inside it that the policy picks. Returns the
/// root wrap point; call the model through it.
template <class M>
FullyShardedModule<M> fully_shard(M module, const ShardingOptions& options = {}) {
  FullyShardedModule<M> root(std::move(module));
  detail::shard_module_tree(root.ptr(), options);
  return root;
}

/// Shards a model whose root already is a wrap point.
template <class M>
FullyShardedModule<M> fully_shard(FullyShardedModule<M> root, const ShardingOptions& options = {}) {
  detail::shard_module_tree(root.ptr(), options);
  return root;
}

/// Shards a torch::nn::Sequential with no change to its code: each entry becomes a wrap
/// point (subject to the policy), keeping its name, so FQNs stay "0.weight", "1.bias", ...
inline FullyShardedModule<torch::nn::Sequential> shard_sequential(
    const torch::nn::Sequential& seq, const ShardingOptions& options = {}) {
  return fully_shard(detail::wrap_sequential_entries(seq), options);
}

/// Gradient accumulation without communication: backward passes inside the scope keep
/// each unit's unsharded flat gradient locally (more memory: the memory counters'
/// comm_buffers show it) and the first backward after the scope reduces the sum once
/// (less communication), as PyTorch FSDP's no_sync(). Outside the scope every backward
/// reduce-scatters into the gradient shards (least memory).
class NoSyncScope {
 public:
  explicit NoSyncScope(WrapPointImpl& root);
  ~NoSyncScope();
  NoSyncScope(const NoSyncScope&) = delete;
  NoSyncScope& operator=(const NoSyncScope&) = delete;

 private:
  WrapPointImpl& root_;
  bool previous_;
};

/// Clean FQNs of the module tree under `module`: wrap-point segments removed, so the
/// names equal those of the same model without wrap points.
std::vector<std::pair<std::string, torch::Tensor>> named_parameters_clean(
    const torch::nn::Module& module);
/// Clean FQNs of the buffers under `module` (LibTorch buffers are all persistent).
std::vector<std::pair<std::string, torch::Tensor>> named_buffers_clean(const torch::nn::Module& module);

}  // namespace fsdp
