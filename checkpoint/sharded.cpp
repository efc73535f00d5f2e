// Sharded checkpoints: parallel save, exact resume, resharding across world sizes and
// wrap policies (layout in layout.h).
#include "agree.h"
#include "optim_state.h"
#include "publish.h"
#include "rank_parts.h"
#include "tensor_io.h"

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>

#include "internal/sharded_model.h"
#include "reshard_plan.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

// step_00000100 or step_00000100_2 (a second save at the same step): (step, version).
std::optional<std::pair<int64_t, int64_t>> parse_checkpoint_name(const std::string& name) {
  static const std::regex re("step_([0-9]+)(?:_([0-9]+))?");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return std::make_pair(std::stoll(m[1].str()), m[2].matched ? std::stoll(m[2].str()) : int64_t{1});
}

// detail::set_save_hook's hook (tests only).
std::function<void(const std::string&, const std::string&)>& save_hook() {
  static std::function<void(const std::string&, const std::string&)> hook;
  return hook;
}

}  // namespace

// Note [Rank snapshot]
// Everything one rank's file holds, read from the live model in one pass, then written
// by write_snapshot. A synchronous save takes it as views of the live tensors and writes
// at once; an asynchronous one copies each tensor into host staging memory (pinned when
// it comes from a GPU), so that training may change the originals while a thread writes.
// Either way the file is the same.
struct RankSnapshot {
  struct Flat {
    FlatParamInfo info;
    int64_t begin = 0, length = 0;
    std::vector<TableEntry> table;
    at::Tensor param;  ///< [length] fp32
    bool has_optim = false;
    int64_t optim_step = 0, optim_group = 0;
    std::vector<std::pair<std::string, at::Tensor>> optim;  ///< [length] each
  };
  int rank = 0, world = 1;
  int64_t shard_group_size = 1;
  std::string optimizer_kind = "none";
  std::vector<Flat> flats;
  std::vector<std::map<std::string, AttrValue>> groups;  ///< optimizer hyperparameters
  TrainingState state;
  std::vector<std::pair<std::string, at::Tensor>> rng;      ///< "cpu", "cuda_<i>"
  std::vector<std::pair<std::string, at::Tensor>> buffers;  ///< rank 0 only
  int64_t staged_bytes = 0;                                 ///< host copies held (async)
  /// The staging buffers above by what they hold, for the next save (Note [Staging reuse]).
  std::map<std::string, at::Tensor> staged;
};

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

class Stager {
 public:
  /// `spare`: the model's kept buffers, already counted in checkpoint_staging; every
  /// byte allocated or freed from here on is counted as it happens.
  Stager(const ShardedModel& model, std::map<std::string, at::Tensor> spare)
      : model_(model), spare_(std::move(spare)) {}
  ~Stager() { free_spare(); }
  /// A host copy of `t` (pinned when `t` is on a GPU), made into the last save's buffer
  /// for `what` when it fits.
  at::Tensor stage(const std::string& what, const at::Tensor& t, RankSnapshot& snap) {
    const bool pinned = t.is_cuda();
    const std::string key = pinned ? what + "@pinned" : what;
    if (save_hook()) save_hook()("stage", key);
    at::Tensor host;
    auto it = spare_.find(key);
    if (it != spare_.end() && it->second.sizes() == t.sizes() &&
        it->second.scalar_type() == t.scalar_type()) {
      host = std::move(it->second);
      spare_.erase(it);
    } else {
      host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(pinned));
      detail::account_checkpoint_staging(model_, static_cast<int64_t>(host.nbytes()));
    }
    used_bytes_ += static_cast<int64_t>(host.nbytes());
    host.copy_(t);
    snap.staged_bytes += static_cast<int64_t>(host.nbytes());
    snap.staged.emplace(key, host);
    return host;
  }
  /// Frees the kept buffers this save did not use.
  void free_spare() {
    detail::account_checkpoint_staging(model_, -staged_bytes(spare_));
    spare_.clear();
  }
  /// The snapshot was dropped (a failure while staging): its buffers are gone.
  void forget_used() {
    detail::account_checkpoint_staging(model_, -used_bytes_);
    used_bytes_ = 0;
  }

 private:
  const ShardedModel& model_;
  std::map<std::string, at::Tensor> spare_;
  int64_t used_bytes_ = 0;
};

// `stager` null: views of the live tensors (a synchronous save).
RankSnapshot take_snapshot(const ShardedModel& root, torch::optim::Optimizer* opt,
                           const TrainingState& state, int rank, int world, Stager* stager) {
  RankSnapshot snap;
  auto keep = [&](const std::string& what, const at::Tensor& t) {
    return stager ? stager->stage(what, t, snap) : t;
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
    f.param = keep(flat + "/param", ls.shard.detach().narrow(0, 0, f.length));
    if (opt && ls.info.requires_grad) {
      const int64_t group = find_param(*opt, ls.shard).first;
      TORCH_CHECK(group >= 0, "save: the optimizer does not hold the shard of unit '",
                  ls.info.unit_fqn, "'. Build it from model.sharded_parameters().");
      ParamState st = get_param_state(*opt, ls.shard);
      if (!st.tensors.empty()) {
        f.has_optim = true;
        f.optim_step = st.step;
        f.optim_group = group;
        for (const auto& [name, t] : st.tensors) {
          f.optim.emplace_back(
              name, keep(flat + "/optim/" + name, t.reshape({-1}).narrow(0, 0, f.length)));
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
  if (rank == 0) {
    for (const auto& [name, b] : named_buffers_clean(root.as_module())) {
      snap.buffers.emplace_back(name, keep("buffer/" + name, b));
    }
  }
  return snap;
}

void write_snapshot(const std::string& path, const RankSnapshot& snap) {
  h5::Obj f = h5::create_file(path);
  h5::set_attr(f, "format", std::string(kShardedFormat));
  h5::set_attr(f, "format_version", kCheckpointFormatVersion);
  h5::set_attr(f, "world_size", int64_t{snap.world});
  h5::set_attr(f, "rank", int64_t{snap.rank});
  h5::set_attr(f, "step", snap.state.step);
  h5::set_attr(f, "shard_group_size", snap.shard_group_size);
  h5::set_attr(f, "num_flats", static_cast<int64_t>(snap.flats.size()));
  h5::set_attr(f, "optimizer", snap.optimizer_kind);

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
    write_tensor(g, "param", fl.param, h5::Elem::kF32, where);
    if (fl.has_optim) {
      h5::Obj og = h5::create_group(g, "optim", where);
      h5::set_attr(og, "step", fl.optim_step);
      h5::set_attr(og, "group", fl.optim_group);
      for (const auto& [name, t] : fl.optim)
        write_tensor(og, name, t, h5::Elem::kF32, where + "/optim");
    }
  }

  // The other parts, in the file's order (rank_parts.h).
  if (snap.optimizer_kind != "none") write_optimizer_groups(f, snap.groups, path);
  write_training_state(f, snap.state, path);
  write_rng(f, snap.rng, path);
  if (snap.rank == 0) write_buffers(f, snap.buffers, path);
  h5::flush_and_sync(f, path);
}

namespace {

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
  msg +=
      " Was it saved from another model? Load with LoadOptions::strict = false to take the "
      "parameters that match.";
  TORCH_CHECK(false, msg);
}

}  // namespace ckpt

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  if (!fs::exists(fs::path(dir) / "latest")) return std::nullopt;
  return ckpt::resolve_checkpoint_dir(dir);
}

namespace ckpt {

// One save's names: dir/step_<step>[_<version>], written first as dir/.tmp-<name>.
struct SavePlan {
  fs::path base, tmp, final_dir;
};

namespace {

void check_save_args(const TrainingState& state, const SaveOptions& options, const char* fn) {
  TORCH_CHECK(state.step >= 0, fn, ": step ", state.step, " is negative");
  TORCH_CHECK(options.keep_last >= 0, fn, ": keep_last ", options.keep_last,
              " is negative; use 0 to keep every checkpoint");
}

// Rank 0 picks the name (a new one if this step was saved before) and makes the
// temporary directory; everyone learns the name's version from a broadcast. Collective.
SavePlan plan_save(const std::string& dir, int64_t step, const ProcessGroup& pg, const char* fn) {
  SavePlan plan;
  plan.base = fs::path(dir);
  char name_buf[64];
  std::snprintf(name_buf, sizeof(name_buf), "step_%08lld", static_cast<long long>(step));
  std::string name = name_buf;
  at::Tensor version = at::ones({1}, at::kLong);
  rank0_tries(pg, std::string(fn) + ": preparing " + dir, [&] {
    fs::create_directories(plan.base);
    int64_t v = 1;
    while (fs::exists(plan.base / (v == 1 ? name : name + "_" + std::to_string(v)))) ++v;
    version[0] = v;
    const std::string chosen = v == 1 ? name : name + "_" + std::to_string(v);
    const fs::path tmp = plan.base / (".tmp-" + chosen);
    fs::remove_all(tmp);  // left by a save that was killed
    fs::create_directories(tmp);
  });
  pg.broadcast(version, 0);
  if (version.item<int64_t>() > 1) name += "_" + std::to_string(version.item<int64_t>());
  plan.tmp = plan.base / (".tmp-" + name);
  plan.final_dir = plan.base / name;
  return plan;
}

// Rank 0, once every rank's file is complete: rename the directory into place, then move
// `latest`; remove what killed saves left and checkpoints beyond keep_last.
void publish(const SavePlan& plan, int keep_last) {
  fsync_path(plan.tmp);
  publish_atomically(plan.tmp, plan.final_dir);
  write_atomically(plan.base / "latest", plan.final_dir.filename().string() + "\n");
  std::error_code ec;
  std::vector<std::pair<std::pair<int64_t, int64_t>, fs::path>> done;
  for (const auto& e : fs::directory_iterator(plan.base)) {
    const std::string n = e.path().filename().string();
    if (n.rfind(".tmp-", 0) == 0 && e.path() != plan.tmp) fs::remove_all(e.path(), ec);
    if (auto key = parse_checkpoint_name(n); key && e.is_directory())
      done.emplace_back(*key, e.path());
  }
  if (keep_last > 0 && done.size() > static_cast<size_t>(keep_last)) {
    std::sort(done.begin(), done.end());
    for (size_t i = 0; i + keep_last < done.size(); ++i) {
      if (done[i].second != plan.final_dir) fs::remove_all(done[i].second, ec);
    }
  }
}

void report_saved(const SavePlan& plan, int world, std::chrono::steady_clock::time_point t0,
                  const char* how) {
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << "[fsdp] saved checkpoint " << plan.final_dir.string() << " (" << world
            << " rank files, " << s << " s" << how << ")" << std::endl;
}

// Every rank's outcome of one step of a save (`error`: this rank's, "" for none), agreed
// with a MAX all-reduce; after a failure anywhere, rank 0 removes the temporary directory
// and every rank throws alike, naming this rank's error or pointing at another's.
void agree_or_abandon(const ProcessGroup& pg, const SavePlan& plan, const char* fn,
                      const std::string& dir, const std::string& error) {
  if (!any_rank_failed(pg, error)) return;
  if (pg.rank() == 0) {
    std::error_code ec;
    fs::remove_all(plan.tmp, ec);
  }
  TORCH_CHECK(false, fn, " to ", dir, " failed",
              failure_detail(error, " on another rank (see its error)"),
              ". The previous checkpoint is untouched.");
}

std::string done_marker(int rank) { return ".done-" + rank_file_name(rank); }
std::string failed_marker(int rank) { return ".failed-" + rank_file_name(rank); }

}  // namespace
}  // namespace ckpt

// Note [Asynchronous saves]
// save_sharded_checkpoint_async does on the calling thread what needs the other ranks or
// the live tensors: it settles the save before it (below), agrees on the name with them
// (plan_save) and copies this rank's part into host staging memory (take_snapshot with
// stage = true, counted in MemoryStats::checkpoint_staging). A thread then writes the
// rank's file as the synchronous save would, fsyncs it, and drops a marker beside it:
// .done-rank_NNNNN.h5, or .failed-rank_NNNNN.h5 holding the error. The thread uses no
// collective (training owns the process group meanwhile): rank 0's thread watches the
// temporary directory until every rank's marker is there, then publishes (rename, then
// `latest`). A failure anywhere leaves `latest` where it was and the temporary directory
// for the next save to remove. The next save on every rank first joins the thread and
// agrees, in one all-reduce, whether the last save failed anywhere: if it did, that call
// throws on every rank alike, naming the file, and saves nothing.
class AsyncSaveJob {
 public:
  AsyncSaveJob(ShardedModel model, ckpt::SavePlan plan, ckpt::RankSnapshot snap, int rank,
               int world, double stall_s, const SaveOptions& options)
      : model_(std::move(model)),
        plan_(std::move(plan)),
        snap_(std::move(snap)),
        rank_(rank),
        world_(world),
        stall_s_(stall_s),
        options_(options),
        t0_(std::chrono::steady_clock::now()) {}
  ~AsyncSaveJob() { join(); }

  void start() {
    thread_ = std::thread([this] { run(); });
  }
  /// Joins the thread (once), frees the staging copies and returns the error ("": none).
  const std::string& join() {
    std::lock_guard<std::mutex> lock(join_mu_);
    if (thread_.joinable()) thread_.join();
    if (snap_.staged_bytes > 0) {
      if (options_.keep_staging) {
        detail::checkpoint_staging_pool(model_) = std::move(snap_.staged);  // still counted
      } else {
        detail::account_checkpoint_staging(model_, -snap_.staged_bytes);
      }
      snap_ = ckpt::RankSnapshot();
    }
    return error_;
  }
  bool finished() const { return finished_.load(); }
  std::string path() const { return plan_.final_dir.string(); }

 private:
  void run();
  bool wait_for_ranks();

  ShardedModel model_;  ///< keeps the model's counters alive for the staging bytes
  ckpt::SavePlan plan_;
  ckpt::RankSnapshot snap_;
  int rank_, world_;
  double stall_s_;  ///< rank 0 gives up on the others' files after this long without progress
  SaveOptions options_;
  std::chrono::steady_clock::time_point t0_;
  std::thread thread_;
  std::mutex join_mu_;
  std::string error_;  ///< written by the thread, read after join
  std::atomic<bool> finished_{false};
};

bool AsyncSaveJob::wait_for_ranks() {
  // No deadline while the files grow: a slow disk is not a failure. Stalled for the
  // process group's collective timeout (FSDP_TIMEOUT_S, default 300 s), it gives up.
  const double stall_s = stall_s_;
  auto last_change = std::chrono::steady_clock::now();
  uintmax_t last_bytes = 0;
  for (;;) {
    int done = 0;
    uintmax_t bytes = 0;
    for (int r = 0; r < world_; ++r) {
      if (fs::exists(plan_.tmp / ckpt::failed_marker(r))) {
        std::ifstream in(plan_.tmp / ckpt::failed_marker(r));
        std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        error_ = "rank " + std::to_string(r) + ": " + text;
        return false;
      }
      if (fs::exists(plan_.tmp / ckpt::done_marker(r))) ++done;
      std::error_code ec;
      const auto n = fs::file_size(plan_.tmp / ckpt::rank_file_name(r), ec);
      if (!ec) bytes += n;
    }
    if (done == world_) return true;
    const auto now = std::chrono::steady_clock::now();
    if (bytes != last_bytes) {
      last_bytes = bytes;
      last_change = now;
    } else if (std::chrono::duration<double>(now - last_change).count() > stall_s) {
      std::ostringstream msg;
      msg << "waited " << stall_s
          << " s (the process group's timeout, FSDP_TIMEOUT_S) for the other ranks' files in "
          << plan_.tmp.string() << " without progress: " << done << " of " << world_ << " complete";
      error_ = msg.str();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void AsyncSaveJob::run() {
  using namespace ckpt;
  const std::string file = (plan_.tmp / rank_file_name(rank_)).string();
  try {
    if (save_hook()) save_hook()("write", file);
    write_snapshot(file, snap_);
    write_atomically(plan_.tmp / done_marker(rank_), "");
  } catch (const std::exception& e) {
    error_ = std::string("writing ") + file + " failed: " + e.what();
    try {
      write_atomically(plan_.tmp / failed_marker(rank_), error_);
    } catch (const std::exception&) {
      // rank 0 then waits until its stall limit, and says so
    }
  }
  if (rank_ == 0) {
    try {
      if (error_.empty() && wait_for_ranks()) {
        for (int r = 0; r < world_; ++r) fs::remove(plan_.tmp / done_marker(r));
        if (save_hook()) save_hook()("publish", plan_.final_dir.string());
        publish(plan_, options_.keep_last);
        if (options_.verbose) report_saved(plan_, world_, t0_, ", in the background");
      }
    } catch (const std::exception& e) {
      error_ = std::string("publishing ") + plan_.final_dir.string() + " failed: " + e.what();
    }
    if (!error_.empty()) {
      std::error_code ec;
      fs::remove_all(plan_.tmp, ec);
    }
  }
  finished_ = true;
}

namespace ckpt {
namespace {

std::mutex in_flight_mu;
std::shared_ptr<AsyncSaveJob>
    in_flight;  ///< the last asynchronous save, until the next save settles it

// Joins the last asynchronous save and has every rank agree whether it failed anywhere;
// throws on every rank alike if it did. Collective when a save was in flight (on every
// rank alike: saves are collective).
void settle_previous(const ProcessGroup& pg, const char* fn) {
  std::shared_ptr<AsyncSaveJob> job;
  {
    std::lock_guard<std::mutex> lock(in_flight_mu);
    job = std::move(in_flight);
  }
  if (!job) return;
  const std::string error = job->join();
  TORCH_CHECK(
      !any_rank_failed(pg, error), fn, ": the asynchronous save of ", job->path(), " failed",
      failure_detail(error, " on another rank (see its error)"),
      ". `latest` still names the checkpoint before it, and this call saved nothing; call it "
      "again to save.");
}

}  // namespace

void wait_for_async_save() {
  std::shared_ptr<AsyncSaveJob> job;
  {
    std::lock_guard<std::mutex> lock(in_flight_mu);
    job = in_flight;
  }
  if (job) job->join();
}

}  // namespace ckpt

namespace detail {
void set_save_hook(std::function<void(const std::string&, const std::string&)> hook) {
  ckpt::save_hook() = std::move(hook);
}
}  // namespace detail

std::string save_sharded_checkpoint(const std::string& dir, const ShardedModel& root,
                                    torch::optim::Optimizer* optimizer, const TrainingState& state,
                                    const SaveOptions& options) {
  using namespace ckpt;
  const char* fn = "save_sharded_checkpoint";
  check_save_args(state, options, fn);
  const ProcessGroup& pg = root.sharding_options().process_group;
  const int rank = pg.rank(), world = pg.size();
  const auto t0 = std::chrono::steady_clock::now();
  settle_previous(pg, fn);
  const SavePlan plan = plan_save(dir, state.step, pg, fn);

  // Every rank writes its own file at once; no data moves between ranks.
  std::string error;
  try {
    const std::string file = (plan.tmp / rank_file_name(rank)).string();
    if (save_hook()) save_hook()("write", file);
    write_snapshot(file, take_snapshot(root, optimizer, state, rank, world, /*stager=*/nullptr));
  } catch (const std::exception& e) {
    error = e.what();
  }
  agree_or_abandon(pg, plan, fn, dir, error);

  rank0_tries(pg, std::string(fn) + ": publishing " + plan.final_dir.string(), [&] {
    if (save_hook()) save_hook()("publish", plan.final_dir.string());
    publish(plan, options.keep_last);
  });
  if (options.verbose && rank == 0) report_saved(plan, world, t0, "");
  return plan.final_dir.string();
}

AsyncSave save_sharded_checkpoint_async(const std::string& dir, const ShardedModel& root,
                                        torch::optim::Optimizer* optimizer,
                                        const TrainingState& state, const SaveOptions& options) {
  using namespace ckpt;
  const char* fn = "save_sharded_checkpoint_async";
  check_save_args(state, options, fn);
  const ProcessGroup& pg = root.sharding_options().process_group;
  const int rank = pg.rank(), world = pg.size();
  settle_previous(pg, fn);
  const SavePlan plan = plan_save(dir, state.step, pg, fn);
  // The copy is made on every rank before any rank goes on training: a rank that fails
  // here (out of host memory, say) fails the call everywhere, and nothing is written.
  // The last save's buffers are given to the stager; what it does not use is freed with it.
  std::string error;
  RankSnapshot snap;
  {
    Stager stager(root, std::exchange(detail::checkpoint_staging_pool(root), {}));
    try {
      snap = take_snapshot(root, optimizer, state, rank, world, &stager);
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
  auto job = std::make_shared<AsyncSaveJob>(root, plan, std::move(snap), rank, world,
                                            pg.timeout_s(), options);
  job->start();
  {
    std::lock_guard<std::mutex> lock(in_flight_mu);
    in_flight = job;
  }
  return AsyncSave(job);
}

AsyncSave::AsyncSave(std::shared_ptr<AsyncSaveJob> job) : job_(std::move(job)) {}
AsyncSave::AsyncSave(AsyncSave&&) noexcept = default;
AsyncSave& AsyncSave::operator=(AsyncSave&& other) noexcept {
  if (this != &other) {
    if (job_) job_->join();
    job_ = std::move(other.job_);
  }
  return *this;
}
AsyncSave::~AsyncSave() {
  if (job_) job_->join();
}

std::string AsyncSave::wait() {
  TORCH_CHECK(job_, "AsyncSave::wait: this handle holds no save");
  const std::string& error = job_->join();
  TORCH_CHECK(error.empty(), "the asynchronous save of ", job_->path(), " failed: ", error,
              ". `latest` still names the checkpoint before it.");
  return job_->path();
}

void release_checkpoint_staging(const ShardedModel& model) {
  ckpt::wait_for_async_save();
  auto& pool = detail::checkpoint_staging_pool(model);
  detail::account_checkpoint_staging(model, -ckpt::staged_bytes(pool));
  pool.clear();
}

bool AsyncSave::done() const { return !job_ || job_->finished(); }

std::string AsyncSave::path() const { return job_ ? job_->path() : std::string(); }

LoadReport load_sharded_checkpoint(const std::string& path, ShardedModel& root,
                                   torch::optim::Optimizer* optimizer, TrainingState* state,
                                   const LoadOptions& options) {
  ckpt::wait_for_async_save();  // the save just made is complete before anything reads
  using namespace ckpt;
  const ProcessGroup& pg = root.sharding_options().process_group;
  ShardedReader src(path);
  LoadReport report;
  report.path = src.dir();
  const std::string what = "checkpoint " + src.dir();
  if (optimizer) {
    const std::string kind = optimizer_kind(*optimizer);
    TORCH_CHECK(src.optimizer() != "none", what,
                " holds no optimizer state; pass nullptr as the optimizer "
                "to load only the model");
    TORCH_CHECK(src.optimizer() == kind, what, " holds ", src.optimizer(),
                " state but the optimizer is ", kind);
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
  TORCH_CHECK(mismatched.empty(), what, " does not match this model: shapes differ for ",
              list(mismatched), ". Was it saved from another model?");
  report_mismatch(what, report.missing, report.unexpected, options.strict);

  at::NoGradGuard no_grad;
  for (size_t k = 0; k < shards.size(); ++k) {
    const LocalShard& ls = shards[k];
    // The pieces of [begin, begin + length) that the checkpoint has (reshard_plan.h).
    std::vector<TargetParam> targets;
    for (const auto& p : ls.params) targets.push_back(TargetParam{p.fqn, p.offset, p.numel});
    const std::vector<Piece> merged = plan_shard_read(
        ls.begin, ls.length, targets, [&](const std::string& fqn) -> std::optional<SourceParam> {
          auto it = src.by_fqn().find(fqn);
          if (it == src.by_fqn().end()) return std::nullopt;
          return SourceParam{it->second.first,
                             src.flats()[it->second.first].table[it->second.second].offset};
        });
    auto fill = [&](const at::Tensor& dst, const std::string& dataset) {
      at::Tensor buf =
          dst.device().is_cpu() && dst.is_contiguous() ? dst : dst.to(at::kCPU).contiguous();
      float* out = buf.data_ptr<float>();
      for (const auto& p : merged) src.read(p.src_flat, dataset, p.src, p.n, out + p.dst);
      if (ls.length < buf.numel()) buf.narrow(0, ls.length, buf.numel() - ls.length).zero_();
      if (!buf.is_same(dst)) dst.copy_(buf);
    };
    fill(ls.shard.detach(), "param");
    ls.shard.unsafeGetTensorImpl()->bump_version();  // written through a raw pointer

    if (optimizer && ls.info.requires_grad) {
      TORCH_CHECK(find_param(*optimizer, ls.shard).first >= 0,
                  "load: the optimizer does not hold the shard of "
                  "unit '",
                  ls.info.unit_fqn, "'. Build it from model.sharded_parameters().");
      // The state names and step come from the first source flat this shard reads.
      if (merged.empty()) continue;
      const SourceFlat& sf = src.flats()[merged.front().src_flat];
      if (sf.optim_states.empty()) continue;  // saved before the first optimizer step
      ParamState st;
      h5::Obj og = h5::open_group(src.file(0), flat_group(merged.front().src_flat) + "/optim",
                                  src.file_path(0));
      st.step = h5::get_int(og, "step", src.file_path(0));
      // Uninitialised when the pieces cover the shard (fill zeroes the padding), so each
      // byte is touched once, by the read; zeros where a parameter is missing from the file.
      for (const auto& name : sf.optim_states) {
        at::Tensor t = covered(merged) == ls.length
                           ? at::empty_like(ls.shard.detach(), at::MemoryFormat::Contiguous)
                           : at::zeros_like(ls.shard.detach(), at::MemoryFormat::Contiguous);
        fill(t, "optim/" + name);
        st.tensors.emplace_back(name, t);
      }
      set_param_state(*optimizer, ls.shard, std::move(st));
    }
  }

  // The other parts (rank_parts.h). Buffers are replicated: every rank reads rank 0's
  // copy, as it does the optimizer's groups and the training state.
  hid_t f0 = src.file(0);
  const std::string p0 = src.file_path(0);
  read_buffers(f0, p0, root.as_module(), report.missing, report.unexpected);
  report_mismatch(what, report.missing, report.unexpected, options.strict);
  if (optimizer) read_optimizer_groups(f0, p0, *optimizer, what);
  if (state) *state = read_training_state(f0, p0);
  // RNG streams belong to ranks: restore them only when the ranks are the same.
  if (options.restore_rng && src.world_size() == pg.size())
    restore_rng(src.file(pg.rank()), src.file_path(pg.rank()));
  return report;
}

}  // namespace fsdp
