// Composition: any / all of several policies.
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {
namespace {
void check_all_set(const std::vector<wrap::WrapPolicy>& ps, const char* who) {
  for (size_t i = 0; i < ps.size(); ++i) {
    TORCH_CHECK(ps[i] != nullptr, who, ": policy #", i, " is empty");
  }
}
}  // namespace

wrap::WrapPolicy wrap::any_policy(std::vector<wrap::WrapPolicy> policies) {
  check_all_set(policies, "any_policy");
  return [ps = std::move(policies)](const wrap::WrapContext& ctx) {
    return std::any_of(ps.begin(), ps.end(), [&](const wrap::WrapPolicy& p) { return p(ctx); });
  };
}

wrap::WrapPolicy wrap::all_policy(std::vector<wrap::WrapPolicy> policies) {
  check_all_set(policies, "all_policy");
  return [ps = std::move(policies)](const wrap::WrapContext& ctx) {
    return std::all_of(ps.begin(), ps.end(), [&](const wrap::WrapPolicy& p) { return p(ctx); });
  };
}
}  // namespace fsdp
