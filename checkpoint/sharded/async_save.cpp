#include "async_save.h"
#include "trace/trace.h"

#include "../agree.h"
#include "../format/layout.h"
#include "../format/publish.h"

#include "internal/checkpoint_view.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <mutex>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

// The markers a rank other than 0 leaves beside its file (Note [Cross-rank completion]).
std::string done_marker(int rank) { return ".done-" + rank_file_name(rank); }
std::string failed_marker(int rank) { return ".failed-" + rank_file_name(rank); }

}  // namespace
}  // namespace ckpt

// Note [Asynchronous saves]
// save_sharded_checkpoint_async does on the calling thread what needs the other ranks or
// the live tensors: it settles the save before it (settle_previous), agrees on the name
// with them (plan_save) and copies this rank's part into host staging memory
// (take_snapshot with a Stager, counted in MemoryStats::checkpoint_staging). A thread
// then writes the rank's file as the synchronous save would and fsyncs it. The thread
// uses no collective (training owns the process group meanwhile), so the ranks learn
// each other's outcome through the temporary directory (Note [Cross-rank completion]):
// each rank other than 0 drops a marker beside its file, .done-rank_NNNNN.h5 or
// .failed-rank_NNNNN.h5 holding the error, and rank 0's thread, once its own file is
// written, waits for every other rank's marker, then publishes (the directory, then
// `latest`). A failure anywhere leaves `latest` where it was and the temporary directory
// for the next save to remove. The thread's outcome (its error, "" for none) is handed to
// whoever waits through a future: AsyncSave::wait, done, and the next save, which on
// every rank first takes the job in flight, joins it and agrees, in one all-reduce,
// whether it failed anywhere: if it did, that call throws on every rank alike, naming
// the file, and saves nothing.

// Note [Cross-rank completion]
// Rank 0 must not publish before every rank's file is complete, and it learns that by
// polling the temporary directory for markers. Inside a process the hand-off is
// explicit (rank 0's own outcome goes from its write to its publish in one thread, and
// the job's outcome to the waiter through a future), but the other ranks are other
// processes, possibly on other hosts, and the thread cannot use a collective: c10d needs
// every rank to issue a group's collectives in the same order, and the training thread
// issues its own on the same group meanwhile, at moments that differ between ranks. A
// second process group for the thread would need its own rendezvous and would hold the
// ranks together across saves. What the ranks do share is the checkpoint's file system,
// and change notification (inotify) does not see files that other hosts write to a
// network file system. So rank 0 polls every 5 ms, and gives up only when the files have
// not grown for the process group's timeout.

// Note [Background staging]
// What an asynchronous save holds training for is its copy into staging memory, and that
// copy is memory-bound: 1.2 GB took 0.07-0.1 s here against 0.55-0.65 s for the disk to
// write it, so blocked / sync could not fall below 0.11-0.13 however fast the writer. With
// SaveOptions::background_staging the call copies only what a forward may change (the
// buffers: BatchNorm's running statistics, say) and the small state (RNG, training state,
// hyperparameters), and leaves the copies of the shards and the optimizer state, which
// only an optimizer step changes, to the background thread (RankSnapshot::pending),
// which makes them before it writes (finish_staging). Training meanwhile runs the next
// forward and backward, which read the shards and write only gradients. The end of every
// backward of the saved model waits for the copy (the barrier the save registers with the
// model's runtime, detail::set_shard_change_barrier; FusedAdamW::step over the model,
// import_consolidated and a FullParamsScope's writeback run it too), so an optimizer step
// never runs beside it; AsyncSave::wait_staged waits where a program
// changes the tensors some other way (another optimizer stepping without a backward
// first, an edit by hand). A load waits for the whole save anyway. DCP's async staging
// (StagingOptions(use_async_staging)) hands the user a future to wait on instead; here
// the common loop needs no call. A change made anyway is caught where the version
// counters see it: each source's counter (which in-place ops and FusedAdamW's kernels
// bump; writes through .data() do not) is read at the call and again after the copy, and
// a difference fails the save, naming the tensor, with `latest` left where it was. The
// time training waited is kept per job (AsyncSave::staging_wait_s) and traced
// ("checkpoint staging wait"). Copied in the call still: tensors on a GPU (into pinned
// memory), shards and state that are not fp32 (the file holds fp32: the conversion is
// the copy), and everything when background_staging is false.
class AsyncSaveJob {
 public:
  AsyncSaveJob(ShardedModel model, ckpt::SavePlan plan, ckpt::RankSnapshot snap, int rank,
               int world, double stall_s, const ckpt::SaveOptions& options)
      : model_(std::move(model)),
        plan_(std::move(plan)),
        snap_(std::move(snap)),
        rank_(rank),
        world_(world),
        stall_s_(stall_s),
        options_(options),
        t0_(std::chrono::steady_clock::now()) {
    staged_future_ = staged_.get_future().share();
  }
  ~AsyncSaveJob() { join(); }

  void start() {
    std::packaged_task<std::string()> task([this] { return run(); });
    outcome_ = task.get_future().share();
    thread_ = std::thread(std::move(task));
  }
  /// Blocks until the background staging is done (Note [Background staging]).
  void wait_staged() {
    if (staged_future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) return;
    detail::trace::Scope span("checkpoint",
                              []() { return std::string("checkpoint staging wait"); });
    const auto start = std::chrono::steady_clock::now();
    staged_future_.wait();
    const auto waited = std::chrono::steady_clock::now() - start;
    staging_wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count();
  }
  double staging_wait_s() const { return static_cast<double>(staging_wait_ns_.load()) * 1e-9; }
  /// Takes the thread's outcome and joins it (once), frees the staging copies and
  /// returns the error ("": none).
  const std::string& join() {
    std::lock_guard<std::mutex> lock(join_mu_);
    if (thread_.joinable()) {
      error_ = outcome_.get();
      thread_.join();
    }
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
  bool finished() const {
    return outcome_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  std::string path() const { return plan_.final_dir.string(); }

 private:
  std::string run() noexcept;
  std::string stage_pending() noexcept;
  void release_staged() noexcept;
  std::string write_rank_file();
  std::string publish_when_complete();
  std::string wait_for_other_ranks();

  ShardedModel model_;  ///< keeps the model's counters alive for the staging bytes
  ckpt::SavePlan plan_;
  ckpt::RankSnapshot snap_;
  int rank_, world_;
  double stall_s_;  ///< rank 0 gives up on the others' files after this long without progress
  ckpt::SaveOptions options_;
  std::chrono::steady_clock::time_point t0_;
  std::thread thread_;
  std::shared_future<std::string> outcome_;  ///< the thread's error ("": none), once it ends
  std::mutex join_mu_;
  std::string error_;          ///< the outcome, once joined
  std::promise<void> staged_;  ///< set once the background staging is done (or failed)
  bool staged_set_ = false;    ///< the thread's own: staged_ is set
  std::shared_future<void> staged_future_;
  std::atomic<int64_t> staging_wait_ns_{0};  ///< what wait_staged() waited, in all
};

std::string AsyncSaveJob::run() noexcept {
  detail::trace::Scope span("checkpoint", []() { return std::string("checkpoint write (async)"); });
  std::string error;
  try {
    error = write_rank_file();
    if (rank_ == 0 && error.empty()) error = publish_when_complete();
    if (rank_ == 0 && !error.empty()) {
      std::error_code ec;
      fs::remove_all(plan_.tmp, ec);
    }
  } catch (const std::exception& e) {  // a std::string that could not be made, say
    error =
        std::string("the background save of ") + plan_.final_dir.string() + " failed: " + e.what();
  }
  release_staged();  // never left waiting, whatever failed
  return error;
}

// Note [Background staging]: the copies the call left, then the waiters released.
std::string AsyncSaveJob::stage_pending() noexcept {
  std::string error;
  try {
    if (!snap_.pending.empty()) {
      detail::call_save_hook(model_, "background stage",
                             (plan_.tmp / ckpt::rank_file_name(rank_)).string());
      error = ckpt::finish_staging(snap_);
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  snap_.pending.clear();  // the live tensors are not held past the copy
  release_staged();
  return error;
}

void AsyncSaveJob::release_staged() noexcept {
  if (staged_set_) return;
  staged_set_ = true;
  staged_.set_value();
}

// This rank's file, staged first where the call left copies; a rank other than 0 then
// leaves its marker for rank 0.
std::string AsyncSaveJob::write_rank_file() {
  using namespace ckpt;
  const std::string file = (plan_.tmp / rank_file_name(rank_)).string();
  std::string error = stage_pending();
  if (!error.empty()) {
    error = "staging " + file + " failed: " + error;
  } else {
    try {
      detail::call_save_hook(model_, "write", file);
      write_snapshot(file, snap_);
      if (rank_ != 0) write_atomically(plan_.tmp / done_marker(rank_), "");
      return "";
    } catch (const std::exception& e) {
      error = std::string("writing ") + file + " failed: " + e.what();
    }
  }
  try {
    if (rank_ != 0) write_atomically(plan_.tmp / failed_marker(rank_), error);
  } catch (const std::exception&) {
    // rank 0 then waits until its stall limit, and says so
  }
  return error;
}

// Rank 0, its own file written: publishes once every other rank's file is complete.
std::string AsyncSaveJob::publish_when_complete() {
  using namespace ckpt;
  try {
    std::string error = wait_for_other_ranks();
    if (!error.empty()) return error;
    for (int r = 1; r < world_; ++r) fs::remove(plan_.tmp / done_marker(r));
    detail::call_save_hook(model_, "publish", plan_.final_dir.string());
    publish(plan_, options_.keep_last);
    if (options_.verbose) report_saved(plan_, world_, t0_, ", in the background");
    return "";
  } catch (const std::exception& e) {
    return std::string("publishing ") + plan_.final_dir.string() + " failed: " + e.what();
  }
}

// Note [Cross-rank completion]: "" once every other rank's done marker is there; a
// failed rank's error, or the stall, otherwise.
std::string AsyncSaveJob::wait_for_other_ranks() {
  // No deadline while the files grow: a slow disk is not a failure. Stalled for the
  // process group's collective timeout (FSDP_TIMEOUT_S, default 300 s), it gives up.
  auto last_change = std::chrono::steady_clock::now();
  uintmax_t last_bytes = 0;
  for (;;) {
    int done = 1;  // rank 0's own file, written by this thread
    uintmax_t bytes = 0;
    for (int r = 1; r < world_; ++r) {
      if (fs::exists(plan_.tmp / ckpt::failed_marker(r))) {
        std::ifstream in(plan_.tmp / ckpt::failed_marker(r));
        std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        return "rank " + std::to_string(r) + ": " + text;
      }
      if (fs::exists(plan_.tmp / ckpt::done_marker(r))) ++done;
      std::error_code ec;
      const auto n = fs::file_size(plan_.tmp / ckpt::rank_file_name(r), ec);
      if (!ec) bytes += n;
    }
    if (done == world_) return "";
    const auto now = std::chrono::steady_clock::now();
    if (bytes != last_bytes) {
      last_bytes = bytes;
      last_change = now;
    } else if (std::chrono::duration<double>(now - last_change).count() > stall_s_) {
      std::ostringstream msg;
      msg << "waited " << stall_s_
          << " s (the process group's timeout, FSDP_TIMEOUT_S) for the other ranks' files in "
          << plan_.tmp.string() << " without progress: " << done << " of " << world_ << " complete";
      return msg.str();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

namespace ckpt {
namespace {

std::mutex in_flight_mu;
std::shared_ptr<AsyncSaveJob>
    in_flight;  ///< the last asynchronous save, until the next save settles it

}  // namespace

std::shared_ptr<AsyncSaveJob> start_async_save(const ShardedModel& model, SavePlan plan,
                                               RankSnapshot snap, int rank, int world,
                                               double stall_s, const ckpt::SaveOptions& options) {
  auto job = std::make_shared<AsyncSaveJob>(model, std::move(plan), std::move(snap), rank, world,
                                            stall_s, options);
  job->start();
  std::lock_guard<std::mutex> lock(in_flight_mu);
  in_flight = job;
  return job;
}

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
      failure_detail(error),
      ". `latest` still names the checkpoint before it, and this call saved nothing; call it "
      "again to save.");
}

void wait_for_staging() {
  std::shared_ptr<AsyncSaveJob> job;
  {
    std::lock_guard<std::mutex> lock(in_flight_mu);
    job = in_flight;
  }
  if (job) job->wait_staged();
}

void wait_for_async_save() {
  std::shared_ptr<AsyncSaveJob> job;
  {
    std::lock_guard<std::mutex> lock(in_flight_mu);
    job = in_flight;
  }
  if (job) job->join();
}

}  // namespace ckpt

ckpt::AsyncSave::AsyncSave(std::shared_ptr<AsyncSaveJob> job) : job_(std::move(job)) {}
ckpt::AsyncSave::AsyncSave(ckpt::AsyncSave&&) noexcept = default;
ckpt::AsyncSave& ckpt::AsyncSave::operator=(ckpt::AsyncSave&& other) noexcept {
  if (this != &other) {
    if (job_) job_->join();
    job_ = std::move(other.job_);
  }
  return *this;
}
ckpt::AsyncSave::~AsyncSave() {
  if (job_) job_->join();
}

std::string ckpt::AsyncSave::wait() {
  TORCH_CHECK(job_, "AsyncSave::wait: this handle holds no save");
  const std::string& error = job_->join();
  TORCH_CHECK(error.empty(), "the asynchronous save of ", job_->path(), " failed: ", error,
              ". `latest` still names the checkpoint before it.");
  return job_->path();
}

void ckpt::AsyncSave::wait_staged() {
  if (job_) job_->wait_staged();
}

double ckpt::AsyncSave::staging_wait_s() const { return job_ ? job_->staging_wait_s() : 0.0; }

bool ckpt::AsyncSave::done() const { return !job_ || job_->finished(); }

std::string ckpt::AsyncSave::path() const { return job_ ? job_->path() : std::string(); }

void ckpt::release_checkpoint_staging(const ShardedModel& model) {
  ckpt::wait_for_async_save();
  auto& pool = detail::checkpoint_staging_pool(model);
  detail::account_checkpoint_staging(model, -ckpt::staged_bytes(pool));
  pool.clear();
}

}  // namespace fsdp
