#pragma once
// Matching a checkpoint's names against the model it is loaded into: the errors of a
// strict load, shared by the sharded and the consolidated loads.

#include <string>
#include <vector>

namespace fsdp::ckpt {

/// "a, b, c (3)": every name, as the strict-load error promises.
std::string list_names(const std::vector<std::string>& names);
/// The error of `what` (a checkpoint, a file) whose tensors named `mismatched` have
/// other shapes than the model's; none when it is empty.
void check_shapes_match(const std::string& what, const std::vector<std::string>& mismatched);

/// With `strict`, throws when anything is missing or unexpected, listing every name and
/// saying how to load what matches; `what` names the checkpoint.
void report_mismatch(const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected, bool strict);

}  // namespace fsdp::ckpt
