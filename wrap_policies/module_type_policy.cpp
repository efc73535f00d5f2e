// Module-type policy by type name; the typed form is a template in fsdp/wrap_policy.h.
#include <fsdp/wrap_policy.h>

#include <c10/util/Exception.h>

#include <algorithm>

namespace fsdp {
wrap::WrapPolicy wrap::module_type_policy(std::vector<std::string> type_names) {
  TORCH_CHECK(!type_names.empty(),
              "module_type_policy: no type names given; list module classes such as \"BlockImpl\"");
  return [names = std::move(type_names)](const wrap::WrapContext& ctx) {
    return std::find(names.begin(), names.end(), ctx.module.name()) != names.end();
  };
}
}  // namespace fsdp
