// Consolidated and safetensors exports of a pipelined model (include/fsdp/checkpoint.h).
#include "../agree.h"
#include "trace/trace.h"

#include <fsdp/checkpoint.h>
#include <fsdp/pipeline.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <future>
#include <iostream>
#include <string>
#include <system_error>

namespace fs = std::filesystem;

namespace fsdp {
namespace {

// Note [Pipelined exports]
// A stage holds its own parameters and knows nothing of the other stages' (their flat
// tables, shapes, names), so no rank can gather the whole model as the live exports do.
// The export goes through a sharded checkpoint instead: every rank saves its stage
// (save_sharded_checkpoint(PipelinedModel): parallel writes, nothing moved between ranks),
// then job rank 0 consolidates it offline, one parameter at a time (consolidate_checkpoint,
// which writes what the live exports write from the model unpipelined: the checkpoint's
// flats are in the model's order, stage after stage). The temporary checkpoint sits beside
// the output, as `out`.stages.tmp (every rank must see it, as for a checkpoint
// directory), and is removed whether the export succeeded or not. Rank 0 consolidates on
// a thread while the ranks ask it, a second at a time, whether it is done (rank0_runs).

std::string stages_dir(const std::string& out) {
  fs::path p = fs::path(out).lexically_normal();
  while (!p.empty() && !p.has_filename() && p.parent_path() != p)
    p = p.parent_path();  // "dir/" names dir
  return p.string() + ".stages.tmp";
}

// Job rank 0 runs `fn` on a thread of its own while every rank asks it, about once a
// second, whether it has finished: no collective waits for the whole consolidation, which
// on a large model outlasts the group's timeout. Then every rank throws alike if it failed.
void rank0_runs(const ProcessGroup& job, const std::string& what, const std::function<void()>& fn) {
  std::future<void> work;
  if (job.rank() == 0) work = std::async(std::launch::async, fn);
  for (;;) {
    const bool done =
        job.rank() == 0 && work.wait_for(std::chrono::seconds(1)) == std::future_status::ready;
    at::Tensor flag = at::full({1}, done ? 1.0f : 0.0f);
    job.broadcast(flag, 0);
    if (flag.item<float>() != 0) break;
  }
  ckpt::rank0_tries(job, what, [&] { work.get(); });  // its error, on every rank alike
}

void remove_quietly(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

void through_checkpoint(const std::string& out, const PipelinedModel& model,
                        torch::optim::Optimizer* optimizer, const ckpt::TrainingState& state,
                        const char* fn,
                        const std::function<void(const std::string&)>& consolidate) {
  const ProcessGroup& job = model.world();
  const std::string tmp = stages_dir(out);
  ckpt::rank0_tries(job, std::string(fn) + ": clearing " + tmp, [&] { fs::remove_all(tmp); });
  std::string saved;
  try {
    saved = ckpt::save_sharded_checkpoint(tmp, model, optimizer, state);
  } catch (...) {  // every rank throws alike
    if (job.rank() == 0) remove_quietly(tmp);
    throw;
  }
  rank0_runs(job, std::string(fn) + " to " + out, [&] {
    struct Cleanup {
      const std::string& dir;
      ~Cleanup() { remove_quietly(dir); }
    } cleanup{tmp};
    consolidate(saved);
  });
}

}  // namespace

void ckpt::export_consolidated(const std::string& file, const PipelinedModel& model,
                               torch::optim::Optimizer* optimizer, const ckpt::TrainingState& state,
                               const ckpt::ExportOptions& options) {
  detail::trace::Scope span("checkpoint", []() { return std::string("consolidated export"); });
  ckpt::ConsolidateOptions co;
  co.dtype = options.dtype;
  co.with_optimizer = options.with_optimizer;
  if (options.verbose) {
    co.progress = [](size_t done, size_t total, const std::string& fqn) {
      std::cout << "[fsdp] consolidated export: " << done << "/" << total << " " << fqn
                << std::endl;
    };
  }
  through_checkpoint(
      file, model, options.with_optimizer ? optimizer : nullptr, state, "export_consolidated",
      [&](const std::string& saved) { ckpt::consolidate_checkpoint(saved, file, co); });
}

void ckpt::export_safetensors(const std::string& dir, const PipelinedModel& model,
                              const ckpt::TrainingState& state,
                              const ckpt::SafetensorsOptions& options) {
  detail::trace::Scope span("checkpoint", []() { return std::string("safetensors export"); });
  ckpt::ConsolidateOptions co;
  co.dtype = options.dtype;
  co.format = ckpt::WeightsFormat::kSafetensors;
  co.max_shard_size = options.max_shard_size;
  co.name_for = options.name_for;
  co.transpose = options.transpose;
  if (options.verbose) {
    co.progress = [](size_t done, size_t total, const std::string& fqn) {
      std::cout << "[fsdp] safetensors export: " << done << "/" << total << " " << fqn << std::endl;
    };
  }
  through_checkpoint(
      dir, model, nullptr, state, "export_safetensors",
      [&](const std::string& saved) { ckpt::consolidate_checkpoint(saved, dir, co); });
}

}  // namespace fsdp
