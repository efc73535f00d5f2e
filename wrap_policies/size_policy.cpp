// Size-based policy: a unit once a wrap point would own enough parameters.
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

namespace fsdp {
wrap::WrapPolicy wrap::size_based_policy(int64_t min_numel) {
  TORCH_CHECK(min_numel >= 0, "size_based_policy: min_numel=", min_numel,
              " must not be negative; pass the least number of parameters a unit should own");
  return [min_numel](const wrap::WrapContext& ctx) { return ctx.numel >= min_numel; };
}
}  // namespace fsdp
