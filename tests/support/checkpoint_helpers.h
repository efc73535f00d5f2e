#pragma once
// What the checkpoint tests (tests/test_checkpoint_*.cpp) share: scratch directories
// the rank processes find again, the small GPT's options and training step, a sample
// training state, and error text.

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include "models.h"

#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::testing {

constexpr int64_t kRows = 12;  // divisible by 1, 2, 3 and 4 ranks

/// A scratch directory shared by the test process and the rank processes it starts
/// (they inherit the environment variable that names it).
std::string scratch_dir(const std::string& tag);

ShardingOptions options_for(const ProcessGroup& pg,
                            wrap::WrapPolicy policy = wrap::always_wrap_policy());

torch::optim::AdamW make_adamw(const ShardedModel& model);

/// One training step of the small GPT on this rank's rows of batch `step`; the loss
/// averaged over the ranks.
template <class Model>
double train_step(Model& model, torch::optim::Optimizer& opt, int64_t step,
                  const ProcessGroup& pg) {
  auto batch = gpt_batch(step, kRows, small_gpt_config().block_size);
  opt.zero_grad();
  auto loss = gpt::loss_on(model, my_rows(batch, pg));
  loss.backward();
  opt.step();
  return global_mean(loss, pg);
}

std::map<std::string, torch::Tensor> as_map(
    const std::vector<std::pair<std::string, torch::Tensor>>& v);

/// The message `fn` throws (without a backtrace), or "<no error>".
std::string error_of(const std::function<void()>& fn);

/// A file's whole contents.
std::string file_bytes_of(const std::string& p);

/// A training state with every part set: scheduler, extra, loss scaler, model attributes.
ckpt::TrainingState sample_state(int64_t step);

/// Every shard element of checkpoint `step` holds the value `step`, so a load that mixed
/// files of two checkpoints would show.
void fill_with(const ShardedModel& model, int64_t step);

}  // namespace fsdp::testing
