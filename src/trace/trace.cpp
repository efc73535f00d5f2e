// The per-unit trace (Note [Per-unit trace] in trace.h): recording and the file format.
#include "trace.h"

#include <fsdp/trace.h>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <vector>

namespace fsdp::detail::trace {
namespace {

struct Event {
  std::string name;
  const char* category;
  Track track;
  int thread;  ///< ordinal of the recording thread (compute track); -1 otherwise
  int64_t begin_ns;
  int64_t end_ns;
  std::string args;
};

struct State {
  std::mutex mu;
  std::string dir;
  int rank = 0;
  int world = 1;
  int64_t sync_ns = -1;  ///< the last mark_sync()
  std::vector<Event> events;
  size_t flushed = 0;  ///< events.size() at the last write
  bool exit_hook = false;
};

State& state() {
  static State* s = new State();  // never destroyed: spans may come from exiting threads
  return *s;
}

std::atomic<int> g_threads{0};
int thread_ordinal() {
  thread_local int id = g_threads.fetch_add(1);
  return id;
}

std::string file_of(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("trace_rank" + std::to_string(rank) + ".json")).string();
}

// Lays spans of one track on lanes so that each lane nests properly: a span goes on the
// first lane where it starts after the lane's open spans end, or ends within the
// innermost one.
std::vector<int> assign_lanes(const std::vector<const Event*>& spans) {
  std::vector<int> lane(spans.size());
  std::vector<std::vector<int64_t>> open;  // per lane: ends of the open spans, innermost last
  for (size_t i = 0; i < spans.size(); ++i) {
    const Event& e = *spans[i];
    size_t l = 0;
    for (;; ++l) {
      if (l == open.size()) open.emplace_back();
      auto& stack = open[l];
      while (!stack.empty() && stack.back() <= e.begin_ns) stack.pop_back();
      if (stack.empty() || e.end_ns <= stack.back()) break;
    }
    open[l].push_back(e.end_ns);
    lane[i] = static_cast<int>(l);
  }
  return lane;
}

nlohmann::json to_json(const State& s) {
  using nlohmann::json;
  json events = json::array();
  const int pid = s.rank;
  events.push_back({{"ph", "M"},
                    {"pid", pid},
                    {"name", "process_name"},
                    {"args", {{"name", "rank " + std::to_string(s.rank)}}}});
  events.push_back({{"ph", "M"},
                    {"pid", pid},
                    {"name", "process_sort_index"},
                    {"args", {{"sort_index", s.rank}}}});
  // Group by track (and thread for compute), in begin order, outer spans first.
  std::map<std::pair<int, int>, std::vector<const Event*>> groups;
  for (const auto& e : s.events) {
    groups[{static_cast<int>(e.track), e.track == Track::kCompute ? e.thread : -1}].push_back(&e);
  }
  for (auto& [key, spans] : groups) {
    std::stable_sort(spans.begin(), spans.end(), [](const Event* a, const Event* b) {
      return a->begin_ns != b->begin_ns ? a->begin_ns < b->begin_ns : a->end_ns > b->end_ns;
    });
    const auto lanes = assign_lanes(spans);
    const auto track = static_cast<Track>(key.first);
    const int base = track == Track::kCompute ? 100 * (key.second + 1)
                     : track == Track::kComm  ? 10000
                                              : 20000;
    const std::string title = track == Track::kCompute
                                  ? "compute (thread " + std::to_string(key.second) + ")"
                              : track == Track::kComm ? "communication"
                                                      : "copy";
    const int n_lanes = lanes.empty() ? 0 : *std::max_element(lanes.begin(), lanes.end()) + 1;
    for (int l = 0; l < n_lanes; ++l) {
      events.push_back(
          {{"ph", "M"},
           {"pid", pid},
           {"tid", base + l},
           {"name", "thread_name"},
           {"args", {{"name", l == 0 ? title : title + " " + std::to_string(l + 1)}}}});
      events.push_back({{"ph", "M"},
                        {"pid", pid},
                        {"tid", base + l},
                        {"name", "thread_sort_index"},
                        {"args", {{"sort_index", base + l}}}});
    }
    for (size_t i = 0; i < spans.size(); ++i) {
      const Event& e = *spans[i];
      json ev = {{"ph", "X"},
                 {"pid", pid},
                 {"tid", base + lanes[i]},
                 {"name", e.name},
                 {"cat", e.category},
                 {"ts", static_cast<double>(e.begin_ns) / 1e3},
                 {"dur", static_cast<double>(e.end_ns - e.begin_ns) / 1e3}};
      if (!e.args.empty()) ev["args"] = json::parse("{" + e.args + "}");
      events.push_back(std::move(ev));
    }
  }
  json meta = {{"rank", s.rank}, {"world", s.world}, {"clock", "steady_clock (CLOCK_MONOTONIC)"}};
  if (s.sync_ns >= 0) meta["sync_ts"] = static_cast<double>(s.sync_ns) / 1e3;
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", meta}};
}

}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string directory_from(const std::string& option) {
  if (!option.empty()) return option;
  const char* env = std::getenv("FSDP_TRACE");
  return env != nullptr ? std::string(env) : std::string();
}

void start(const std::string& dir, int rank, int world) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (!s.dir.empty()) {
      TORCH_CHECK(s.dir == dir, "FSDP trace: this process already traces into '", s.dir,
                  "'; a second sharded model asked for '", dir,
                  "'. One process writes one trace: give every model the same "
                  "ShardingOptions::trace (or FSDP_TRACE).");
      return;
    }
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    TORCH_CHECK(!ec && std::filesystem::is_directory(dir),
                "FSDP trace: cannot make the directory '", dir,
                "' that ShardingOptions::trace or FSDP_TRACE names (",
                ec ? ec.message() : std::string("not a directory"),
                "); name a writable directory, or leave both unset to trace nothing.");
    const std::string probe = file_of(dir, rank);
    {
      std::ofstream f(probe, std::ios::trunc);
      TORCH_CHECK(f.good(), "FSDP trace: cannot write '", probe,
                  "'; name a writable directory in ShardingOptions::trace or FSDP_TRACE.");
    }
    s.dir = dir;
    s.rank = rank;
    s.world = world;
    s.events.reserve(4096);
    if (!s.exit_hook) {
      s.exit_hook = true;
      std::atexit([]() { flush(); });
    }
  }
  thread_ordinal();  // the thread that starts tracing is thread 0
  enabled_flag().store(true);
}

void mark_sync() {
  if (!on()) return;
  const int64_t t = now_ns();
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  s.sync_ns = t;
}

void span(std::string name, const char* category, Track track, int64_t begin_ns, int64_t end_ns,
          std::string args) {
  const int thread = track == Track::kCompute ? thread_ordinal() : -1;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.dir.empty()) return;
  s.events.push_back(Event{std::move(name), category, track, thread, begin_ns,
                           std::max(end_ns, begin_ns), std::move(args)});
}

void flush() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (s.dir.empty() || (s.flushed == s.events.size() && s.flushed > 0)) return;
  const std::string file = file_of(s.dir, s.rank);
  const std::string tmp = file + ".tmp";
  try {
    {
      std::ofstream f(tmp, std::ios::trunc);
      f << to_json(s).dump() << "\n";
      f.close();
      if (!f.good()) throw std::runtime_error("write failed");
    }
    std::filesystem::rename(tmp, file);
    s.flushed = s.events.size();
  } catch (const std::exception& e) {
    std::cerr << "FSDP trace: could not write " << file << ": " << e.what() << "\n";
  }
}

namespace {
thread_local std::string t_region;

std::unique_ptr<at::RecordFunction> profiler_range(const std::string& name) {
  auto r = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (!r->isActive()) return nullptr;
  r->before(name);
  return r;
}
}  // namespace

RegionName::RegionName(std::string name) : previous_(std::move(t_region)) {
  t_region = std::move(name);
}
RegionName::~RegionName() { t_region = std::move(previous_); }
const std::string& RegionName::current() { return t_region; }

void Scope::range(const std::string& name) { record_ = profiler_range(name); }

Scope::~Scope() {
  record_.reset();
  if (category_ != nullptr) span(std::move(name_), category_, Track::kCompute, begin_, now_ns());
}

void OpenSpan::range(const std::string& name) { record_ = profiler_range(name); }

void OpenSpan::close() {
  if (!open_) return;
  open_ = false;
  record_.reset();
  if (category_ != nullptr) {
    span(std::move(name_), category_, Track::kCompute, begin_, now_ns());
    category_ = nullptr;
  }
}

}  // namespace fsdp::detail::trace

namespace fsdp {

struct TraceScope::Impl {
  detail::trace::Scope scope;
  explicit Impl(const std::string& name) : scope("user", [&]() { return name; }) {}
};

TraceScope::TraceScope(const std::string& name) {
  if (detail::trace::on() || at::hasCallbacks()) impl_ = std::make_unique<Impl>(name);
}
TraceScope::~TraceScope() = default;

void flush_trace() { detail::trace::flush(); }

}  // namespace fsdp
