// The per-unit trace (Note [Per-unit trace]): a GPT trained two steps at world 2 with
// ShardingOptions::trace; the spans' order and nesting read back from each rank's file,
// the ranks merged by fsdp-trace, the same spans as LibTorch profiler ranges, and what
// happens when the trace is off or its directory cannot be made.
#include "support/models.h"
#include "support/multirank.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

using namespace fsdp;
using namespace fsdp::testing;
// Every case of this file in a namespace of its own: the test binaries compile their files in
// batches (tests/CMakeLists.txt, "Test binaries"), where anonymous namespaces would merge.
namespace test_trace_cases {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Span {
  std::string name;
  std::string cat;
  int tid = 0;
  double begin = 0;
  double end = 0;
  bool contains(const Span& o) const { return begin <= o.begin && o.end <= end; }
};

std::vector<Span> spans_of(const json& trace, int pid) {
  std::vector<Span> out;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.value("ph", "") != "X" || e.value("pid", -1) != pid) continue;
    const double ts = e.at("ts").get<double>();
    out.push_back({e.at("name"), e.at("cat"), e.at("tid"), ts, ts + e.at("dur").get<double>()});
  }
  std::stable_sort(out.begin(), out.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end > b.end;
  });
  return out;
}

json read(const fs::path& p) {
  std::ifstream f(p);
  EXPECT_TRUE(f.good()) << "no trace file " << p;
  return json::parse(f);
}

// A trace directory shared by the ranks of one run_ranks call (their MASTER_PORT is).
std::string run_dir(const std::string& stem) {
  const char* port = std::getenv("MASTER_PORT");
  return (fs::temp_directory_path() / (stem + "_" + (port ? port : "0"))).string();
}

// Two training steps of a 3-block GPT: block 1 recomputed under activation
// checkpointing, clipping and FusedAdamW, sharded over `pg`, traced into `dir`.
void train_two_steps(const ProcessGroup& pg, const std::string& dir, bool prefetch) {
  auto cfg = small_gpt_config();
  cfg.n_layer = 3;
  torch::manual_seed(5);
  ShardingOptions o;
  o.process_group = pg;
  o.trace = dir;
  o.prefetch = prefetch;
  o.checkpoint_policy = wrap::predicate_policy(
      [](const std::string& fqn, const torch::nn::Module&, int64_t) { return fqn == "blocks.1"; });
  auto model = fully_shard(gpt::GPT(cfg), o);
  FusedAdamW opt(model);
  for (int64_t step = 0; step < 2; ++step) {
    opt.zero_grad();
    gpt::loss_on(model, my_rows(gpt_batch(step, 4, cfg.block_size), pg)).backward();
    clip_grad_norm_(model, 1.0);
    opt.step();
  }
}  // the model goes: its trace is written

const Span* find(const std::vector<Span>& s, const std::string& name, double after = -1) {
  for (const auto& x : s) {
    if (x.name == name && x.begin >= after) return &x;
  }
  return nullptr;
}

// Every lane (tid) of a rank's spans nests: a span starts after the innermost open one
// ends, or ends inside it.
void expect_nested(const std::vector<Span>& spans) {
  std::map<int, std::vector<const Span*>> open;
  for (const auto& s : spans) {
    auto& stack = open[s.tid];
    while (!stack.empty() && stack.back()->end <= s.begin) stack.pop_back();
    if (!stack.empty()) {
      EXPECT_LE(s.end, stack.back()->end)
          << "'" << s.name << "' overlaps '" << stack.back()->name << "' on lane " << s.tid;
    }
    stack.push_back(&s);
  }
}

// The spans of the second step (the first records the forward order; prefetch follows
// it from the second on): from its first "forward <root>".
std::vector<Span> second_step(const std::vector<Span>& spans) {
  const Span* first = find(spans, "forward <root>");
  EXPECT_NE(first, nullptr);
  const Span* second = first ? find(spans, "forward <root>", first->end) : nullptr;
  EXPECT_NE(second, nullptr);
  std::vector<Span> out;
  if (second == nullptr) return out;
  // Collectives of step 2 may be issued (prefetched) just before its root forward starts.
  for (const auto& s : spans) {
    if (s.begin >= second->begin || (s.cat == "comm" && s.end > second->begin)) out.push_back(s);
  }
  return out;
}

void check_rank(const json& trace, int rank, bool prefetch) {
  ASSERT_EQ(trace.at("otherData").at("rank").get<int>(), rank);
  ASSERT_EQ(trace.at("otherData").at("world").get<int>(), 2);
  ASSERT_TRUE(trace.at("otherData").contains("sync_ts"));
  const auto all = spans_of(trace, rank);
  expect_nested(all);
  const auto s = second_step(all);
  const std::vector<std::string> blocks{"blocks.0", "blocks.1", "blocks.2"};

  // Forward in module order, backward in reverse, each inside the root's.
  const Span* root_fwd = find(s, "forward <root>");
  const Span* root_bwd = find(s, "backward <root>");
  ASSERT_NE(root_fwd, nullptr);
  ASSERT_NE(root_bwd, nullptr);
  std::vector<const Span*> fwd, bwd;
  for (const auto& b : blocks) {
    fwd.push_back(find(s, "forward " + b));
    bwd.push_back(find(s, "backward " + b));
    ASSERT_NE(fwd.back(), nullptr) << b;
    ASSERT_NE(bwd.back(), nullptr) << b;
    EXPECT_TRUE(root_fwd->contains(*fwd.back())) << b;
    EXPECT_TRUE(root_bwd->contains(*bwd.back())) << b;
  }
  for (size_t i = 1; i < blocks.size(); ++i) {
    EXPECT_LE(fwd[i - 1]->end, fwd[i]->begin) << blocks[i];
    EXPECT_LE(bwd[i]->end, bwd[i - 1]->begin) << blocks[i];
  }
  EXPECT_LE(root_fwd->end, root_bwd->begin);

  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string& b = blocks[i];
    // The gather that forward used completed before the forward's computation ended, and
    // was issued before it began or inside it; the next block's gather (a prefetch) was
    // issued while this block computed, or only once the next one began without prefetch.
    const Span* gather = nullptr;
    for (const auto& x : s) {
      if (x.name == "all_gather " + b && x.begin <= fwd[i]->end) gather = &x;
    }
    ASSERT_NE(gather, nullptr) << b;
    EXPECT_LE(gather->end, fwd[i]->end) << b;
    if (i + 1 < blocks.size()) {
      const Span* next = find(s, "all_gather " + blocks[i + 1]);
      ASSERT_NE(next, nullptr);
      if (prefetch) {
        EXPECT_LT(next->begin, fwd[i]->end) << blocks[i + 1] << " was not prefetched";
      } else {
        EXPECT_GE(next->begin, fwd[i]->end) << blocks[i + 1] << " was gathered early";
      }
    }
    // The reduce-scatter is issued inside the unit's backward.
    const Span* rs = find(s, "reduce_scatter " + b, bwd[i]->begin);
    ASSERT_NE(rs, nullptr) << b;
    EXPECT_LE(rs->begin, bwd[i]->end) << b;
  }
  // Block 1 alone is recomputed, inside its backward.
  const Span* rec = find(s, "recompute blocks.1");
  ASSERT_NE(rec, nullptr);
  EXPECT_TRUE(bwd[1]->contains(*rec));
  EXPECT_EQ(find(s, "recompute blocks.0"), nullptr);
  EXPECT_EQ(find(s, "recompute blocks.2"), nullptr);
  // Clipping and the optimizer step follow backward's end.
  const Span* end_bwd = find(s, "end of backward");
  const Span* clip = find(s, "clip_grad_norm");
  const Span* step = find(s, "optimizer step");
  ASSERT_NE(end_bwd, nullptr);
  ASSERT_NE(clip, nullptr);
  ASSERT_NE(step, nullptr);
  EXPECT_LE(root_bwd->end, end_bwd->begin);
  EXPECT_LE(end_bwd->end, clip->begin);
  EXPECT_LE(clip->end, step->begin);
  // Every wait of the step sits inside the compute span that needed the collective.
  int waits = 0;
  for (const auto& w : s) {
    if (w.cat != "wait" || w.begin >= step->end) continue;
    ++waits;
    bool inside = false;
    for (const auto& c : s) {
      if (&c != &w && c.cat != "wait" && c.cat != "comm" && c.tid == w.tid && c.contains(w)) {
        inside = true;
      }
    }
    EXPECT_TRUE(inside) << "'" << w.name << "' is not inside a compute span";
  }
  EXPECT_GT(waits, 0);
}

void traced_run_checks_out(bool prefetch) {
  run_ranks(2, [prefetch](const ProcessGroup& pg) {
    const std::string dir = run_dir(prefetch ? "fsdp_trace_prefetch" : "fsdp_trace_no_prefetch");
    train_two_steps(pg, dir, prefetch);
    pg.barrier();  // both files are written
    if (pg.rank() != 0) return;
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      check_rank(read(fs::path(dir) / ("trace_rank" + std::to_string(r) + ".json")), r, prefetch);
    }
    // Merged: both ranks, on one clock starting at 0, the same names in the same order.
    auto merged = run_command({bin_dir() + "/fsdp-trace", "merge", dir});
    ASSERT_EQ(merged.exit_code, 0) << merged.output;
    const json m = read(fs::path(dir) / "trace.json");
    auto names = [](const std::vector<Span>& v) {
      std::vector<std::string> n;
      for (const auto& x : v) {
        if (x.cat != "comm" && x.cat != "wait") n.push_back(x.name);
      }
      return n;
    };
    const auto r0 = spans_of(m, 0), r1 = spans_of(m, 1);
    ASSERT_FALSE(r0.empty());
    EXPECT_EQ(names(r0), names(r1));
    double first = 1e300;
    for (const auto& x : r0) first = std::min(first, x.begin);
    for (const auto& x : r1) first = std::min(first, x.begin);
    EXPECT_EQ(first, 0.0);
    auto summary = run_command({bin_dir() + "/fsdp-trace", "summary", dir + "/trace.json"});
    ASSERT_EQ(summary.exit_code, 0) << summary.output;
    EXPECT_NE(summary.output.find("rank 1:"), std::string::npos) << summary.output;
    EXPECT_NE(summary.output.find("hidden behind compute"), std::string::npos) << summary.output;
    EXPECT_NE(summary.output.find("blocks.2"), std::string::npos) << summary.output;
    fs::remove_all(dir);
  });
}

}  // namespace

TEST(Trace, SpansOfAGptStepAreOrderedAndNestedWithPrefetchAtWorld2) { traced_run_checks_out(true); }

TEST(Trace, WithoutPrefetchEachGatherStartsOnlyWhenItsUnitRuns) { traced_run_checks_out(false); }

// The same spans reach LibTorch's profiler (what Kineto records) as user-scope ranges,
// also with the trace off; and off, no file is written.
TEST(Trace, SpansAreProfilerRangesAndOffWritesNothing) {
  run_ranks(2, [](const ProcessGroup& pg) {
    ASSERT_EQ(std::getenv("FSDP_TRACE"), nullptr);
    static std::mutex mu;
    static std::multiset<std::string> ranges;
    auto handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback([](const at::RecordFunction& fn)
                                       -> std::unique_ptr<at::ObserverContext> {
          std::lock_guard<std::mutex> lock(mu);
          ranges.insert(fn.name());
          return nullptr;
        }).scopes({at::RecordScope::USER_SCOPE}));
    auto cfg = small_gpt_config();
    ShardingOptions o;
    o.process_group = pg;
    auto model = fully_shard(gpt::GPT(cfg), o);
    FusedAdamW opt(model);
    gpt::loss_on(model, my_rows(gpt_batch(0, 4, cfg.block_size), pg)).backward();
    opt.step();
    at::removeCallback(handle);
    for (const char* name :
         {"forward <root>", "forward blocks.0", "forward blocks.1", "backward <root>",
          "backward blocks.0", "backward blocks.1", "optimizer step", "end of backward"}) {
      EXPECT_EQ(ranges.count(name), 1u) << name;
    }
    EXPECT_GE(ranges.count("wait all_gather blocks.1"), 1u);
    // Off: nothing recorded anywhere a file could go.
    EXPECT_FALSE(fs::exists(fs::current_path() / "trace_rank0.json"));
  });
}

// A Kineto trace, as torch.profiler writes it, names the library's spans. Skipped where
// LibTorch was built without Kineto.
TEST(Trace, AKinetoTraceShowsTheSameSpans) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  using torch::profiler::impl::ProfilerState;
  const torch::profiler::impl::ProfilerConfig config(ProfilerState::KINETO);
  try {
    prof::prepareProfiler(config, {ActivityType::CPU});
    prof::enableProfiler(config, {ActivityType::CPU});
  } catch (const c10::Error& e) {
    GTEST_SKIP() << "this LibTorch's profiler has no Kineto: " << e.what_without_backtrace();
  }
  {
    auto cfg = small_gpt_config();
    auto model = fully_shard(gpt::GPT(cfg));
    FusedAdamW opt(model);
    gpt::loss_on(model, gpt_batch(0, 4, cfg.block_size)).backward();
    opt.step();
  }
  auto result = prof::disableProfiler();
  const fs::path file = fs::temp_directory_path() / "fsdp_trace_kineto.json";
  result->save(file.string());
  const json trace = read(file);
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.contains("name")) names.insert(e.at("name").get<std::string>());
  }
  for (const char* name : {"forward <root>", "forward blocks.0", "backward blocks.1",
                           "end of backward", "optimizer step"}) {
    EXPECT_EQ(names.count(name), 1u) << name << " is not in the Kineto trace " << file;
  }
  fs::remove(file);
}

TEST(Trace, ADirectoryThatCannotBeMadeIsAClearError) {
  run_ranks(1, [](const ProcessGroup& pg) {
    ShardingOptions o;
    o.process_group = pg;
    o.trace = "/proc/fsdp-no-such-dir/trace";
    try {
      fully_shard(gpt::GPT(small_gpt_config()), o);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("cannot make the directory '/proc/fsdp-no-such-dir/trace'"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("ShardingOptions::trace or FSDP_TRACE"), std::string::npos) << what;
    }
  });
}

TEST(Trace, ASecondDirectoryOrAnUnwritableFileIsRefusedNamingIt) {
  run_ranks(1, [](const ProcessGroup& pg) {
    const fs::path dir = fs::temp_directory_path() / ("fsdp_trace_two_" + std::to_string(getpid()));
    // A directory where the rank's file should go: the file cannot be written.
    fs::create_directories(dir / "blocked" / "trace_rank0.json");
    ShardingOptions o;
    o.process_group = pg;
    o.trace = (dir / "blocked").string();
    try {
      fully_shard(gpt::GPT(small_gpt_config()), o);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(what.find("FSDP trace: cannot write '" +
                          (dir / "blocked" / "trace_rank0.json").string() + "'"),
                std::string::npos)
          << what;
    }
    o.trace = (dir / "first").string();
    auto first = fully_shard(gpt::GPT(small_gpt_config()), o);
    o.trace = (dir / "second").string();
    try {
      fully_shard(gpt::GPT(small_gpt_config()), o);
      ADD_FAILURE() << "no error";
    } catch (const c10::Error& e) {
      const std::string what = e.what_without_backtrace();
      EXPECT_NE(
          what.find("this process already traces into '" + (dir / "first").string() +
                    "'; a second sharded model asked for '" + (dir / "second").string() + "'"),
          std::string::npos)
          << what;
    }
    fs::remove_all(dir);
  });
}

TEST(Trace, MergeRefusesAFileThatIsNotATraceAndRanksOfTwoRuns) {
  const fs::path dir = fs::temp_directory_path() / ("fsdp_trace_bad_" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "trace_rank0.json") << "{";
  auto bad = run_command({bin_dir() + "/fsdp-trace", "merge", dir.string()});
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("trace_rank0.json is not a trace (JSON)"), std::string::npos)
      << bad.output;
  auto meta = [](int world) {
    return json{{"traceEvents", json::array()}, {"otherData", {{"rank", 0}, {"world", world}}}}
        .dump();
  };
  std::ofstream(dir / "trace_rank0.json") << meta(2);
  std::ofstream(dir / "trace_rank1.json") << meta(4);
  auto mixed = run_command({bin_dir() + "/fsdp-trace", "merge", dir.string()});
  EXPECT_EQ(mixed.exit_code, 1) << mixed.output;
  EXPECT_NE(mixed.output.find("the directory mixes runs"), std::string::npos) << mixed.output;
  auto unknown = run_command({bin_dir() + "/fsdp-trace", "split", dir.string()});
  EXPECT_EQ(unknown.exit_code, 2) << unknown.output;
  EXPECT_NE(unknown.output.find("unknown command 'split'"), std::string::npos) << unknown.output;
  fs::remove_all(dir);
}

TEST(Trace, MergeNamesAMissingDirectoryAndAnEmptyOne) {
  auto missing = run_command({bin_dir() + "/fsdp-trace", "merge", "/nonexistent/fsdp-trace"});
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_NE(missing.output.find("'/nonexistent/fsdp-trace' is not a directory"), std::string::npos)
      << missing.output;
  const fs::path empty = fs::temp_directory_path() / "fsdp_trace_empty_dir";
  fs::create_directories(empty);
  auto none = run_command({bin_dir() + "/fsdp-trace", "merge", empty.string()});
  EXPECT_EQ(none.exit_code, 2) << none.output;
  EXPECT_NE(none.output.find("no trace_rank<R>.json files"), std::string::npos) << none.output;
  fs::remove_all(empty);
}

}  // namespace test_trace_cases
