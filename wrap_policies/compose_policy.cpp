// Composition: any / all of several policies.
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {
namespace {
void check_all_set(const std::vector<WrapPolicy>& ps, const char* who) {
  for (size_t i = 0; i < ps.size(); ++i) {
    TORCH_CHECK(ps[i] != nullptr, who, ": policy #", i, " is empty");
  }
}
}  // namespace

WrapPolicy any_policy(std::vector<WrapPolicy> policies) {
  check_all_set(policies, "any_policy");
  return [ps = std::move(policies)](const WrapContext& ctx) {
    return std::any_of(ps.begin(), ps.end(), [&](const WrapPolicy& p) { return p(ctx); });
  };
}

WrapPolicy all_policy(std::vector<WrapPolicy> policies) {
  check_all_set(policies, "all_policy");
  return [ps = std::move(policies)](const WrapContext& ctx) {
    return std::all_of(ps.begin(), ps.end(), [&](const WrapPolicy& p) { return p(ctx); });
  };
}
}  // namespace fsdp
