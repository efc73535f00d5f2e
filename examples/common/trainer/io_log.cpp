#include "io_log.h"

#include "../cli.h"

#include <nlohmann/json.hpp>

#include <chrono>

namespace lm {

IoLog::IoLog(const std::string& path, fsdp::ProcessGroup pg, torch::Device device)
    : pg_(std::move(pg)), device_(device), enabled_(!path.empty()) {
  if (pg_.rank() == 0 && enabled_) {
    file_.open(path, std::ios::app);
    if (!file_) throw examples::UsageError("--io-log " + path + ": cannot write the file");
  }
}

void IoLog::timed(const char* event, const std::function<std::string()>& op) {
  if (enabled_) pg_.barrier();
  const auto start = std::chrono::steady_clock::now();
  const std::string path = op();
  if (enabled_) pg_.barrier();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (file_.is_open())
    file_ << nlohmann::json{{"event", event}, {"path", path}, {"seconds", s}}.dump() << std::endl;
}

void IoLog::record(const char* event, const std::string& path, double seconds) {
  if (!enabled_) return;
  auto t = torch::tensor({seconds}, torch::kFloat64).to(device_);
  pg_.all_reduce_max(t);
  if (file_.is_open()) {
    file_ << nlohmann::json{{"event", event}, {"path", path}, {"seconds", t.item<double>()}}.dump()
          << std::endl;
  }
}

}  // namespace lm
