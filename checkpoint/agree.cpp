#include "agree.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

namespace fsdp::ckpt {

// Note [Agreed outcomes]
// A checkpoint call is collective: if one rank threw while the others went on, they would
// wait in the next collective until the timeout, with the cause printed by one process
// among many. So each step that can fail on some ranks ends in one small collective that
// tells every rank whether it failed anywhere, and all of them throw together: the rank
// that failed with its own error, the others pointing at it.

bool any_rank_failed(const ProcessGroup& pg, const std::string& error) {
  at::Tensor failed = at::full({1}, error.empty() ? 0.0f : 1.0f);
  pg.all_reduce_max(failed);
  return failed.item<float>() != 0;
}

bool rank0_failed(const ProcessGroup& pg, const std::string& error) {
  at::Tensor failed = at::full({1}, pg.rank() == 0 && !error.empty() ? 1.0f : 0.0f);
  pg.broadcast(failed, 0);
  return failed.item<float>() != 0;
}

std::string failure_detail(const std::string& error, const std::string& elsewhere) {
  return error.empty() ? elsewhere : ": " + error;
}

void rank0_tries(const ProcessGroup& pg, const std::string& what, const std::function<void()>& fn) {
  std::string error;
  if (pg.rank() == 0) {
    try {
      fn();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  TORCH_CHECK(!rank0_failed(pg, error), what, " failed",
              failure_detail(error, " on rank 0 (see its error)"));
}

}  // namespace fsdp::ckpt
