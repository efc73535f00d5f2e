#include "relaxed_json.h"

#include <c10/util/Exception.h>

#include <set>
#include <vector>

namespace fsdp::detail {
namespace {

/// Line and column (1-based) of offset `at` in `text`.
std::string line_column(const std::string& text, size_t at) {
  size_t line = 1, column = 1;
  for (size_t i = 0; i < at && i < text.size(); ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(column);
}

/// Comments become spaces (their newlines stay).
std::string blank_comments(const std::string& text, const std::string& what) {
  std::string out = text;
  bool in_string = false;
  for (size_t i = 0; i < out.size(); ++i) {
    const char c = out[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '#' || (c == '/' && i + 1 < out.size() && out[i + 1] == '/')) {
      for (; i < out.size() && out[i] != '\n'; ++i) out[i] = ' ';
    } else if (c == '/' && i + 1 < out.size() && out[i + 1] == '*') {
      const size_t end = out.find("*/", i + 2);
      TORCH_CHECK(end != std::string::npos, what, ": the comment opened at ", line_column(text, i),
                  " is never closed with */");
      for (size_t k = i; k < end + 2; ++k)
        if (out[k] != '\n') out[k] = ' ';
      i = end + 1;
    }
  }
  return out;
}

/// A comma followed (after white space) by } or ] becomes a space.
void blank_trailing_commas(std::string& text) {
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == ',') {
      size_t k = text.find_first_not_of(" \t\r\n", i + 1);
      if (k != std::string::npos && (text[k] == '}' || text[k] == ']')) text[i] = ' ';
    }
  }
}

}  // namespace

nlohmann::json parse_relaxed_json(const std::string& text, const std::string& what) {
  std::string clean = blank_comments(text, what);
  blank_trailing_commas(clean);
  // The keys seen in each object being parsed (innermost last), and each one's current key.
  std::vector<std::set<std::string>> seen;
  std::vector<std::string> current;
  std::string duplicate;
  auto on_event = [&](int /*depth*/, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) {
      seen.emplace_back();
      current.emplace_back();
    } else if (event == E::object_end) {
      seen.pop_back();
      current.pop_back();
    } else if (event == E::key) {
      current.back() = parsed.get<std::string>();
      if (!seen.back().insert(current.back()).second && duplicate.empty()) {
        for (const auto& k : current) duplicate += (duplicate.empty() ? "" : ".") + k;
      }
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(clean, on_event);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, what, ": not valid JSON: ", e.what());
  }
  TORCH_CHECK(duplicate.empty(), what, ": duplicate key ", duplicate,
              " (DeepSpeed refuses it too: \"Duplicate keys in DeepSpeed config\"); keep one");
  return j;
}

}  // namespace fsdp::detail
