#pragma once
// Auto-wrap policies: which wrap points (FullyShardedModule<M>) become sharded units.
// Implemented in wrap_policies.
// A wrap point the policy rejects merges its parameters into the nearest enclosing unit.

#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {
/// Auto-wrap policies (as torch.distributed.fsdp.wrap): which wrap points become units.
namespace wrap {

/// What a policy sees about one wrap point. Policies are asked bottom-up, so `numel`
/// already excludes parameters claimed by inner units.
struct WrapContext {
  const std::string& fqn;           ///< e.g. "blocks.3" (clean: no wrapper segments)
  const torch::nn::Module& module;  ///< the wrapped module (the M inside the wrap point)
  int64_t numel;                    ///< parameters it would own, not claimed by inner units
};

/// Returns true when the wrap point should become its own unit.
using WrapPolicy = std::function<bool(const WrapContext&)>;

/// Every wrap point becomes a unit.
WrapPolicy always_wrap_policy();
/// No wrap point becomes a unit: the root unit owns everything.
WrapPolicy never_wrap_policy();
/// A unit when it would own at least `min_numel` parameters (as FSDP's
/// size_based_auto_wrap_policy). Throws if min_numel < 0.
WrapPolicy size_based_policy(int64_t min_numel);
/// A unit when the wrapped module's type name (Module::name(), e.g.
/// "torch::nn::LinearImpl" or "BlockImpl") is one of `type_names`.
WrapPolicy module_type_policy(std::vector<std::string> type_names);
/// A unit when `predicate(fqn, module, numel)` says so.
WrapPolicy predicate_policy(
    std::function<bool(const std::string&, const torch::nn::Module&, int64_t)> predicate);
/// Every k-th wrap point in module order (the 1st, the (k+1)-th, ...) among those it
/// is asked about; for checkpoint policies. Throws if k < 1.
WrapPolicy every_kth_policy(int k);
/// A unit when any of `policies` says so (false for an empty list).
WrapPolicy any_policy(std::vector<WrapPolicy> policies);
/// A unit when all of `policies` say so (true for an empty list).
WrapPolicy all_policy(std::vector<WrapPolicy> policies);

/// A unit when the wrapped module is one of the classes `Ms` (or a subclass). Accepts
/// module classes (BlockImpl) and their holders (Block).
template <class... Ms>
WrapPolicy module_type_policy() {
  static_assert(sizeof...(Ms) > 0, "module_type_policy<...>() needs at least one module class");
  // A holder (Block) names its class as ContainedType; a class (BlockImpl) is itself.
  auto is = [](auto tag, const torch::nn::Module& m) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if constexpr (std::is_base_of_v<torch::nn::Module, T>) {
      return dynamic_cast<const T*>(&m) != nullptr;
    } else {
      return dynamic_cast<const typename T::ContainedType*>(&m) != nullptr;
    }
  };
  return
      [is](const WrapContext& ctx) { return (... || is(static_cast<Ms*>(nullptr), ctx.module)); };
}

}  // namespace wrap

// The names before they moved into fsdp::wrap (issue 54: concepts in nested namespaces,
// as torch::nn). They stay one release, deprecated.
using WrapContext [[deprecated("renamed fsdp::wrap::WrapContext")]] = wrap::WrapContext;
using WrapPolicy [[deprecated("renamed fsdp::wrap::WrapPolicy")]] = wrap::WrapPolicy;
[[deprecated("renamed fsdp::wrap::always_wrap_policy")]] inline wrap::WrapPolicy
always_wrap_policy() {
  return wrap::always_wrap_policy();
}
[[deprecated("renamed fsdp::wrap::never_wrap_policy")]] inline wrap::WrapPolicy
never_wrap_policy() {
  return wrap::never_wrap_policy();
}
[[deprecated("renamed fsdp::wrap::size_based_policy")]] inline wrap::WrapPolicy size_based_policy(
    int64_t min_numel) {
  return wrap::size_based_policy(min_numel);
}
[[deprecated("renamed fsdp::wrap::module_type_policy")]] inline wrap::WrapPolicy module_type_policy(
    std::vector<std::string> type_names) {
  return wrap::module_type_policy(std::move(type_names));
}
template <class... Ms>
[[deprecated("renamed fsdp::wrap::module_type_policy")]] wrap::WrapPolicy module_type_policy() {
  return wrap::module_type_policy<Ms...>();
}
[[deprecated("renamed fsdp::wrap::predicate_policy")]] inline wrap::WrapPolicy predicate_policy(
    std::function<bool(const std::string&, const torch::nn::Module&, int64_t)> predicate) {
  return wrap::predicate_policy(std::move(predicate));
}
[[deprecated("renamed fsdp::wrap::every_kth_policy")]] inline wrap::WrapPolicy every_kth_policy(
    int k) {
  return wrap::every_kth_policy(k);
}
[[deprecated("renamed fsdp::wrap::any_policy")]] inline wrap::WrapPolicy any_policy(
    std::vector<wrap::WrapPolicy> policies) {
  return wrap::any_policy(std::move(policies));
}
[[deprecated("renamed fsdp::wrap::all_policy")]] inline wrap::WrapPolicy all_policy(
    std::vector<wrap::WrapPolicy> policies) {
  return wrap::all_policy(std::move(policies));
}

}  // namespace fsdp
