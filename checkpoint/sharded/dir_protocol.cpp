#include "dir_protocol.h"

#include "../agree.h"
#include "../format/publish.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <optional>
#include <regex>
#include <utility>
#include <vector>

namespace fs = std::filesystem;

namespace fsdp::ckpt {
namespace {

// step_00000100 or step_00000100_2 (a second save at the same step): (step, version).
std::optional<std::pair<int64_t, int64_t>> parse_checkpoint_name(const std::string& name) {
  static const std::regex re("step_([0-9]+)(?:_([0-9]+))?");
  std::smatch m;
  if (!std::regex_match(name, m, re)) return std::nullopt;
  return std::make_pair(std::stoll(m[1].str()), m[2].matched ? std::stoll(m[2].str()) : int64_t{1});
}

}  // namespace

void check_save_args(const ckpt::TrainingState& state, const ckpt::SaveOptions& options,
                     const char* fn) {
  TORCH_CHECK(state.step >= 0, fn, ": step ", state.step, " is negative");
  TORCH_CHECK(options.keep_last >= 0, fn, ": keep_last ", options.keep_last,
              " is negative; use 0 to keep every checkpoint");
}

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

void agree_or_abandon(const ProcessGroup& pg, const SavePlan& plan, const char* fn,
                      const std::string& dir, const std::string& error) {
  if (!any_rank_failed(pg, error)) return;
  if (pg.rank() == 0) {
    std::error_code ec;
    fs::remove_all(plan.tmp, ec);
  }
  TORCH_CHECK(false, fn, " to ", dir, " failed", failure_detail(error),
              ". The previous checkpoint is untouched.");
}

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

}  // namespace fsdp::ckpt
