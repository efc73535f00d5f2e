// Trivial policies: every wrap point is a unit, or none is.
#include <fsdp/wrap_policy.h>

namespace fsdp {
WrapPolicy always_wrap_policy() {
  return [](const WrapContext&) { return true; };
}
WrapPolicy never_wrap_policy() {
  return [](const WrapContext&) { return false; };
}
}  // namespace fsdp
