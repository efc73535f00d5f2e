#include "config_file.h"

#include "../cli.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

namespace lm {

using examples::UsageError;

std::vector<std::string> config_file_args(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw UsageError("--config " + path + ": cannot open the file");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const std::exception& e) {
    throw UsageError("--config " + path + ": not valid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object())
    throw UsageError("--config " + path + ": the top level must be a JSON object");
  std::vector<std::string> out;
  for (auto& [key, value] : j.items()) {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (flag == "config" || flag == "help")
      throw UsageError("--config " + path + ": key '" + key + "' is not allowed in a config file");
    if (value.is_object() || value.is_array() || value.is_null()) {
      throw UsageError("--config " + path + ": key '" + key +
                       "' must be a number, a string or true/false");
    }
    if (value.is_boolean()) {
      if (value.get<bool>()) out.push_back("--" + flag);
      continue;
    }
    const std::string v = value.is_string() ? value.get<std::string>() : value.dump();
    out.push_back("--" + flag + "=" + v);
  }
  return out;
}

}  // namespace lm
