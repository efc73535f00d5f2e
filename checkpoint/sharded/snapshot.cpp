#include "snapshot.h"

#include "../tensor_io.h"
#include "optim_state.h"
#include "rank_parts.h"
#include "trace/trace.h"

#include <cstdlib>
#include <exception>
#include <thread>

namespace fsdp::ckpt {

// Note [Rank snapshot]
// Everything one rank's file holds, read from the live model in one pass, then written
// by write_snapshot. A synchronous save takes it as views of the live tensors and writes
// at once; an asynchronous one copies each tensor into host staging memory (pinned when
// it comes from a GPU), so that training may change the originals while a thread writes.
// Either way the file is the same. An optimizer that holds a shard as several views
// (fsdp::ShardParamGroups) holds its state as several tensors: a synchronous save writes
// them as they are, one dataset from its parts, instead of putting a shard-sized copy
// together first (0.72 s of a 1.2 GB save, in fresh pages); an asynchronous one puts them
// together in its staging buffer, which it copies into anyway.

// Note [Staging reuse]
// An asynchronous save blocks training while it copies the rank's state into host
// memory. Into fresh memory that copy is mostly the kernel handing out and clearing
// pages: 1 GiB took 0.3-0.6 s here against 0.07 s into memory already touched. So the
// buffers stay with the model after the save (SaveOptions::keep_staging, on by default;
// still counted in MemoryStats::checkpoint_staging), and the next save copies into the
// one that held the same thing ("flat_3/param", "flat_3/optim/exp_avg", "buffer/<fqn>")
// when its shape and dtype still match. Buffers the next save does not use are freed,
// so the memory kept never exceeds one snapshot. release_checkpoint_staging frees them.
int64_t staged_bytes(const std::map<std::string, at::Tensor>& buffers) {
  int64_t n = 0;
  for (const auto& [key, t] : buffers) n += static_cast<int64_t>(t.nbytes());
  return n;
}

namespace {

// Note [Staging copy]
// What training waits for in an asynchronous save is the copy into staging memory, and
// that copy is memory-bound: 1.2 GB took 0.094 s on one thread here and 0.073 s on two.
// Training is blocked meanwhile, so large copies are split over this process's share of
// the machine's cores (its hardware threads divided by LOCAL_WORLD_SIZE, the ranks
// sharing the machine), whatever OMP_NUM_THREADS says for compute.
int staging_threads() {
  static const int n = [] {
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    const int ranks = local ? std::max(1, std::atoi(local)) : 1;
    return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
  }();
  return n;
}

void copy_staged(const at::Tensor& dst, const at::Tensor& src) {
  constexpr int64_t kSplitBytes = int64_t{8} << 20;  // a piece per thread at least this large
  const int n =
      std::min<int64_t>(staging_threads(), static_cast<int64_t>(dst.nbytes()) / kSplitBytes);
  if (n <= 1 || !src.is_cpu() || !src.is_contiguous() || !dst.is_contiguous() ||
      src.scalar_type() != dst.scalar_type()) {
    dst.copy_(src);
    return;
  }
  const at::Tensor d = dst.view({-1}), s = src.reshape({-1});
  const int64_t per = (d.numel() + n - 1) / n;
  std::vector<std::thread> others;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  auto part = [&](int i) {
    const int64_t a = std::min(d.numel(), i * per), b = std::min(d.numel(), a + per);
    try {
      if (b > a) d.narrow(0, a, b - a).copy_(s.narrow(0, a, b - a));
    } catch (...) {
      errors[static_cast<size_t>(i)] = std::current_exception();
    }
  };
  for (int i = 1; i < n; ++i) others.emplace_back(part, i);
  part(0);
  for (auto& t : others) t.join();
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace

at::Tensor Stager::buffer(const std::string& key, at::IntArrayRef sizes,
                          const at::TensorOptions& options, bool pinned) {
  detail::call_save_hook(model_, "stage", key);
  at::Tensor host;
  auto it = spare_.find(key);
  if (it != spare_.end() && it->second.sizes() == sizes &&
      it->second.scalar_type() == options.dtype().toScalarType()) {
    host = std::move(it->second);
    spare_.erase(it);
  } else {
    host = at::empty(sizes, options.device(at::kCPU).pinned_memory(pinned));
    detail::account_checkpoint_staging(model_, static_cast<int64_t>(host.nbytes()));
  }
  used_bytes_ += static_cast<int64_t>(host.nbytes());
  return host;
}

void Stager::copy_or_defer(const at::Tensor& dst, const at::Tensor& src, bool may_defer,
                           const std::string& what, const std::string& who, RankSnapshot& snap) {
  if (defer_ && may_defer && src.is_cpu()) {
    snap.pending.push_back(
        {dst, src, src._version(), who.empty() ? what : who + " (" + what + ")"});
  } else {
    copy_staged(dst, src);
  }
}

std::string finish_staging(RankSnapshot& snap) {
  detail::trace::Scope span("checkpoint",
                            []() { return std::string("checkpoint staging (background)"); });
  std::vector<RankSnapshot::PendingCopy> pending = std::move(snap.pending);
  snap.pending.clear();
  for (const auto& c : pending) copy_staged(c.dst, c.src);
  for (const auto& c : pending) {
    if (c.src._version() != c.version) {
      return c.what +
             " changed after the asynchronous save's call, before its background copy was "
             "done (SaveOptions::background_staging), so the file would not hold the state "
             "of the call. Nothing may change the shards or the optimizer state before the "
             "next backward ends or AsyncSave::wait_staged() returns; call it before an "
             "optimizer step with no backward before it, or an edit by hand";
    }
  }
  return "";
}

at::Tensor Stager::stage(const std::string& what, const at::Tensor& t, RankSnapshot& snap,
                         bool may_defer, const std::string& who) {
  const bool pinned = t.is_cuda();
  const std::string key = pinned ? what + "@pinned" : what;
  at::Tensor host = buffer(key, t.sizes(), t.options(), pinned);
  copy_or_defer(host, t, may_defer, what, who, snap);
  snap.staged_bytes += static_cast<int64_t>(host.nbytes());
  snap.staged.emplace(key, host);
  return host;
}

at::Tensor Stager::stage_parts(const std::string& what, const Parts& parts, int64_t length,
                               const at::TensorOptions& options, RankSnapshot& snap, bool may_defer,
                               const std::string& who) {
  const bool pinned = options.device().is_cuda();
  const std::string key = pinned ? what + "@pinned" : what;
  at::Tensor host = buffer(key, {length}, options, pinned);
  int64_t pos = 0;
  for (const auto& [off, t] : parts) {
    if (off > pos) host.narrow(0, pos, off - pos).zero_();
    copy_or_defer(host.narrow(0, off, t.numel()), t, may_defer, what, who, snap);
    pos = off + t.numel();
  }
  if (pos < length) host.narrow(0, pos, length - pos).zero_();
  snap.staged_bytes += static_cast<int64_t>(host.nbytes());
  snap.staged.emplace(key, host);
  return host;
}

void Stager::free_spare() {
  detail::account_checkpoint_staging(model_, -staged_bytes(spare_));
  spare_.clear();
}

void Stager::forget_used() {
  detail::account_checkpoint_staging(model_, -used_bytes_);
  used_bytes_ = 0;
}

RankSnapshot take_snapshot(const ShardedModel& root, torch::optim::Optimizer* opt,
                           const ckpt::TrainingState& state, int rank, int world, Stager* stager) {
  RankSnapshot snap;
  auto keep = [&](const std::string& what, const at::Tensor& t) {
    return stager ? stager->stage(what, t, snap) : t;
  };
  auto who = [](const LocalShard& ls) {
    return ls.info.unit_fqn.empty() ? std::string("the root's shard")
                                    : "the shard of unit '" + ls.info.unit_fqn + "'";
  };
  at::NoGradGuard no_grad;
  const auto shards = detail::local_shards(root);
  snap.rank = rank;
  snap.world = world;
  snap.shard_group_size = shards.empty() ? 1 : shards[0].shard_group_size;
  snap.optimizer_kind = opt ? optimizer_kind(*opt) : "none";
  snap.state = state;
  for (const LocalShard& ls : shards) {
    RankSnapshot::Flat f;
    f.info = ls.info;
    f.begin = ls.begin;
    // A replica (HYBRID_SHARD, NO_SHARD) writes the table but no elements.
    f.length = ls.writer ? ls.length : 0;
    TORCH_CHECK(!ls.writer || ls.shard_rank == rank, "internal: writer rank ", rank,
                " holds chunk ", ls.shard_rank);
    for (const auto& p : ls.params)
      f.table.push_back(TableEntry{p.fqn, p.offset, p.numel, p.shape});
    const std::string flat = flat_group(snap.flats.size());
    // Files hold fp32 whatever the shards' dtype (pure bf16 widens exactly).
    auto fp32 = [](const at::Tensor& t) {
      return t.scalar_type() == at::kFloat ? t : t.to(at::kFloat);
    };
    // Deferred only when the file's fp32 is the shard itself: a conversion is the copy.
    const bool fp32_shard = ls.shard.scalar_type() == at::kFloat;
    const at::Tensor param = fp32(ls.shard.detach().narrow(0, 0, f.length));
    f.param = stager ? stager->stage(flat + "/param", param, snap, fp32_shard, who(ls)) : param;
    if (opt && ls.info.requires_grad) {
      const int64_t group = shard_group(*opt, ls.shard);
      // (A rank holding only padding of a shard has no view of it: ShardParamGroups.)
      check_optimizer_holds(static_cast<int>(group), ls.length, "save", ls.info.unit_fqn);
      const ShardStateParts st = get_shard_state_parts(*opt, ls.shard);
      if (!st.states.empty()) {
        f.has_optim = true;
        f.optim_step = st.step;
        f.optim_group = std::max<int64_t>(group, 0);
        for (const auto& [name, pieces] : st.states) {
          // The parts inside [0, length): the rest is the shard's padding.
          Parts parts;
          bool fp32_state = true;
          for (const auto& [off, t] : pieces) {
            const int64_t n = std::min(t.numel(), f.length - off);
            fp32_state = fp32_state && t.scalar_type() == at::kFloat;
            if (n > 0) parts.emplace_back(off, fp32(t.narrow(0, 0, n)));
          }
          if (stager) {
            const auto options =
                parts.empty() ? at::TensorOptions(at::kFloat) : parts.front().second.options();
            parts = {
                {0, stager->stage_parts(flat + "/optim/" + name, parts, f.length, options, snap,
                                        fp32_state, "the optimizer state of " + who(ls))}};
          }
          f.optim.emplace_back(name, std::move(parts));
        }
      }
    }
    snap.flats.push_back(std::move(f));
  }
  if (opt) {
    for (size_t g = 0; g < opt->param_groups().size(); ++g)
      snap.groups.push_back(group_hparams(*opt, g));
  }
  snap.rng = capture_rng();
  snap.has_buffers = rank == 0;
  if (snap.has_buffers) {
    for (const auto& [name, b] : named_buffers_clean(root.as_module())) {
      snap.buffers.emplace_back(name, keep("buffer/" + name, b));
    }
  }
  return snap;
}

void write_snapshot(const std::string& path, const RankSnapshot& snap) {
  h5::Obj f = h5::create_file(path);
  h5::set_attr(f, "format", std::string(kShardedFormat));
  h5::set_attr(f, "format_version",
               snap.stages > 1 ? ckpt::kCheckpointFormatPipelinedVersion
                               : ckpt::kCheckpointFormatBaseVersion);
  h5::set_attr(f, "world_size", int64_t{snap.world});
  h5::set_attr(f, "rank", int64_t{snap.rank});
  if (snap.stages > 1) {
    h5::set_attr(f, "pipeline_stages", int64_t{snap.stages});
    h5::set_attr(f, "pipeline_stage", int64_t{snap.stage});
  }
  h5::set_attr(f, "step", snap.state.step);
  h5::set_attr(f, "shard_group_size", snap.shard_group_size);
  h5::set_attr(f, "num_flats", static_cast<int64_t>(snap.flats.size()));
  h5::set_attr(f, "optimizer", snap.optimizer_kind);

  // The flats' large datasets are written last, past the page cache (Note [Direct I/O]).
  h5::DirectDatasets direct;
  std::vector<at::Tensor> hold;
  h5::Obj flats = h5::create_group(f, "flats", path);
  for (size_t k = 0; k < snap.flats.size(); ++k) {
    const RankSnapshot::Flat& fl = snap.flats[k];
    const std::string where = path + ":/" + flat_group(k);
    h5::Obj g = h5::create_group(f, flat_group(k), path);
    h5::set_attr(g, "unit_fqn", fl.info.unit_fqn);
    h5::set_attr(g, "requires_grad", int64_t{fl.info.requires_grad ? 1 : 0});
    h5::set_attr(g, "numel", fl.info.numel);
    h5::set_attr(g, "shard_numel", fl.info.shard_numel);
    h5::set_attr(g, "begin", fl.begin);
    h5::set_attr(g, "length", fl.length);
    h5::set_attr(g, "param_dtype", dtype_name(fl.info.param_dtype));
    write_table(g, fl.table, where);
    write_tensor_direct(direct, hold, g, "param", fl.param, where);
    if (fl.has_optim) {
      h5::Obj og = h5::create_group(g, "optim", where);
      h5::set_attr(og, "step", fl.optim_step);
      h5::set_attr(og, "group", fl.optim_group);
      for (const auto& [name, parts] : fl.optim)
        write_parts_direct(direct, hold, og, name, parts, fl.length, where + "/optim");
    }
  }

  // The other parts, in the file's order (rank_parts.h).
  if (snap.optimizer_kind != "none") write_optimizer_groups(f, snap.groups, path);
  write_training_state(f, snap.state, path);
  write_rng(f, snap.rng, path);
  if (snap.has_buffers) write_buffers(f, snap.buffers, path);
  {
    detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint write data"); });
    direct.write_all(path);
  }
  detail::trace::Scope s("checkpoint", []() { return std::string("checkpoint fsync"); });
  h5::flush_and_sync(f, path);
}

}  // namespace fsdp::ckpt
