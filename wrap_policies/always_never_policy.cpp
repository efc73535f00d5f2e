// Trivial policies: every wrap point is a unit, or none is.
#include <fsdp/wrap_policy.h>

namespace fsdp {
wrap::WrapPolicy wrap::always_wrap_policy() {
  return [](const wrap::WrapContext&) { return true; };
}
wrap::WrapPolicy wrap::never_wrap_policy() {
  return [](const wrap::WrapContext&) { return false; };
}
}  // namespace fsdp
