#include "async_save.h"

#include "agree.h"
#include "layout.h"
#include "publish.h"
#include "save_hook.h"

#include "internal/sharded_model.h"

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>
#include <thread>

namespace fs = std::filesystem;

namespace fsdp {
namespace ckpt {
namespace {

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
    call_save_hook("write", file);
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
        call_save_hook("publish", plan_.final_dir.string());
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

}  // namespace

std::shared_ptr<AsyncSaveJob> start_async_save(const ShardedModel& model, SavePlan plan,
                                               RankSnapshot snap, int rank, int world,
                                               double stall_s, const SaveOptions& options) {
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
      failure_detail(error, " on another rank (see its error)"),
      ". `latest` still names the checkpoint before it, and this call saved nothing; call it "
      "again to save.");
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

bool AsyncSave::done() const { return !job_ || job_->finished(); }

std::string AsyncSave::path() const { return job_ ? job_->path() : std::string(); }

void release_checkpoint_staging(const ShardedModel& model) {
  ckpt::wait_for_async_save();
  auto& pool = detail::checkpoint_staging_pool(model);
  detail::account_checkpoint_staging(model, -ckpt::staged_bytes(pool));
  pool.clear();
}

}  // namespace fsdp
