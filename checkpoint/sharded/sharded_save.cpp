// Sharded saves, synchronous and asynchronous (include/fsdp/checkpoint.h): the directory
// protocol (dir_protocol.h) around this rank's snapshot (snapshot.h), written at once or
// by the background job (async_save.h).
#include "../agree.h"
#include "async_save.h"
#include "dir_protocol.h"
#include "snapshot.h"
#include "trace/trace.h"

#include <fsdp/checkpoint.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>

#include "internal/checkpoint_view.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

namespace fsdp {
namespace ckpt {
namespace {

// Note [Pipelined checkpoints]
// A pipelined model (fsdp::pipeline) saves one checkpoint for all its stages: the directory
// protocol (plan, agree, publish) runs over the whole job, every rank writes
// rank_<job rank>.h5 with its stage's flats (format_version 2, attributes pipeline_stages
// and pipeline_stage), and each stage's first rank writes that stage's buffers. A stage's
// ranks are consecutive (rank r in stage r / dp), so its files are one part of the
// directory laid out as an unpipelined checkpoint of the stage over dp ranks. The reader
// (ShardedReader) takes every part's flats into one index, by FQN: with
// PipelineOptions::parameter_names the stages' names are the whole model's, so the same
// checkpoint loads into any number of stages, or none, at any world size, and an
// unpipelined checkpoint loads into the stages (each stage finds its names and ignores
// the others').

// Where a rank's file goes: the group the directory protocol runs over (the job), and
// the rank within the model's own group (a stage's under a pipeline).
struct Placement {
  const ProcessGroup* job;
  int local_rank = 0, local_world = 1;
  int stages = 1, stage = 0;
};

std::string save_sync(const std::string& dir, const ShardedModel& root,
                      torch::optim::Optimizer* optimizer, const ckpt::TrainingState& state,
                      const ckpt::SaveOptions& options, const Placement& at, const char* fn) {
  detail::trace::Scope span("checkpoint", []() { return std::string("checkpoint save"); });
  check_save_args(state, options, fn);
  const ProcessGroup& pg = *at.job;
  const int rank = pg.rank(), world = pg.size();
  const auto t0 = std::chrono::steady_clock::now();
  settle_previous(pg, fn);
  const SavePlan plan = plan_save(dir, state.step, pg, fn);

  // Every rank writes its own file at once; no data moves between ranks.
  std::string error;
  try {
    const std::string file = (plan.tmp / rank_file_name(rank)).string();
    detail::call_save_hook(root, "write", file);
    RankSnapshot snap;
    {
      detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint snapshot"); });
      snap = take_snapshot(root, optimizer, state, at.local_rank, at.local_world,
                           /*stager=*/nullptr);
      snap.rank = rank;
      snap.world = world;
      snap.stages = at.stages;
      snap.stage = at.stage;
    }
    detail::trace::Scope s("checkpoint",
                           []() { return std::string("checkpoint write rank file"); });
    write_snapshot(file, snap);
  } catch (const std::exception& e) {
    error = e.what();
  }
  {
    detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint agree"); });
    agree_or_abandon(pg, plan, fn, dir, error);
  }
  detail::trace::Scope publishing("checkpoint", []() { return std::string("checkpoint publish"); });
  rank0_tries(pg, std::string(fn) + ": publishing " + plan.final_dir.string(), [&] {
    detail::call_save_hook(root, "publish", plan.final_dir.string());
    publish(plan, options.keep_last);
  });
  if (options.verbose && rank == 0) report_saved(plan, world, t0, "");
  return plan.final_dir.string();
}

}  // namespace
}  // namespace ckpt

std::string ckpt::save_sharded_checkpoint(const std::string& dir, const ShardedModel& root,
                                          torch::optim::Optimizer* optimizer,
                                          const ckpt::TrainingState& state,
                                          const ckpt::SaveOptions& options) {
  const ProcessGroup& pg = root.sharding_options().process_group;
  return ckpt::save_sync(dir, root, optimizer, state, options, {&pg, pg.rank(), pg.size()},
                         "save_sharded_checkpoint");
}

std::string ckpt::save_sharded_checkpoint(const std::string& dir, const PipelinedModel& model,
                                          torch::optim::Optimizer* optimizer,
                                          const ckpt::TrainingState& state,
                                          const ckpt::SaveOptions& options) {
  const ProcessGroup& stage = model.stage_group();
  return ckpt::save_sync(
      dir, model.stage_model(), optimizer, state, options,
      {&model.world(), stage.rank(), stage.size(), model.stages(), model.stage()},
      "save_sharded_checkpoint");
}

namespace ckpt {
namespace {

std::shared_ptr<AsyncSaveJob> save_async(const std::string& dir, const ShardedModel& root,
                                         torch::optim::Optimizer* optimizer,
                                         const ckpt::TrainingState& state,
                                         const ckpt::SaveOptions& options, const Placement& at,
                                         const char* fn) {
  detail::trace::Scope span("checkpoint",
                            []() { return std::string("checkpoint save (async: staging)"); });
  check_save_args(state, options, fn);
  const ProcessGroup& pg = *at.job;
  const int rank = pg.rank(), world = pg.size();
  settle_previous(pg, fn);
  const SavePlan plan = plan_save(dir, state.step, pg, fn);
  // The copy is made on every rank before any rank goes on training: a rank that fails
  // here (out of host memory, say) fails the call everywhere, and nothing is written.
  // The last save's buffers are given to the stager; what it does not use is freed with it.
  std::string error;
  RankSnapshot snap;
  {
    Stager stager(root, std::exchange(detail::checkpoint_staging_pool(root), {}),
                  options.background_staging);
    try {
      snap = take_snapshot(root, optimizer, state, at.local_rank, at.local_world, &stager);
      snap.rank = rank;
      snap.world = world;
      snap.stages = at.stages;
      snap.stage = at.stage;
    } catch (const std::exception& e) {
      error = e.what();
      snap = RankSnapshot();
      stager.forget_used();
    }
  }
  try {
    agree_or_abandon(pg, plan, fn, dir, error);
  } catch (...) {  // another rank failed: what this rank staged is kept, or freed, as after a save
    if (options.keep_staging) {
      detail::checkpoint_staging_pool(root) = std::move(snap.staged);
    } else {
      detail::account_checkpoint_staging(root, -snap.staged_bytes);
    }
    throw;
  }
  // Note [Background staging]: every backward from here on waits for the copies left.
  if (!snap.pending.empty()) detail::set_shard_change_barrier(root, &wait_for_staging);
  return start_async_save(root, plan, std::move(snap), rank, world, pg.timeout_s(), options);
}

}  // namespace
}  // namespace ckpt

ckpt::AsyncSave ckpt::save_sharded_checkpoint_async(const std::string& dir,
                                                    const ShardedModel& root,
                                                    torch::optim::Optimizer* optimizer,
                                                    const ckpt::TrainingState& state,
                                                    const ckpt::SaveOptions& options) {
  const ProcessGroup& pg = root.sharding_options().process_group;
  return ckpt::AsyncSave(ckpt::save_async(dir, root, optimizer, state, options,
                                          {&pg, pg.rank(), pg.size()},
                                          "save_sharded_checkpoint_async"));
}

ckpt::AsyncSave ckpt::save_sharded_checkpoint_async(const std::string& dir,
                                                    const PipelinedModel& model,
                                                    torch::optim::Optimizer* optimizer,
                                                    const ckpt::TrainingState& state,
                                                    const ckpt::SaveOptions& options) {
  // Note [Pipelined checkpoints]: the files of the synchronous save, staged on every rank.
  const ProcessGroup& stage = model.stage_group();
  return ckpt::AsyncSave(
      ckpt::save_async(dir, model.stage_model(), optimizer, state, options,
                       {&model.world(), stage.rank(), stage.size(), model.stages(), model.stage()},
                       "save_sharded_checkpoint_async"));
}

}  // namespace fsdp
