#include "name_match.h"

#include <c10/util/Exception.h>

namespace fsdp::ckpt {

std::string list_names(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i ? ", " : "") + names[i];
  return s + " (" + std::to_string(names.size()) + ")";
}

void report_mismatch(const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected, bool strict) {
  if (!strict || (missing.empty() && unexpected.empty())) return;
  std::string msg = what + " does not match this model.";
  if (!missing.empty()) msg += " Missing from the checkpoint: " + list_names(missing) + ".";
  if (!unexpected.empty()) msg += " Not in the model: " + list_names(unexpected) + ".";
  msg +=
      " Was it saved from another model? Load with LoadOptions::strict = false to take the "
      "parameters that match.";
  TORCH_CHECK(false, msg);
}

void check_shapes_match(const std::string& what, const std::vector<std::string>& mismatched) {
  TORCH_CHECK(mismatched.empty(), what, " does not match this model: shapes differ for ",
              list_names(mismatched), ". Was it saved from another model?");
}

}  // namespace fsdp::ckpt
