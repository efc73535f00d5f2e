// Predicate policy: the user decides from the FQN, the module and its parameter count.
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

namespace fsdp {
wrap::WrapPolicy wrap::predicate_policy(
    std::function<bool(const std::string&, const torch::nn::Module&, int64_t)> predicate) {
  TORCH_CHECK(predicate != nullptr, "predicate_policy: the predicate is empty");
  return [p = std::move(predicate)](const wrap::WrapContext& ctx) {
    return p(ctx.fqn, ctx.module, ctx.numel);
  };
}
}  // namespace fsdp
