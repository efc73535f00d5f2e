// fsdp-trace: joins and reads the per-rank traces that ShardingOptions::trace or
// FSDP_TRACE write (Note [Per-unit trace] in src/trace/trace.h).
//
//   fsdp-trace merge DIR [-o FILE]   DIR/trace_rank*.json -> one Chrome-trace/Perfetto JSON
//                                    (default DIR/trace.json), one process per rank, the
//                                    ranks' clocks aligned on the barrier they left
//                                    together, time starting at 0
//   fsdp-trace summary PATH          per rank (PATH: a merged file, a rank's file or DIR):
//                                    time in each kind of span, how much of the
//                                    communication the compute track waited for, and
//                                    each unit's mean all-gather, forward, backward and
//                                    reduce-scatter
// Needs no LibTorch.
#include <fsdp/version.h>
#include "tool_main.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <vector>

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using fsdp::tools::UsageError;

json read_json(const fs::path& p) {
  std::ifstream f(p);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  try {
    return json::parse(f);
  } catch (const json::exception& e) {
    throw std::runtime_error(p.string() + " is not a trace (JSON): " + e.what() +
                             ". A rank that is still running, or was killed, writes its file only "
                             "when its model goes or the process exits.");
  }
}

// The rank files of DIR, by rank.
std::map<int, fs::path> rank_files(const fs::path& dir) {
  std::map<int, fs::path> out;
  const std::regex name("trace_rank([0-9]+)\\.json");
  for (const auto& e : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string f = e.path().filename().string();
    if (std::regex_match(f, m, name)) out[std::stoi(m[1])] = e.path();
  }
  if (out.empty()) {
    throw UsageError("no trace_rank<R>.json files in " + dir.string() +
                     "; run the program with FSDP_TRACE=" + dir.string() +
                     " (or ShardingOptions::trace) first");
  }
  return out;
}

json merge(const fs::path& dir) {
  const auto files = rank_files(dir);
  std::vector<json> traces;
  int world = -1;
  for (const auto& [rank, path] : files) {
    traces.push_back(read_json(path));
    const json& meta = traces.back().at("otherData");
    const int w = meta.value("world", 1);
    if (world < 0) world = w;
    if (w != world) {
      throw std::runtime_error(path.string() + " is from a world of " + std::to_string(w) +
                               " ranks, the others from " + std::to_string(world) +
                               ": the directory mixes runs; trace each run into its own directory");
    }
  }
  if (static_cast<int>(files.size()) != world) {
    std::cerr << "fsdp-trace: warning: " << files.size() << " of " << world
              << " ranks' files found in " << dir.string() << "; merging those\n";
  }
  // Each rank's offset: its barrier timestamp becomes rank 0's (or the first rank's).
  const double ref = traces.front().at("otherData").value("sync_ts", 0.0);
  std::vector<double> shift;
  double t0 = 1e300;
  for (const auto& t : traces) {
    const double s = ref - t.at("otherData").value("sync_ts", ref);
    shift.push_back(s);
    for (const auto& e : t.at("traceEvents")) {
      if (e.value("ph", "") == "X") t0 = std::min(t0, e.at("ts").get<double>() + s);
    }
  }
  if (t0 == 1e300) t0 = 0;
  json events = json::array();
  for (size_t i = 0; i < traces.size(); ++i) {
    for (auto e : traces[i].at("traceEvents")) {
      if (e.value("ph", "") == "X") e["ts"] = e.at("ts").get<double>() + shift[i] - t0;
      events.push_back(std::move(e));
    }
  }
  return {{"traceEvents", std::move(events)},
          {"displayTimeUnit", "ms"},
          {"otherData", {{"world", world}, {"ranks", files.size()}, {"merged_by", "fsdp-trace"}}}};
}

struct Span {
  std::string name, cat;
  double ts, dur;
};

// Total length of the union of intervals.
double union_ms(std::vector<std::pair<double, double>> iv) {
  std::sort(iv.begin(), iv.end());
  double total = 0, start = 0, end = -1e300;
  for (const auto& [b, e] : iv) {
    if (b > end) {
      if (end > -1e300) total += end - start;
      start = b;
      end = e;
    } else {
      end = std::max(end, e);
    }
  }
  if (end > -1e300) total += end - start;
  return total / 1e3;
}

void summary(const json& trace, std::ostream& out) {
  std::map<int, std::vector<Span>> by_rank;
  std::map<std::pair<int, int>, std::string> thread_names;
  for (const auto& e : trace.at("traceEvents")) {
    const std::string ph = e.value("ph", "");
    if (ph == "M" && e.value("name", "") == "thread_name") {
      thread_names[{e.value("pid", 0), e.value("tid", 0)}] = e.at("args").value("name", "");
    }
    if (ph != "X") continue;
    by_rank[e.value("pid", 0)].push_back({e.value("name", ""), e.value("cat", ""),
                                          e.at("ts").get<double>(), e.at("dur").get<double>()});
  }
  out << std::fixed << std::setprecision(2);
  for (const auto& [rank, spans] : by_rank) {
    std::map<std::string, std::vector<std::pair<double, double>>> by_cat;
    double first = 1e300, last = -1e300;
    // unit -> kind -> (count, total µs)
    std::map<std::string, std::map<std::string, std::pair<int, double>>> units;
    std::set<std::string> kinds_seen;
    for (const auto& s : spans) {
      by_cat[s.cat].push_back({s.ts, s.ts + s.dur});
      first = std::min(first, s.ts);
      last = std::max(last, s.ts + s.dur);
      const size_t sp = s.name.find(' ');
      if (sp == std::string::npos) continue;
      const std::string kind = s.name.substr(0, sp);
      if (kind != "all_gather" && kind != "forward" && kind != "backward" &&
          kind != "reduce_scatter" && kind != "recompute")
        continue;
      auto& slot = units[s.name.substr(sp + 1)][kind];
      slot.first += 1;
      slot.second += s.dur;
      kinds_seen.insert(kind);
    }
    // A pipeline's point-to-point waits (Note [Pipeline schedules]) are on no
    // communication track: the hidden share is of the collectives' waits alone.
    std::vector<std::pair<double, double>> collective_waits, p2p_waits;
    for (const auto& s : spans) {
      if (s.cat != "wait") continue;
      const bool p2p = s.name.rfind("recv ", 0) == 0 || s.name == "pipeline sends";
      (p2p ? p2p_waits : collective_waits).push_back({s.ts, s.ts + s.dur});
    }
    const double comm = union_ms(by_cat["comm"]);
    const double wait = union_ms(collective_waits);
    out << "rank " << rank << ": " << spans.size() << " spans over " << (last - first) / 1e3
        << " ms\n";
    for (const auto& [cat, iv] : by_cat) {
      out << "  " << std::left << std::setw(12) << cat << std::right << std::setw(10)
          << union_ms(iv) << " ms  (" << iv.size() << " spans)\n";
    }
    if (comm > 0) {
      out << "  communication " << comm << " ms, of which the compute track waited " << wait
          << " ms: " << std::setprecision(1) << 100.0 * std::max(0.0, 1.0 - wait / comm)
          << "% hidden behind compute\n"
          << std::setprecision(2);
    }
    if (!p2p_waits.empty()) {
      out << "  pipeline: " << union_ms(p2p_waits)
          << " ms waiting for the link (receives after the sender posted, the step's sends), "
          << union_ms(by_cat["bubble"]) << " ms in the bubble\n";
    }
    const std::vector<std::string> order{"all_gather", "forward", "recompute", "backward",
                                         "reduce_scatter"};
    out << "  " << std::left << std::setw(16) << "unit (mean ms)";
    for (const auto& k : order) {
      if (kinds_seen.count(k)) out << std::right << std::setw(15) << k;
    }
    out << "\n";
    for (const auto& [unit, kinds] : units) {
      out << "  " << std::left << std::setw(16) << unit;
      for (const auto& k : order) {
        if (!kinds_seen.count(k)) continue;
        auto it = kinds.find(k);
        if (it == kinds.end()) {
          out << std::right << std::setw(15) << "-";
        } else {
          out << std::right << std::setw(15) << it->second.second / it->second.first / 1e3;
        }
      }
      out << "\n";
    }
  }
}

const char* kUsage =
    "usage: fsdp-trace merge DIR [-o FILE] | fsdp-trace summary PATH | fsdp-trace --version";

int run(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) throw UsageError(kUsage);
  if (args[0] == "-h" || args[0] == "--help") {
    std::cout << kUsage << "\n"
              << "  merge:   DIR/trace_rank*.json (FSDP_TRACE=DIR) into one Chrome-trace/Perfetto "
                 "JSON, clocks aligned (default output DIR/trace.json); open it in "
                 "https://ui.perfetto.dev or chrome://tracing\n"
              << "  summary: per rank, time by kind of span, communication hidden behind "
                 "compute, and each unit's mean all-gather, forward, backward, reduce-scatter\n";
    return 0;
  }
  if (args[0] == "--version") {
    std::cout << fsdp::version_line("fsdp-trace") << "\n";
    return 0;
  }
  if (args[0] == "merge") {
    if (args.size() != 2 && !(args.size() == 4 && args[2] == "-o")) throw UsageError(kUsage);
    const fs::path dir = args[1];
    if (!fs::is_directory(dir)) {
      throw UsageError("merge: '" + dir.string() +
                       "' is not a directory; pass the directory FSDP_TRACE named");
    }
    const fs::path out = args.size() == 4 ? fs::path(args[3]) : dir / "trace.json";
    const json merged = merge(dir);
    const fs::path tmp = out.string() + ".tmp";
    {
      std::ofstream f(tmp);
      f << merged.dump() << "\n";
      if (!f.good()) throw std::runtime_error("cannot write " + tmp.string());
    }
    fs::rename(tmp, out);
    std::cout << "fsdp-trace: merged " << merged.at("otherData").at("ranks").get<int>()
              << " ranks into " << out.string() << "\n";
    return 0;
  }
  if (args[0] == "summary") {
    if (args.size() != 2) throw UsageError(kUsage);
    const fs::path p = args[1];
    summary(fs::is_directory(p) ? merge(p) : read_json(p), std::cout);
    return 0;
  }
  throw UsageError("unknown command '" + args[0] + "'; " + kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp::tools::tool_main("fsdp-trace", [&]() { return run(argc, argv); });
}
