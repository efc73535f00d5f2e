// Every k-th wrap point, in the order the policy is asked (module order for siblings).
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

#include <memory>

namespace fsdp {
wrap::WrapPolicy wrap::every_kth_policy(int k) {
  TORCH_CHECK(k >= 1, "every_kth_policy: k=", k, " must be at least 1 (1 picks every wrap point)");
  auto seen = std::make_shared<int64_t>(0);
  return [k, seen](const wrap::WrapContext&) { return (*seen)++ % k == 0; };
}
}  // namespace fsdp
