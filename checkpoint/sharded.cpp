// Sharded checkpoints: parallel save, exact resume, resharding across world sizes and
// wrap policies (layout in layout.h).
#include "optim_state.h"
#include "tensor_io.h"

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include "internal.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <set>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

void fsync_path(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// Writes `text` to `target` atomically: a temporary file, fsync, rename, fsync the directory.
void write_atomically(const fs::path& target, const std::string& text) {
  const fs::path tmp = target.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    TORCH_CHECK(out.good(), "cannot write ", tmp.string(), ": is the disk full?");
  }
  fsync_path(tmp);
  fs::rename(tmp, target);
  fsync_path(target.parent_path());
}

// step_00000100 or step_00000100_2 (a second save at the same step): (step, version).
std::optional<std::pair<int64_t, int64_t>> parse_checkpoint_name(const std::string& name) {
  static const std::regex re("step_([0-9]+)(?:_([0-9]+))?");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return std::make_pair(std::stoll(m[1].str()), m[2].matched ? std::stoll(m[2].str()) : int64_t{1});
}

at::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::Tensor(gen.get_state());
}

void write_rank_file(const std::string& path, const ShardedModel& root, torch::optim::Optimizer* opt,
                     const TrainingState& state, int rank, int world) {
  h5::Obj f = h5::create_file(path);
  const auto shards = detail::local_shards(root);
  const std::string kind = opt ? optimizer_kind(*opt) : "none";
  h5::set_attr(f, "format", std::string(kShardedFormat));
  h5::set_attr(f, "format_version", kCheckpointFormatVersion);
  h5::set_attr(f, "world_size", int64_t{world});
  h5::set_attr(f, "rank", int64_t{rank});
  h5::set_attr(f, "step", state.step);
  h5::set_attr(f, "shard_group_size", int64_t{shards.empty() ? 1 : shards[0].shard_group_size});
  h5::set_attr(f, "num_flats", static_cast<int64_t>(shards.size()));
  h5::set_attr(f, "optimizer", kind);

  h5::Obj flats = h5::create_group(f, "flats", path);
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    const std::string where = path + ":/" + flat_group(k);
    h5::Obj g = h5::create_group(f, flat_group(k), path);
    // A replica (HYBRID_SHARD, NO_SHARD) writes the table but no elements.
    const int64_t length = ls.writer ? ls.length : 0;
    TORCH_CHECK(!ls.writer || ls.shard_rank == rank, "internal: writer rank ", rank, " holds chunk ",
                ls.shard_rank);
    h5::set_attr(g, "unit_fqn", ls.info.unit_fqn);
    h5::set_attr(g, "requires_grad", int64_t{ls.info.requires_grad ? 1 : 0});
    h5::set_attr(g, "numel", ls.info.numel);
    h5::set_attr(g, "shard_numel", ls.info.shard_numel);
    h5::set_attr(g, "begin", ls.begin);
    h5::set_attr(g, "length", length);
    h5::set_attr(g, "param_dtype", dtype_name(ls.info.param_dtype));
    std::vector<TableEntry> table;
    for (const auto& p : ls.params) table.push_back(TableEntry{p.fqn, p.offset, p.numel, p.shape});
    write_table(g, table, where);
    write_tensor(g, "param", ls.shard.narrow(0, 0, length), h5::Elem::kF32, where);
    if (opt && ls.info.requires_grad) {
      TORCH_CHECK(find_param(*opt, ls.shard).first >= 0, "save: the optimizer does not hold the shard of unit '",
                  ls.info.unit_fqn, "'. Build it from model.sharded_parameters().");
      ParamState st = get_param_state(*opt, ls.shard);
      if (!st.tensors.empty()) {
        h5::Obj og = h5::create_group(g, "optim", where);
        h5::set_attr(og, "step", st.step);
        h5::set_attr(og, "group", int64_t{find_param(*opt, ls.shard).first});
        for (const auto& [name, t] : st.tensors) {
          write_tensor(og, name, t.reshape({-1}).narrow(0, 0, length), h5::Elem::kF32, where + "/optim");
        }
      }
    }
  }

  if (opt) {
    h5::Obj og = h5::create_group(f, "optimizer", path);
    h5::set_attr(og, "num_groups", static_cast<int64_t>(opt->param_groups().size()));
    for (size_t g = 0; g < opt->param_groups().size(); ++g) {
      h5::Obj gg = h5::create_group(og, "group_" + std::to_string(g), path);
      for (const auto& [k, v] : group_hparams(*opt, g)) h5::set_attr(gg, k, v);
    }
  }

  h5::Obj sg = h5::create_group(f, "state", path);
  h5::set_attr(sg, "step", state.step);
  h5::Obj sched = h5::create_group(sg, "scheduler", path);
  for (const auto& [k, v] : state.scheduler) h5::set_attr(sched, k, v);
  h5::Obj extra = h5::create_group(sg, "extra", path);
  for (const auto& [k, v] : state.extra) h5::set_attr(extra, k, v);
  if (state.loss_scaler) {
    const auto& ls = *state.loss_scaler;
    h5::Obj lg = h5::create_group(sg, "loss_scaler", path);
    h5::set_attr(lg, "scale", ls.scale);
    h5::set_attr(lg, "iteration", ls.iteration);
    h5::set_attr(lg, "last_overflow_iteration", ls.last_overflow_iteration);
    h5::set_attr(lg, "hysteresis_left", int64_t{ls.hysteresis_left});
    h5::set_attr(lg, "skipped_steps", ls.skipped_steps);
  }
  h5::Obj ma = h5::create_group(f, "model_attrs", path);
  for (const auto& [k, v] : state.model_attrs) h5::set_attr(ma, k, v);

  h5::Obj rng = h5::create_group(f, "rng", path);
  write_tensor(rng, "cpu", generator_state(at::detail::getDefaultCPUGenerator()), h5::Elem::kU8, path);
  if (torch::cuda::is_available()) {
    for (int64_t i = 0; i < static_cast<int64_t>(torch::cuda::device_count()); ++i) {
      auto gen = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      write_tensor(rng, "cuda_" + std::to_string(i), generator_state(gen), h5::Elem::kU8, path);
    }
  }
  if (rank == 0) {
    h5::Obj bg = h5::create_group(f, "buffers", path);
    for (const auto& [name, b] : named_buffers_clean(root.as_module())) {
      write_tensor(bg, name, b, storage_elem(b.scalar_type()), path + ":/buffers");
    }
  }
  h5::flush_and_sync(f, path);
}

// Where the target elements come from: target shard position, source flat and position.
struct Piece {
  int64_t dst = 0;
  size_t src_flat = 0;
  int64_t src = 0;
  int64_t n = 0;
};

// Every name, as the strict-load error promises.
std::string list(const std::vector<std::string>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + v[i];
  return s + " (" + std::to_string(v.size()) + ")";
}

}  // namespace

// Shared with consolidated.cpp: the strict-mode error.
void report_mismatch(const std::string& what, const std::vector<std::string>& missing,
                     const std::vector<std::string>& unexpected, bool strict) {
  if (!strict || (missing.empty() && unexpected.empty())) return;
  std::string msg = what + " does not match this model.";
  if (!missing.empty()) msg += " Missing from the checkpoint: " + list(missing) + ".";
  if (!unexpected.empty()) msg += " Not in the model: " + list(unexpected) + ".";
  msg += " Was it saved from another model? Load with LoadOptions::strict = false to take the "
         "parameters that match.";
  TORCH_CHECK(false, msg);
}


}  // namespace ckpt

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "latest")) return std::nullopt;
  return ckpt::resolve_checkpoint_dir(dir);
}

std::string save_sharded_checkpoint(const std::string& dir, const ShardedModel& root, torch::optim::Optimizer* optimizer,
                                    const TrainingState& state, const SaveOptions& options) {
  using namespace ckpt;
  TORCH_CHECK(state.step >= 0, "save_sharded_checkpoint: step ", state.step, " is negative");
  TORCH_CHECK(options.keep_last >= 0, "save_sharded_checkpoint: keep_last ", options.keep_last,
              " is negative; use 0 to keep every checkpoint");
  const ProcessGroup& pg = root.sharding_options().process_group;
  const int rank = pg.rank(), world = pg.size();
  const auto t0 = std::chrono::steady_clock::now();

  // Rank 0 picks the name (a new one if this step was saved before) and makes the
  // temporary directory; everyone learns the name's version from a broadcast.
  const fs::path base(dir);
  char name_buf[64];
  std::snprintf(name_buf, sizeof(name_buf), "step_%08lld", static_cast<long long>(state.step));
  std::string name = name_buf;
  at::Tensor version = at::zeros({1}, at::kLong);
  std::string error;
  if (rank == 0) {
    try {
      fs::create_directories(base);
      int64_t v = 1;
      while (fs::exists(base / (v == 1 ? name : name + "_" + std::to_string(v)))) ++v;
      version[0] = v;
      const std::string chosen = v == 1 ? name : name + "_" + std::to_string(v);
      const fs::path tmp = base / (".tmp-" + chosen);
      fs::remove_all(tmp);  // left by a save that was killed
      fs::create_directories(tmp);
    } catch (const std::exception& e) {
      error = e.what();
      version[0] = -1;
    }
  }
  pg.broadcast(version, 0);
  TORCH_CHECK(version.item<int64_t>() > 0, "save_sharded_checkpoint: rank 0 cannot prepare ", dir,
              rank == 0 ? ": " + error : std::string(" (see rank 0's error)"));
  if (version.item<int64_t>() > 1) name += "_" + std::to_string(version.item<int64_t>());
  const fs::path tmp = base / (".tmp-" + name);
  const fs::path final_dir = base / name;

  // Every rank writes its own file at once; no data moves between ranks.
  at::Tensor failed = at::zeros({1}, at::kFloat);
  try {
    write_rank_file((tmp / rank_file_name(rank)).string(), root, optimizer, state, rank, world);
  } catch (const std::exception& e) {
    error = e.what();
    failed[0] = 1;
  }
  pg.all_reduce_max(failed);
  if (failed.item<float>() > 0) {
    if (rank == 0) {
      std::error_code ec;
      fs::remove_all(tmp, ec);
    }
    TORCH_CHECK(false, "save_sharded_checkpoint to ", dir, " failed",
                error.empty() ? std::string(" on another rank (see its error)") : ": " + error,
                ". The previous checkpoint is untouched.");
  }

  // Rank 0 publishes: rename the complete directory into place, then move `latest`.
  if (rank == 0) {
    try {
      fsync_path(tmp);
      fs::rename(tmp, final_dir);
      fsync_path(base);
      write_atomically(base / "latest", name + "\n");
      std::error_code ec;
      // Directories of saves that were killed, and checkpoints beyond keep_last.
      std::vector<std::pair<std::pair<int64_t, int64_t>, fs::path>> done;
      for (const auto& e : fs::directory_iterator(base)) {
        const std::string n = e.path().filename().string();
        if (n.rfind(".tmp-", 0) == 0 && e.path() != tmp) fs::remove_all(e.path(), ec);
        if (auto key = parse_checkpoint_name(n); key && e.is_directory()) done.emplace_back(*key, e.path());
      }
      if (options.keep_last > 0 && done.size() > static_cast<size_t>(options.keep_last)) {
        std::sort(done.begin(), done.end());
        for (size_t i = 0; i + options.keep_last < done.size(); ++i) {
          if (done[i].second != final_dir) fs::remove_all(done[i].second, ec);
        }
      }
    } catch (const std::exception& e) {
      error = e.what();
      failed[0] = 1;
    }
  }
  pg.broadcast(failed, 0);
  TORCH_CHECK(failed.item<float>() == 0, "save_sharded_checkpoint: rank 0 could not publish ", final_dir.string(),
              rank == 0 ? ": " + error : std::string(" (see rank 0's error)"));
  if (options.verbose && rank == 0) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::cout << "[fsdp] saved checkpoint " << final_dir.string() << " (" << world << " rank files, " << s
              << " s)" << std::endl;
  }
  return final_dir.string();
}

LoadReport load_sharded_checkpoint(const std::string& path, ShardedModel& root, torch::optim::Optimizer* optimizer,
                                   TrainingState* state, const LoadOptions& options) {
  using namespace ckpt;
  const ProcessGroup& pg = root.sharding_options().process_group;
  ShardedReader src(path);
  LoadReport report;
  report.path = src.dir();
  const std::string what = "checkpoint " + src.dir();
  if (optimizer) {
    const std::string kind = optimizer_kind(*optimizer);
    TORCH_CHECK(src.optimizer() != "none", what, " holds no optimizer state; pass nullptr as the optimizer "
                "to load only the model");
    TORCH_CHECK(src.optimizer() == kind, what, " holds ", src.optimizer(), " state but the optimizer is ", kind);
  }

  // Match names first, so that a wrong checkpoint fails before anything changes.
  auto shards = detail::local_shards(root);
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
  for (const auto& [fqn, loc] : src.by_fqn()) {
    if (!model_names.count(fqn)) report.unexpected.push_back(fqn);
  }
  TORCH_CHECK(mismatched.empty(), what, " does not match this model: shapes differ for ", list(mismatched),
              ". Was it saved from another model?");
  report_mismatch(what, report.missing, report.unexpected, options.strict);

  at::NoGradGuard no_grad;
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    // The pieces of [begin, begin + length) that the checkpoint has, merged where both
    // sides are contiguous (an unchanged layout becomes one read).
    std::vector<Piece> pieces;
    std::set<int64_t> seen_offsets;
    for (const auto& p : ls.params) {
      auto it = src.by_fqn().find(p.fqn);
      if (it == src.by_fqn().end() || !seen_offsets.insert(p.offset).second) continue;
      const int64_t lo = std::max(ls.begin, p.offset), hi = std::min(ls.begin + ls.length, p.offset + p.numel);
      if (lo >= hi) continue;
      const auto& e = src.flats()[it->second.first].table[it->second.second];
      pieces.push_back(Piece{lo - ls.begin, it->second.first, e.offset + (lo - p.offset), hi - lo});
    }
    std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.dst < b.dst; });
    std::vector<Piece> merged;
    for (const auto& p : pieces) {
      if (!merged.empty() && merged.back().src_flat == p.src_flat && merged.back().dst + merged.back().n == p.dst &&
          merged.back().src + merged.back().n == p.src) {
        merged.back().n += p.n;
      } else {
        merged.push_back(p);
      }
    }
    auto fill = [&](const at::Tensor& dst, const std::string& dataset) {
      at::Tensor buf = dst.device().is_cpu() && dst.is_contiguous() ? dst : dst.to(at::kCPU).contiguous();
      float* out = buf.data_ptr<float>();
      for (const auto& p : merged) src.read(p.src_flat, dataset, p.src, p.n, out + p.dst);
      if (ls.length < buf.numel()) buf.narrow(0, ls.length, buf.numel() - ls.length).zero_();
      if (!buf.is_same(dst)) dst.copy_(buf);
    };
    fill(ls.shard.detach(), "param");
    ls.shard.unsafeGetTensorImpl()->bump_version();  // written through a raw pointer

    if (optimizer && ls.info.requires_grad) {
      TORCH_CHECK(find_param(*optimizer, ls.shard).first >= 0, "load: the optimizer does not hold the shard of "
                  "unit '", ls.info.unit_fqn, "'. Build it from model.sharded_parameters().");
      // The state names and step come from the first source flat this shard reads.
      if (merged.empty()) continue;
      const SourceFlat& sf = src.flats()[merged.front().src_flat];
      if (sf.optim_states.empty()) continue;  // saved before the first optimizer step
      ParamState st;
      h5::Obj og = h5::open_group(src.file(0), flat_group(merged.front().src_flat) + "/optim", src.file_path(0));
      st.step = h5::get_int(og, "step", src.file_path(0));
      // Uninitialised when the pieces cover the shard (fill zeroes the padding), so each
      // byte is touched once, by the read; zeros where a parameter is missing from the file.
      int64_t covered = 0;
      for (const auto& p : merged) covered += p.n;
      for (const auto& name : sf.optim_states) {
        at::Tensor t = covered == ls.length ? at::empty_like(ls.shard.detach(), at::MemoryFormat::Contiguous)
                                            : at::zeros_like(ls.shard.detach(), at::MemoryFormat::Contiguous);
        fill(t, "optim/" + name);
        st.tensors.emplace_back(name, t);
      }
      set_param_state(*optimizer, ls.shard, std::move(st));
    }
  }

  // Buffers are replicated: every rank reads rank 0's copy.
  hid_t f0 = src.file(0);
  const std::string p0 = src.file_path(0);
  std::set<std::string> file_buffers;
  if (h5::exists(f0, "buffers")) {
    h5::Obj bg = h5::open_group(f0, "buffers", p0);
    for (const auto& n : h5::children(bg, p0 + ":/buffers")) file_buffers.insert(n);
    for (const auto& [name, b] : named_buffers_clean(root.as_module())) {
      if (!file_buffers.count(name)) {
        report.missing.push_back(name);
        continue;
      }
      read_into(bg, name, b, p0 + ":/buffers");
      file_buffers.erase(name);
    }
    for (const auto& n : file_buffers) report.unexpected.push_back(n);
  }
  report_mismatch(what, report.missing, report.unexpected, options.strict);

  if (optimizer) {
    h5::Obj og = h5::open_group(f0, "optimizer", p0);
    const int64_t groups = h5::get_int(og, "num_groups", p0);
    TORCH_CHECK(groups == static_cast<int64_t>(optimizer->param_groups().size()), what, " holds ", groups,
                " optimizer param groups but the optimizer has ", optimizer->param_groups().size());
    for (int64_t g = 0; g < groups; ++g) {
      h5::Obj gg = h5::open_group(og, "group_" + std::to_string(g), p0);
      std::map<std::string, AttrValue> hp;
      for (const auto& n : h5::attr_names(gg, p0)) hp[n] = h5::get_attr(gg, n, p0);
      set_group_hparams(*optimizer, static_cast<size_t>(g), hp);
    }
  }

  if (state) {
    const std::string where = p0 + ":/state";
    h5::Obj sg = h5::open_group(f0, "state", p0);
    *state = TrainingState{};
    state->step = h5::get_int(sg, "step", where);
    h5::Obj sched = h5::open_group(sg, "scheduler", where);
    for (const auto& n : h5::attr_names(sched, where)) state->scheduler[n] = h5::get_double(sched, n, where);
    h5::Obj extra = h5::open_group(sg, "extra", where);
    for (const auto& n : h5::attr_names(extra, where)) state->extra[n] = h5::get_string(extra, n, where);
    if (h5::exists(sg, "loss_scaler")) {
      h5::Obj lg = h5::open_group(sg, "loss_scaler", where);
      LossScalerState ls;
      ls.scale = h5::get_double(lg, "scale", where);
      ls.iteration = h5::get_int(lg, "iteration", where);
      ls.last_overflow_iteration = h5::get_int(lg, "last_overflow_iteration", where);
      ls.hysteresis_left = static_cast<int>(h5::get_int(lg, "hysteresis_left", where));
      ls.skipped_steps = h5::get_int(lg, "skipped_steps", where);
      state->loss_scaler = ls;
    }
    h5::Obj ma = h5::open_group(f0, "model_attrs", p0);
    for (const auto& n : h5::attr_names(ma, p0)) state->model_attrs[n] = h5::get_attr(ma, n, p0);
  }

  // RNG streams belong to ranks: restore them only when the ranks are the same.
  if (options.restore_rng && src.world_size() == pg.size()) {
    const int r = pg.rank();
    hid_t f = src.file(r);
    const std::string pr = src.file_path(r);
    h5::Obj rng = h5::open_group(f, "rng", pr);
    auto restore = [&](at::Generator gen, const std::string& ds) {
      auto shape = h5::shape_of(rng, ds, pr);
      at::Tensor st = at::empty(shape, at::kByte);
      h5::read_range(rng, ds, 0, st.numel(), st.data_ptr(), h5::Elem::kU8, pr + ":/rng");
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(st);
    };
    restore(at::detail::getDefaultCPUGenerator(), "cpu");
    if (torch::cuda::is_available()) {
      for (int64_t i = 0; i < static_cast<int64_t>(torch::cuda::device_count()); ++i) {
        const std::string ds = "cuda_" + std::to_string(i);
        if (h5::exists(rng, ds)) {
          restore(at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))), ds);
        }
      }
    }
  }
  return report;
}

}  // namespace fsdp
