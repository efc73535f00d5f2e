#include "save_hook.h"

#include "internal/checkpoint_view.h"

#include <functional>

namespace fsdp {
namespace ckpt {
namespace {

std::function<void(const std::string&, const std::string&)>& save_hook() {
  static std::function<void(const std::string&, const std::string&)> hook;
  return hook;
}

}  // namespace

void call_save_hook(const char* step, const std::string& what) {
  if (save_hook()) save_hook()(step, what);
}

}  // namespace ckpt

namespace detail {
void set_save_hook(std::function<void(const std::string&, const std::string&)> hook) {
  ckpt::save_hook() = std::move(hook);
}
}  // namespace detail

}  // namespace fsdp
