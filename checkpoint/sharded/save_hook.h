#pragma once
// The tests' way into a save (detail::set_save_hook, src/internal/checkpoint_view.h): each
// step of a save calls the hook first, so a test can fail it as a full disk or running
// out of memory would, or hold it to kill the process inside it.

#include <string>

namespace fsdp::ckpt {

/// Calls the hook, if one is set, with (step, what): ("stage", the staging key),
/// ("write", the rank file), ("publish", the checkpoint directory). A throw there fails
/// that step.
void call_save_hook(const char* step, const std::string& what);

}  // namespace fsdp::ckpt
