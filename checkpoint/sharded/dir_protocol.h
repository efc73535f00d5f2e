#pragma once
// The directory protocol of a sharded save (docs/design.md, "Checkpoints", and the
// layout in layout.h): a checkpoint is written as <dir>/.tmp-<name>, one rank file per
// rank, then published by rank 0 as <dir>/<name> and named by <dir>/latest. Both saves,
// synchronous and asynchronous, go through these steps.

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include <chrono>
#include <filesystem>
#include <string>

namespace fsdp::ckpt {

/// One save's names: dir/step_<step>[_<version>], written first as dir/.tmp-<name>.
struct SavePlan {
  std::filesystem::path base, tmp, final_dir;
};

/// Rejects a negative step or keep_last, naming `fn` and the value.
void check_save_args(const ckpt::TrainingState& state, const ckpt::SaveOptions& options,
                     const char* fn);

/// Collective. Rank 0 picks the name (a new one if this step was saved before) and makes
/// the temporary directory, removing one a killed save left; everyone learns the outcome
/// and the name's version (a broadcast).
SavePlan plan_save(const std::string& dir, int64_t step, const ProcessGroup& pg, const char* fn);

/// Collective: every rank's outcome of one step of a save (`error`: this rank's, "" for
/// none), agreed with a MAX all-reduce. After a failure anywhere rank 0 removes the
/// temporary directory and every rank throws alike, naming this rank's error or pointing
/// at another's.
void agree_or_abandon(const ProcessGroup& pg, const SavePlan& plan, const char* fn,
                      const std::string& dir, const std::string& error);

/// Rank 0, once every rank's file is complete: fsyncs the temporary directory, publishes
/// it under its final name, then moves `latest`; removes what killed saves left and the
/// oldest checkpoints beyond `keep_last` (0: none), never the new one.
void publish(const SavePlan& plan, int keep_last);

/// Prints "[fsdp] saved checkpoint <dir> (<world> rank files, <s> s<how>)".
void report_saved(const SavePlan& plan, int world, std::chrono::steady_clock::time_point t0,
                  const char* how);

}  // namespace fsdp::ckpt
