#pragma once
// Note [Per-unit trace]
// With ShardingOptions::trace or FSDP_TRACE set to a directory, every rank records when
// each unit's all-gather, forward, backward, recompute and reduce-scatter ran, the
// optimizer step, checkpoint I/O and every wait for a collective, and writes them as a
// Chrome-trace/Perfetto JSON file, <dir>/trace_rank<R>.json (`fsdp-trace merge` joins
// the ranks' files into one). Tracks:
//  - compute: spans of the thread that ran them (forward, backward, recompute,
//    optimizer, checkpoint, waits), one track per thread;
//  - communication: each collective from the moment it is issued until it completes
//    (the backend's completion callback where it has one, else the wait's return);
//  - copy: host <-> device copies of the offload path.
// Spans on one track that overlap without nesting (two collectives in flight at once)
// are laid on lanes of their own when written, so every lane nests properly.
// The same spans (those that begin and end on one thread) are LibTorch profiler ranges
// (at::RecordFunction, user scope), so a Kineto trace of the program shows them too.
// Off (the default), the cost is one relaxed atomic load per span site: nothing is
// allocated or timed. On, a span is two clock reads and one append under a mutex; the
// file is written when the sharded model goes (Runtime's destructor), at process exit,
// and on trace::flush().

#include <ATen/record_function.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

namespace fsdp::detail::trace {

enum class Track : uint8_t { kCompute, kComm, kCopy };

/// Whether spans are recorded. Relaxed: a span racing with start() may go unrecorded.
inline std::atomic<bool>& enabled_flag() {
  static std::atomic<bool> on{false};
  return on;
}
inline bool on() { return enabled_flag().load(std::memory_order_relaxed); }

/// Nanoseconds on the steady clock (CLOCK_MONOTONIC: one clock for every process of a
/// host).
int64_t now_ns();

/// Starts recording for this process into `dir`/trace_rank<rank>.json (made if missing;
/// a clear error if it cannot be). Later calls with the same directory are no-ops; with
/// another directory they fail, naming both. `world` goes into the file's metadata.
void start(const std::string& dir, int rank, int world);
/// The directory ShardingOptions::trace names, or FSDP_TRACE's when that is empty; ""
/// when neither is set.
std::string directory_from(const std::string& option);
/// Records "the ranks left a barrier now": the merge tool aligns ranks' clocks on it.
void mark_sync();
/// One finished span. `args` is a JSON object's members (e.g. "\"bytes\":4096") or "".
void span(std::string name, const char* category, Track track, int64_t begin_ns, int64_t end_ns,
          std::string args = {});
/// Writes the file now (all spans so far). Errors go to stderr: tracing never fails a run.
void flush();

/// Names the checkpointed region (a wrap point's FQN) that fsdp::activation_checkpoint calls on
/// this thread inside its scope, for the region's "recompute" span in backward.
class RegionName {
 public:
  explicit RegionName(std::string name);
  ~RegionName();
  RegionName(const RegionName&) = delete;
  RegionName& operator=(const RegionName&) = delete;
  /// The innermost name in scope on this thread; "" outside any.
  static const std::string& current();

 private:
  std::string previous_;
};

/// A span from construction to destruction on this thread's compute track, and a
/// profiler range of the same name. `name` is only built when tracing or profiling is on:
/// pass a callable returning the name.
class Scope {
 public:
  template <class NameFn>
  Scope(const char* category, NameFn&& name) {
    if (on()) {
      name_ = name();
      begin_ = now_ns();
      category_ = category;
      range(name_);
    } else if (at::hasCallbacks()) {
      range(name());
    }
  }
  ~Scope();
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  void range(const std::string& name);
  std::string name_;
  const char* category_ = nullptr;
  int64_t begin_ = 0;
  std::unique_ptr<at::RecordFunction> record_;
};

/// A span opened in one call and closed in another on the same thread (a unit's
/// forward: pre_forward() to post_forward()), with its profiler range. open() while open
/// closes the earlier one first.
class OpenSpan {
 public:
  template <class NameFn>
  void open(const char* category, NameFn&& name) {
    close();
    if (on()) {
      name_ = name();
      begin_ = now_ns();
      category_ = category;
      open_ = true;
      range(name_);
    } else if (at::hasCallbacks()) {
      open_ = true;
      range(name());
    }
  }
  void close();
  bool is_open() const { return open_; }

 private:
  void range(const std::string& name);
  bool open_ = false;
  std::string name_;
  const char* category_ = nullptr;
  int64_t begin_ = 0;
  std::unique_ptr<at::RecordFunction> record_;
};

}  // namespace fsdp::detail::trace
