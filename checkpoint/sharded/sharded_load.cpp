// Loading a sharded checkpoint saved at any world size and under any wrap policy
// (include/fsdp/checkpoint.h; docs/design.md, "Checkpoints").
#include "../format/layout.h"
#include "../format/reshard_plan.h"
#include "../name_match.h"
#include "../tensor_io.h"
#include "async_save.h"
#include "optim_state.h"
#include "rank_parts.h"
#include "trace/trace.h"

#include <fsdp/checkpoint.h>
#include <fsdp/pipeline.h>
#include <fsdp/process_group.h>

#include "internal/checkpoint_view.h"

#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

// The optimizer is of the kind whose state the checkpoint holds.
void check_optimizer_kind(const ShardedReader& src, torch::optim::Optimizer& optimizer,
                          const std::string& what) {
  const std::string kind = optimizer_kind(optimizer);
  TORCH_CHECK(src.optimizer() != "none", what,
              " holds no optimizer state; pass nullptr as the optimizer "
              "to load only the model");
  TORCH_CHECK(src.optimizer() == kind, what, " holds ", src.optimizer(),
              " state but the optimizer is ", kind);
}

// Matches the model's parameter names against the checkpoint's before anything changes,
// so that a wrong checkpoint fails first: a shape mismatch always throws; missing and
// unexpected names go to `report` and throw under `strict`.
void match_names(const ShardedReader& src, const std::vector<LocalShard>& shards,
                 const std::string& what, bool strict, bool stage, ckpt::LoadReport& report) {
  std::set<std::string> model_names;
  std::vector<std::string> mismatched;
  for (const auto& ls : shards) {
    for (const auto& p : ls.params) {
      model_names.insert(p.fqn);
      auto it = src.by_fqn().find(p.fqn);
      if (it == src.by_fqn().end()) {
        report.missing.push_back(p.fqn);
        continue;
      }
      const auto& e = src.flats()[it->second.first].table[it->second.second];
      if (e.shape != p.shape) {
        mismatched.push_back(p.fqn + " (checkpoint " + describe_shape(e.shape) + ", model " +
                             describe_shape(p.shape) + ")");
      }
    }
  }
  // A pipeline stage (`stage`) holds part of the model: the checkpoint's other names are
  // the other stages'.
  for (const auto& [fqn, loc] : src.by_fqn()) {
    if (!model_names.count(fqn) && !stage) report.unexpected.push_back(fqn);
  }
  check_shapes_match(what, mismatched);
  report_mismatch(what, report.missing, report.unexpected, strict);
}

// The pieces of this rank's [begin, begin + length) that the checkpoint has
// (reshard_plan.h).
std::vector<Piece> plan_shard_pieces(const ShardedReader& src, const LocalShard& ls) {
  std::vector<TargetParam> targets;
  for (const auto& p : ls.params) targets.push_back(TargetParam{p.fqn, p.offset, p.numel});
  return plan_shard_read(
      ls.begin, ls.length, targets, [&](const std::string& fqn) -> std::optional<SourceParam> {
        auto it = src.by_fqn().find(fqn);
        if (it == src.by_fqn().end()) return std::nullopt;
        return SourceParam{it->second.first,
                           src.flats()[it->second.first].table[it->second.second].offset};
      });
}

// Reads `dataset` ("param", "optim/exp_avg") of the pieces into `dst`, a shard-sized
// fp32 tensor on any device, and zeroes its padding past `length`.
void fill_from_pieces(ShardedReader& src, const std::vector<Piece>& pieces, int64_t length,
                      const at::Tensor& dst, const std::string& dataset) {
  // fp32 from the file; a shard of another dtype (pure bf16) is converted once filled.
  at::Tensor buf = dst.device().is_cpu() && dst.is_contiguous() && dst.scalar_type() == at::kFloat
                       ? dst
                       : at::empty({dst.numel()}, dst.options().device(at::kCPU).dtype(at::kFloat));
  float* out = buf.data_ptr<float>();
  for (const auto& p : pieces) src.read(p.src_flat, dataset, p.src, p.n, out + p.dst);
  if (length < buf.numel()) buf.narrow(0, length, buf.numel() - length).zero_();
  if (!buf.is_same(dst)) dst.copy_(buf);
}

// The optimizer state of one trainable shard, over the same pieces as its parameters.
void load_shard_optim_state(ShardedReader& src, const LocalShard& ls,
                            const std::vector<Piece>& pieces, torch::optim::Optimizer& optimizer) {
  check_optimizer_holds(shard_group(optimizer, ls.shard), ls.length, "load", ls.info.unit_fqn);
  // The state names and step come from the first source flat this shard reads.
  if (pieces.empty()) return;
  const SourceFlat& sf = src.flats()[pieces.front().src_flat];
  if (sf.optim_states.empty()) return;  // saved before the first optimizer step
  ParamState st;
  const size_t k = pieces.front().src_flat;
  const int r = src.flat_file(k);
  h5::Obj og = h5::open_group(src.file(r), src.flat_path(k) + "/optim", src.file_path(r));
  st.step = h5::get_int(og, "step", src.file_path(r));
  // Uninitialised when the pieces cover the shard (the fill zeroes the padding), so each
  // byte is touched once, by the read; zeros where a parameter is missing from the file.
  for (const auto& name : sf.optim_states) {
    at::Tensor t = covered(pieces) == ls.length
                       ? at::empty_like(ls.shard.detach(), at::MemoryFormat::Contiguous)
                       : at::zeros_like(ls.shard.detach(), at::MemoryFormat::Contiguous);
    fill_from_pieces(src, pieces, ls.length, t, "optim/" + name);
    st.tensors.emplace_back(name, t);
  }
  set_shard_state(optimizer, ls.shard, std::move(st));
}

// One local shard: its parameters and, with an optimizer, their state.
void load_shard(ShardedReader& src, const LocalShard& ls, torch::optim::Optimizer* optimizer) {
  const std::vector<Piece> pieces = plan_shard_pieces(src, ls);
  fill_from_pieces(src, pieces, ls.length, ls.shard.detach(), "param");
  ls.shard.unsafeGetTensorImpl()->bump_version();  // written through a raw pointer
  if (optimizer && ls.info.requires_grad) load_shard_optim_state(src, ls, pieces, *optimizer);
}

// The other parts (rank_parts.h). Buffers are replicated: every rank reads rank 0's
// copy, as it does the optimizer's groups and the training state. RNG streams belong to
// ranks: they are restored only when the ranks are the same.
void load_rank_parts(ShardedReader& src, const ShardedModel& root,
                     torch::optim::Optimizer* optimizer, ckpt::TrainingState* state,
                     const ckpt::LoadOptions& options, const ProcessGroup& job, bool stage,
                     const std::string& what, ckpt::LoadReport& report) {
  hid_t f0 = src.file(0);
  const std::string p0 = src.file_path(0);
  if (src.parts() == 1 && !stage) {
    read_buffers(f0, p0, root.as_module(), report.missing, report.unexpected);
  } else {
    // Each stage's buffers are in its first file: a buffer is missing when no part has it.
    std::map<std::string, int> missed;
    for (int part = 0; part < src.parts(); ++part) {
      std::vector<std::string> missing, unexpected;
      const int r = src.part_first(part);
      read_buffers(src.file(r), src.file_path(r), root.as_module(), missing, unexpected);
      for (const auto& n : missing) ++missed[n];
    }
    for (const auto& [n, count] : missed)
      if (count == src.parts()) report.missing.push_back(n);
  }
  report_mismatch(what, report.missing, report.unexpected, options.strict);
  if (optimizer) read_optimizer_groups(f0, p0, *optimizer, what);
  if (state) *state = read_training_state(f0, p0);
  if (options.restore_rng && src.world_size() == job.size())
    restore_rng(src.file(job.rank()), src.file_path(job.rank()));
}

ckpt::LoadReport load(const std::string& path, ShardedModel& root,
                      torch::optim::Optimizer* optimizer, ckpt::TrainingState* state,
                      const ckpt::LoadOptions& options, const ProcessGroup& job, bool stage) {
  detail::trace::Scope span("checkpoint", []() { return std::string("checkpoint load"); });
  wait_for_async_save();  // the save just made is complete before anything reads
  std::optional<detail::trace::Scope> opening;
  opening.emplace("checkpoint", []() { return std::string("checkpoint read metadata"); });
  ShardedReader src(path);
  ckpt::LoadReport report;
  report.path = src.dir();
  const std::string what = "checkpoint " + src.dir();
  if (optimizer) check_optimizer_kind(src, *optimizer, what);
  const std::vector<LocalShard> shards = detail::local_shards(root);
  {
    detail::trace::Scope m("checkpoint", []() { return std::string("checkpoint match names"); });
    match_names(src, shards, what, options.strict, stage, report);
  }
  opening.reset();
  at::NoGradGuard no_grad;
  {
    detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint read shards"); });
    for (const LocalShard& ls : shards) load_shard(src, ls, optimizer);
  }
  detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint read rank parts"); });
  load_rank_parts(src, root, optimizer, state, options, job, stage, what, report);
  return report;
}

}  // namespace
}  // namespace ckpt

std::optional<std::string> ckpt::latest_checkpoint(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "latest")) return std::nullopt;
  return ckpt::resolve_checkpoint_dir(dir);
}

ckpt::LoadReport ckpt::load_sharded_checkpoint(const std::string& path, ShardedModel& root,
                                               torch::optim::Optimizer* optimizer,
                                               ckpt::TrainingState* state,
                                               const ckpt::LoadOptions& options) {
  return ckpt::load(path, root, optimizer, state, options, root.sharding_options().process_group,
                    /*stage=*/false);
}

ckpt::LoadReport ckpt::load_sharded_checkpoint(const std::string& path, PipelinedModel& model,
                                               torch::optim::Optimizer* optimizer,
                                               ckpt::TrainingState* state,
                                               const ckpt::LoadOptions& options) {
  // Note [Pipelined checkpoints] (sharded_save.cpp): each stage reads its own names.
  return ckpt::load(path, model.stage_model(), optimizer, state, options, model.world(),
                    /*stage=*/model.stages() > 1);
}

}  // namespace fsdp
